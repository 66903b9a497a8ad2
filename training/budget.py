"""The budget a run is sized to: what one GRPO step holds, and the sizes that fit a card.

SIZES are the largest a run chooses: a --gen-chunk or --micro-batch left at 0 runs at them on the CPU, and on
CUDA the plan (evaluation/memory.py) tries them and the powers of two below, the largest that fit the card.
"""
import dataclasses
from types import SimpleNamespace

SIZES = {"gen_chunk": 64, "micro_batch": 8}   # a size left at 0 (grpo.Config): what the CPU runs, and where a
                                             # plan on CUDA starts (the powers of two below it tried too)


def largest(cfg):
    """cfg with each size left at 0 at SIZES' (the CPU's sizes; the largest a plan tries): a copy; cfg
    itself where none is 0."""
    zero = {k: v for k, v in SIZES.items() if getattr(cfg, k) == 0}
    if not zero:
        return cfg
    return dataclasses.replace(cfg, **zero) if dataclasses.is_dataclass(cfg) else \
        SimpleNamespace(**{**vars(cfg), **zero})
