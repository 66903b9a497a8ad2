"""The table of `python eval.py memory`: what one GRPO step holds, phase by phase, and how it fits a card.

The estimate is training/memory/phases.py's (the five phases of grpo.py's step, from the model's config), and
the plan training/memory/budget.py's (the sizes grpo.py's setup chooses for a card, before the weights load);
this module prints them: `report` is the table of the plan grpo.py would run on CUDA (budget.planned: its
sizes and the decode engine's layout, resident through the update or released for it: layout_line), the
schemes side by side (kahan, adamw, lora), the margin and the card, the disk a checkpoint needs
(checkpoint.checkpoint_bytes; from the second save two coexist, and grpo.py checks the free space at setup),
what grpo.py picks for the card (`picks`: the sizes budget.size chooses, or that nothing fits and what would;
the CPU's sizes on the CPU), and last the peak. With --measure, evaluation/memtrace.py runs one real step and
its measured peaks are printed beside the estimate (tests/memory/test_phases.py holds them within 10%).
`command` is `eval.py memory`: grpo.py's flags (add_flags: memory's own, the rest grpo.py's), planned for the
card, printed by report.

The scheme that fits Qwen3-4B (bf16 weights, gradients and AdamW states + a bf16 Kahan compensation,
10 B/param) and why the fp32 design does not (16 B/param + autocast's bf16 weight cache): docs/method.md.

Run: python eval.py memory --model qwen3-4b-random                       # the table, in a second
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24   # LoRA on a 24 GB card
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 16 --capability 7.5   # a T4: fp16
     python eval.py memory --model qwen3-4b-random --max-new-tokens 8192 --gen-chunk 16 --micro-batch 4
     python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
"""

from types import SimpleNamespace

import torch

from evaluation import memtrace
from training.memory.budget import GB, LAYOUTS, RESERVE, GiB, margin, planned, what_fits
from training.memory.phases import COMPONENTS, estimate, model_config, peak
from training.memory.shapes import lora_linears, param_counts
from training.model.trainable import precision, precision_problem, scheme
from training.run.checkpoint import checkpoint_bytes


def table(est, title, unit=GB) -> str:
    """The estimate as a fixed-width table, one row per phase (unit GB = 1e9 bytes, or MB = 1e6)."""
    head = f"{'phase':15s}" + "".join(f"{k:>12s}" for k in (*COMPONENTS, "total"))
    rows = [
        f"{ph:15s}" + "".join(f"{v / unit:12.2f}" for v in (*comp.values(), sum(comp.values())))
        for ph, comp in est.items()
    ]
    return "\n".join([title, head, *rows])


def base_words(cfg) -> str:
    """The title's words for --load-in-4bit (", a 4-bit nf4 base"; nested: "(nested)"), else ""."""
    if not getattr(cfg, "load_in_4bit", False):
        return ""
    return f", a 4-bit {cfg.bnb_4bit_quant_type}{' (nested)' if cfg.use_bnb_nested_quant else ''} base"


def layout_line(cfg, mc, device, prompt_tokens, release, unit=GB, name="GB", cap=None):
    """One line: the engine's layout in force and what the other would give at the same sizes."""
    kept, freed = (estimate(cfg, mc, device, prompt_tokens, release=r, cap=cap) for r in (False, True))
    cache = kept["backward"]["KV cache"]  # the engine's K, V buffers
    copy = kept["backward"]["weights"] - freed["backward"]["weights"]  # its fused step's copy of the weights
    what = f"its cache and {copy / unit:.2f} {name} of copied weights" if copy else "its cache"
    (kph, ktop), (fph, ftop) = peak(kept), peak(freed)
    if release:
        return (
            f"engine: released for the update ({(cache + copy) / unit:.2f} {name}, {what}, freed after each "
            f"rollout, "
            f"reserved and its graphs captured again before the next); resident it would peak at "
            f"{ktop / unit:.2f} {name} in {kph}"
        )
    return (
        f"engine: resident through the update (its graphs captured once); released for it, the update's "
        f"phases would hold {(cache + copy) / unit:.2f} {name} less ({what}) and the step peak at "
        f"{ftop / unit:.2f} {name} in {fph}, its graphs captured again every step"
    )


def report(cfg, prompt_tokens=256, measured=None, device="cuda", cap=None, grads=None) -> str:
    """The table of `python eval.py memory`, the schemes side by side, the fit, `picks`; last the peak. On
    CUDA the table is of the plan grpo.py would run (planned: the sizes and the engine's layout). cap: the
    card's compute capability (eval.py memory --capability; None: the device's own). grads: {phase:
    memtrace.Grads} of a measured CPU step, printed beside the estimate's "grads"."""
    mc, given = model_config(cfg.model), cfg
    cfg, p, card = planned(cfg, mc, device, prompt_tokens, cap=cap)
    release = bool(p and p.gen_chunk and p.release)
    est = estimate(cfg, mc, device, prompt_tokens, release=release, cap=cap)
    unit, name = (GB, "GB") if peak(est)[1] >= GB else (1e6, "MB")
    T = prompt_tokens + cfg.max_new_tokens
    which = "" if p is None else f", the plan for {card / GB:g} GB" if p.gen_chunk else ", as given"
    out = [
        precision(cfg, device, cap).line,
        table(
            est,
            f"{cfg.model} on {device}, scheme {scheme(cfg, device, cap)}{base_words(cfg)}: "
            f"{cfg.prompts_per_step} x "
            f"{cfg.group_size} rows of {prompt_tokens} + {cfg.max_new_tokens} = {T} tokens, "
            f"gen_chunk {cfg.gen_chunk}, micro_batch {cfg.micro_batch}, "
            f"logprob_chunk {cfg.logprob_chunk}{which} ({name})",
            unit,
        ),
    ]
    if measured:
        out.append(f"measured ({'torch.cuda.max_memory_allocated' if device != 'cpu' else 'track_peak'}):")
        out += [
            f"  {ph:15s} estimate {sum(c.values()) / unit:10.2f}  measured {measured[ph] / unit:10.2f}  "
            f"ratio {sum(c.values()) / measured[ph]:.3f}"
            for ph, c in est.items()
        ]
    if grads:
        out.append(
            "gradients at each phase's peak (track_peak, told apart by the autograd node making them):"
        )
        out += [
            f"  {ph:15s} .grad {g.grad / unit:7.2f} (estimate {c['grads'] / unit:.2f}), made and waiting for "
            f"the rest of their sum {g.waiting / unit:7.2f} (estimate 0; {len(g.params)} parameters)"
            for ph, c in est.items()
            for g in [grads.get(ph)]
            if g is not None
        ]
    if p is not None and cfg.share_prefix:
        out.append(layout_line(cfg, mc, device, prompt_tokens, release, unit, name, cap))
    for other, four in (("adamw", False), ("kahan", False), ("lora", False), ("lora", True)):
        c = (
            {"optimizer": other, "lora_rank": 0}
            if other != "lora"
            else {"lora_rank": cfg.lora_rank or 16, "optimizer": "auto"}
        )
        c = SimpleNamespace(**{**vars(cfg), **c, "load_in_4bit": four})
        c.precision = "auto" if precision_problem(c) else c.precision  # fp16 is LoRA's, bf16 kahan's
        q = peak(estimate(c, mc, device, prompt_tokens, release=release, cap=cap))
        out.append(
            f"scheme {other:6s}: peak {q[1] / unit:.2f} {name} in {q[0]}"
            + (f" (--lora-rank {c.lora_rank}{', --load-in-4bit' if four else ''})" if other == "lora" else "")
        )
    ph, top = peak(est)
    if p is not None:
        m = margin(cfg, mc, prompt_tokens)
        out.append(
            f"budget {card / GB:g} GB, margin assumed {sum(m.values()) / GB:.2f} GB ("
            + ", ".join(f"{k} {v / GB:.2f}" for k, v in m.items())
            + f"): {card * (1 - RESERVE) / GB:.1f} GB planned, a {RESERVE:.0%} reserve"
        )
    lora = scheme(cfg, device, cap) == "lora"
    n = (
        mc.num_hidden_layers * cfg.lora_rank * sum(i + o for i, o in lora_linears(cfg, mc))
        if lora
        else param_counts(mc)[0]
    )
    disk = checkpoint_bytes(n, scheme(cfg, device, cap))
    out.append(
        f"disk: a checkpoint {disk / GB:.2f} GB (weights + optimizer state), {2 * disk / GB:.2f} GB "
        f"free from the second save on (ckpt/ beside ckpt.tmp/; grpo.py checks it at setup)"
    )
    out.append(picks(given, cfg, p, card, mc, device, prompt_tokens, cap))
    out.append(f"peak {top / GB:.2f} GB ({top / GiB:.2f} GiB) in {ph}")
    return "\n".join(out)


def picks(given, cfg, p, card, mc, device, prompt_tokens, cap=None) -> str:
    """The report's line of what grpo.py's setup (budget.size) picks with these flags on a card of `card`
    bytes, all of it free (--gpu-gb; without it one 80 GB GPU: on a GPU grpo.py plans what that card has
    free), or that nothing fits and what would; on the CPU the CPU's sizes. given: the flags as given (a size
    left at 0 is chosen), cfg: at the sizes planned."""
    left = [k for k in ("gen_chunk", "micro_batch") if getattr(given, k) == 0]
    chosen = f"chosen: {', '.join(left)}" if left else "as given"
    if p is None:
        return (
            f"grpo.py picks gen_chunk {cfg.gen_chunk}, micro_batch {cfg.micro_batch} on the CPU ({chosen}; "
            f"the CPU's sizes: a CPU is not sized)"
        )
    on = f"--gpu-gb {given.gpu_gb:g}" if given.gpu_gb else "one free 80 GB GPU (no --gpu-gb)"
    planned_ = f"{card * (1 - RESERVE) / GB:,.1f} GB planned of {card / GB:g} GB"
    if p.gen_chunk is None:
        return (
            f"grpo.py picks nothing for {on}: the step needs {p.peak / GB:.2f} GB at its peak with the "
            f"margin ({p.phase}; gen_chunk {p.tried[0]}, micro_batch {p.tried[1]}), more than the "
            f"{planned_}: " + what_fits(given, mc, device, prompt_tokens, card * (1 - RESERVE), cap=cap)
        )
    return (
        f"grpo.py picks gen_chunk {p.gen_chunk}, micro_batch {p.micro_batch}, the engine "
        f"{LAYOUTS[p.release]}, for {on} ({chosen}; {p.peak / GB:.2f} GB at its peak with the margin, "
        f"in {p.phase}, of {planned_})"
    )


# ----------------------------------------------------------------------------- eval.py memory
def add_flags(p):
    """memory's own flags; any grpo.py flag may follow them (args.grpo_flags, for command)."""
    p.add_argument("--prompt-tokens", type=int, default=256, help="padded prompt width of the step")
    p.add_argument("--measure", action="store_true", help="also run one real step (GPU if present), compare")
    p.add_argument(
        "--capability",
        type=float,
        help="the card's compute capability (7.5: a T4): --precision "
        "auto's choice and the attention kernel (default: the visible GPU's, else 8.0)",
    )
    p.add_argument(
        "--snapshot",
        metavar="PATH",
        default=None,
        help="with --measure on a GPU: record the 2nd micro-batch's backward (every block and its "
        "stack) to PATH and print what its peak holds, by site",
    )


def command(args, grpo):
    """`eval.py memory`: the estimate of each phase of grpo.py's step (report) from grpo.py's flags
    (args.grpo_flags, checked by its parser), with --measure one real step beside it, with --snapshot the
    backward's peak by site (memtrace.report_held). grpo: the grpo.py module (its parser and its update).
    Bad input is a ValueError."""
    cfg = asked = grpo.parse_args(args.grpo_flags, for_gpu=True)  # --gpu-gb: it plans for a GPU anywhere
    device = "cuda" if cfg.device != "cpu" and (torch.cuda.is_available() or not args.measure) else "cpu"
    if args.capability is not None and not 3 <= args.capability < 20:  # a float: any number parses
        raise ValueError(f"--capability must be a compute capability like 7.5 or 9.0, got {args.capability}")
    cap = None if args.capability is None else (int(args.capability), round(args.capability * 10) % 10)
    cfg, plan, _ = planned(cfg, model_config(cfg.model), device, args.prompt_tokens, cap=cap)
    release = bool(plan and plan.gen_chunk and plan.release)
    est = estimate(cfg, model_config(cfg.model), device, args.prompt_tokens, release=release, cap=cap)
    if args.measure and device == "cpu" and peak(est)[1] > 8e9:
        raise ValueError(
            "--measure on the CPU is for small models (tiny-qwen3, smollm2-135m); the estimate "
            f"is {peak(est)[1] / 1e9:.0f} GB"
        )
    if args.snapshot and not (args.measure and device == "cuda"):
        raise ValueError("--snapshot records a GPU's allocator: it needs --measure and a CUDA device")
    grads = {}  # the CPU's: the gradients at each phase's peak
    measured = (
        memtrace.measure(
            cfg, args.prompt_tokens, grpo.update, device, snapshot=args.snapshot, release=release, grads=grads
        )
        if args.measure
        else None
    )
    table = report(asked, args.prompt_tokens, measured, device, cap, grads)  # the plan again, its sizes said
    return table + (
        "\n" + memtrace.report_held(args.snapshot, sum(est["backward"].values())) if args.snapshot else ""
    )
