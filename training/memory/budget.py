"""The budget: the sizes of a run's step chosen to fit its card, before the weights load.

    budget = size(cfg, device, widest, n_eval)     # run.setup: cfg's sizes left at 0 chosen, and said

On CUDA a --gen-chunk or --micro-batch left at 0 (grpo.Config's default) is chosen by `plan`: the sizes
tried (SIZES and the powers of two below them; a size given alone) with the decode engine resident through
the update or released for it, each estimated phase by phase from the model's config
(training/memory/phases.py) with the margin a GPU needs beyond its tensors (margin), against what the card
has free (free_memory: torch.cuda.mem_get_info's free bytes, what other processes hold named; or --gpu-gb, at
most that), less RESERVE of it. The sizes chosen are written into cfg, which
every checkpoint saves to run_config.json, so the sizes a run records are the sizes it uses; a back-off lowers
them (training/memory/backoff.py). Flags that cannot fit, or nothing that fits: a ValueError naming the peak,
the card and what would fit (what_fits), grpo.py's one error line. On the CPU a size left at 0 is SIZES'
(training/memory/shapes.py). `python eval.py memory` prints the table of the plan (planned) beside the other
schemes (evaluation/memory.py).

The margin (context, workspace, fragmentation) is assumed, not measured; RESERVE covers what the estimate is
known to miss (phases.py departure 4: the H100's backward 10.5% above it, not pinned down).

Run: python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24   # the plan for a 24 GB card
     python -m pytest -q tests/memory/test_budget.py
"""

import dataclasses
from types import SimpleNamespace
from typing import NamedTuple

import torch

from training.memory.phases import PHASES, estimate, model_config, peak
from training.memory.shapes import SIZES, engine_rows, largest

GB, GiB = 1e9, 2**30
GPU = 80 * GB  # one 80 GB GPU (A100 / H100), the paper's
CONTEXT = 1 * GB  # CUDA context + cuBLAS / cuBLASLt workspaces, beside the tensors (assumed)
RESERVE = 0.1  # the share of the free memory a plan leaves free (phases.py departure 4: the backward's
# estimate 10.5% below the H100's measure, not pinned down); size and report() plan (1 - RESERVE) of
# it: a free 16 GB T4 (15.8e9 bytes exposed) gets <= 14.2 GB


def margin(cfg, mc, prompt_tokens=256, n_eval=None) -> dict:
    """{cost: bytes} a GPU needs beyond the estimate's tensors (assumed, not measured): the CUDA context and
    cuBLAS workspace, and the allocator's fragmentation, at most one chunk's bf16 prompt cache (P wide). The
    allowance was one whole KV cache (P + R) while the decode cache grew (by concatenation, or an engine
    regrown by a wider prompt): freed blocks too small to reuse. The engine's buffers are now reserved once
    for the run and never freed, so they leave none; what a chunk still allocates and frees is the
    prefill's cache of its prompts, copied to its rows (P wide, freed before the next chunk), and under
    expandable_segments (trainable.device_of) its freed pages are reused. A chunk of held-out evaluation
    (n_eval: as estimate's) prefills each of its rows' prompts, min(gen_chunk, n_eval) of them."""
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    n_eval = (cfg.eval_size if getattr(cfg, "eval_every", 0) else 0) if n_eval is None else n_eval
    g = engine_rows(cfg, n_eval)
    kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * hd * prompt_tokens * g * 2
    return {"CUDA context + cuBLAS workspace": CONTEXT, "fragmentation <= one prompt cache": kv}


def fit(cfg, mc, device="cuda", prompt_tokens=256, budget=GPU, cap=None):
    """The largest gen_chunk (every phase fitting at micro_batch 1: on CUDA the engine's buffers are kept),
    then micro_batch with it (powers of two up to cfg's), whose phases and margin stay under `budget`, or None
    where even 1 does not fit. A size left at 0 starts from SIZES'."""

    def top(cfg, field, phases):
        n = getattr(cfg, field)
        while n >= 1:
            c = SimpleNamespace(**{**vars(cfg), field: n})
            est = estimate(c, mc, device, prompt_tokens, cap=cap)
            extra = sum(margin(c, mc, prompt_tokens).values())
            if all(sum(est[k].values()) + extra <= budget for k in phases):
                return n
            n = n // 2 if n & (n - 1) == 0 else 2 ** (n.bit_length() - 1)
        return None

    cfg = largest(cfg)
    one = SimpleNamespace(**{**vars(cfg), "micro_batch": 1})  # the decode engine's buffers stay
    g = top(one, "gen_chunk", PHASES)  # through the update: all phases count
    return g, top(SimpleNamespace(**{**vars(cfg), "gen_chunk": g or 1}), "micro_batch", PHASES[1:4])


class Plan(NamedTuple):
    gen_chunk: int | None  # rows per generate call that fit (None: no size tried fits)
    micro_batch: int | None  # rows per forward / backward that fit (None: as gen_chunk)
    phase: str  # the phase of the peak: of the sizes chosen, or of the smallest tried
    peak: float  # that peak in bytes, the margin included
    tried: tuple  # (gen_chunk, micro_batch) the peak is of
    release: bool = False  # the engine released for the update (LAYOUTS[1]); False: resident through it


# the decode engine through the update: kept (its graphs captured once a run), or freed after each rollout,
# reserved and its graphs captured again before the next
LAYOUTS = ("resident", "released")


def sizes(cfg, field):
    """The sizes tried for a flag: its value alone where one was given, and at 0 SIZES' and the powers of
    two below it."""
    n = getattr(cfg, field)
    return [n] if n else [SIZES[field]] + [2**k for k in range(SIZES[field].bit_length() - 2, -1, -1)]


def plan(cfg, mc, device, prompt_tokens, budget, n_eval=None, cap=None) -> Plan:
    """The gen_chunk, micro_batch and engine layout whose step fits `budget` bytes in every phase, the margin
    included: cfg's sizes where given, the sizes tried for each left at 0 (sizes); each with the engine
    resident through the update (on CUDA its buffers, sized by gen_chunk, stay) and, where it has one,
    released for it (the update's phases without them). Of those that fit, the one whose smaller fraction of
    the largest sizes tried is largest (both halved alike), then the larger gen_chunk, then the engine
    resident: a released engine is captured again every step, so it is picked only where it lets larger
    sizes fit. `size` sizes a run with it; n_eval: its held-out questions, cap: the card's compute
    capability (estimate's)."""
    best, low = None, None
    layouts = (False, True) if torch.device(device).type == "cuda" and cfg.share_prefix else (False,)
    top_g, top_m = sizes(cfg, "gen_chunk")[0], sizes(cfg, "micro_batch")[0]
    for g in sizes(cfg, "gen_chunk"):
        for release in layouts:
            for m in sizes(cfg, "micro_batch"):
                c = SimpleNamespace(**{**vars(cfg), "gen_chunk": g, "micro_batch": m})
                est = estimate(c, mc, device, prompt_tokens, n_eval=n_eval, release=release, cap=cap)
                ph, top = peak(est)
                top += sum(margin(c, mc, prompt_tokens, n_eval).values())
                if low is None or top < low[1]:
                    low = (ph, top, (g, m), release)
                if top <= budget:
                    key = (min(g / top_g, m / top_m), g, not release)
                    if best is None or key > best[0]:
                        best = (key, Plan(g, m, ph, top, (g, m), release))
                    break  # the largest micro_batch at this gen_chunk, layout
    return best[1] if best else Plan(None, None, *low)


def planned(cfg, mc, device, prompt_tokens, n_eval=None, cap=None):
    """(cfg at the sizes grpo.py would run, its Plan, the card in bytes) on CUDA, as `size` plans them:
    --gpu-gb (else one 80 GB GPU) less RESERVE, the sizes left at 0 chosen; cfg at its largest sizes where
    nothing fits. Elsewhere (cfg at the CPU's sizes, None, None): the CPU is not sized."""
    if torch.device(device).type != "cuda":
        return largest(cfg), None, None
    card = getattr(cfg, "gpu_gb", 0) * GB or GPU
    p = plan(cfg, mc, device, prompt_tokens, card * (1 - RESERVE), n_eval, cap)
    if p.gen_chunk is None:
        return largest(cfg), p, card
    sizes_ = {"gen_chunk": p.gen_chunk, "micro_batch": p.micro_batch}
    return (
        (
            dataclasses.replace(cfg, **sizes_)
            if dataclasses.is_dataclass(cfg)
            else SimpleNamespace(**{**vars(cfg), **sizes_})
        ),
        p,
        card,
    )


def what_fits(cfg, mc, device, prompt_tokens, budget, n_eval=None, cap=None) -> str:
    """What would fit `budget` where cfg does not, as the end of grpo.py's error line: the sizes given
    chosen instead (a smaller --micro-batch, --gen-chunk, or 0), --lora-rank 16 (full fine-tuning), a smaller
    model."""
    out = []
    p = plan(
        SimpleNamespace(**{**vars(cfg), "gen_chunk": 0, "micro_batch": 0}),
        mc,
        device,
        prompt_tokens,
        budget,
        n_eval=n_eval,
        cap=cap,
    )
    if p.gen_chunk is not None and (cfg.gen_chunk or cfg.micro_batch):
        out.append(f"--gen-chunk {p.gen_chunk} --micro-batch {p.micro_batch} would fit")
    if getattr(cfg, "lora_rank", 0) == 0:
        lora = SimpleNamespace(
            **{**vars(cfg), "lora_rank": 16, "optimizer": "auto", "gen_chunk": 0, "micro_batch": 0}
        )  # kahan is not LoRA's
        q = plan(lora, mc, device, prompt_tokens, budget, n_eval=n_eval, cap=cap)
        out.append(
            f"--lora-rank 16 would fit (gen_chunk {q.gen_chunk}, micro_batch {q.micro_batch}, peak "
            f"{q.peak / GB:.1f} GB)"
            if q.gen_chunk
            else f"--lora-rank 16 needs {q.peak / GB:.1f} GB"
        )
    return "; ".join(out + ["or a smaller model, or fewer --max-new-tokens"])


class Budget(NamedTuple):
    """What `size` sized the step to."""

    total: float  # the card's bytes: its total, or --gpu-gb
    source: str  # where `total` came from: "--gpu-gb" or "torch.cuda.mem_get_info"
    plan: Plan  # the sizes, the engine's layout, the peak with the margin
    free: float = 0.0  # what the step may use: the card's free bytes (or --gpu-gb, at most them) and this
    # process's context, which the margin counts
    planned: float = 0.0  # what the plan fits: `free` less RESERVE of it


class Card(NamedTuple):
    """The card as `size` sees it before the weights load (free_memory)."""

    total: float  # its bytes: the GPU's total, or --gpu-gb
    source: str  # "torch.cuda.mem_get_info" or "--gpu-gb"
    usable: float  # what the step may use: free now, and this process's context (the margin counts it)
    words: str  # "10.0 GB free of 80.0 GB (torch.cuda.mem_get_info): 70.0 GB held by other processes",
    # or "24.0 GB (--gpu-gb)"


def free_memory(cfg, device) -> Card:
    """What the step may use on the card: what torch.cuda.mem_get_info says is free, and this process's CUDA
    context (up to CONTEXT of what is held: margin counts it, once); the rest held is other processes', named.
    --gpu-gb N: N, but at most that (a card with less free says so); past the card: the card's, said."""
    free, card = torch.cuda.mem_get_info(device)
    held = card - free
    ours = min(held, CONTEXT)  # this process's context (mem_get_info made it), counted in the margin
    words = f"{free / GB:.1f} GB free of {card / GB:.1f} GB (torch.cuda.mem_get_info)" + (
        f": {held / GB:.1f} GB held by other processes" if held > CONTEXT else ""
    )
    if cfg.gpu_gb and cfg.gpu_gb * GB > card:
        print(
            f"budget: --gpu-gb {cfg.gpu_gb:g} is more than the GPU's {card / GB:.1f} GB "
            f"(torch.cuda.mem_get_info): the step is sized to the card"
        )
    if cfg.gpu_gb and cfg.gpu_gb * GB <= card:
        asked = cfg.gpu_gb * GB
        if asked <= free + ours:
            return Card(asked, "--gpu-gb", asked, f"{asked / GB:.1f} GB (--gpu-gb)")
        return Card(asked, "--gpu-gb", free + ours, f"{asked / GB:.1f} GB (--gpu-gb), but {words}")
    return Card(card, "torch.cuda.mem_get_info", free + ours, words)


def size(cfg, device, widest, n_eval=0) -> Budget | None:
    """The sizes left at 0 chosen, written into cfg and said in one line (a size given is kept). On the CPU:
    SIZES', None. On CUDA, before the weights load: the step's estimate (from the model's config alone,
    prompts `widest` tokens wide, n_eval held-out questions: `plan`) against what is free on the card
    (free_memory: the GPU's free memory or --gpu-gb, other processes' named) less RESERVE of it; the largest
    sizes that fit, with the engine's layout (resident through the update, or released for it). Flags that
    cannot fit, or nothing that fits: ValueError (grpo.py's one error line) naming the peak, the free memory
    and what would fit."""
    chosen = ", ".join(k for k in SIZES if getattr(cfg, k) == 0) or "none, as given"
    if device.type != "cuda":
        zero = [k for k in SIZES if getattr(cfg, k) == 0]
        for k in zero:
            setattr(cfg, k, SIZES[k])
        if zero:
            print(
                f"budget: the CPU: gen_chunk {cfg.gen_chunk}, micro_batch {cfg.micro_batch} (chosen: "
                f"{chosen}; a GPU's are sized to its card)"
            )
        return None
    card = free_memory(cfg, device)
    budget = card.usable * (1 - RESERVE)  # the reserve, of what the step may use
    plans = f"{budget / GB:.1f} GB planned (a {RESERVE:.0%} reserve of what is free)"
    mc = model_config(cfg.model)  # the config alone, no weights
    p = plan(cfg, mc, device, widest, budget, n_eval)
    if p.gen_chunk is not None:
        cfg.gen_chunk, cfg.micro_batch = p.gen_chunk, p.micro_batch
        layout = (
            "released for the update (reserved again for each rollout)"
            if p.release
            else "resident through the update"
        )
        print(
            f"budget: {card.words}; {plans}: gen_chunk {p.gen_chunk}, micro_batch {p.micro_batch}, the "
            f"decode engine {layout} (chosen: {chosen}; peak {p.peak / GB:.1f} GB in {p.phase}, margin "
            f"included)"
        )
        return Budget(card.total, card.source, p, card.usable, budget)
    raise ValueError(
        f"the step needs about {p.peak / GB:.1f} GB at its peak ({p.phase}; gen_chunk "
        f"{p.tried[0]}, micro_batch {p.tried[1]}, {widest}-token prompts + {cfg.max_new_tokens} "
        f"new tokens, margin included) and the GPU has {card.words}; {plans}: "
        + what_fits(cfg, mc, device, widest, budget, n_eval)
    )
