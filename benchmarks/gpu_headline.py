"""The one-GPU headline in one command: Qwen3-4B's GRPO step at 1K and 8K on one 80 GB GPU, measured.

For each response budget R (--max-new-tokens, default 1,024 and 8,192) it runs grpo.py's step on
qwen3-4b-random (Qwen3-4B's architecture, random weights: no download) and prints:

  memory      each phase's peak, measured by memtrace.measure (one real step, the second one) as
              torch.cuda.max_memory_allocated and max_memory_reserved, beside phases.estimate (what
              `python eval.py memory` prints) and the ratio estimate / allocated
  overhead    the flow credit's cost as a fraction of the step: one rollout batch, then grpo.update on it
              (grpo.py's own micro-batch loop: token_logprobs under capture, baselines.assign, grpo_loss,
              backward, the optimizer step), --credit none and flow alternating for --rounds rounds (medians);
                fraction = (update_flow - update_none) / (generate + update_none)
  generation  tokens/s of rollout.generate (every row runs to R: min_new_tokens; on CUDA rollout.generate
              takes it to training/decode/engine.py, grpo.py's decode, prefix sharing on; on the CPU it turns
              sharing off: HF generate, each row pays its prompt's prefill) beside the
              memory-bandwidth bound: each decode step reads every weight once and the KV cache of its rows,
                bytes = sum over chunks of g rows, over steps t = P .. P+R-1, of
                        (weight bytes + g t 2 L Hkv hd kv_bytes)
                bound tok/s = generated tokens * bandwidth / bytes   (--bandwidth: the card's)
and once, at the largest R, the memory of the attention maps: one no-grad forward of --attn-rows rows of
P + R tokens, plain, under attention.capturing and with eager output_attentions (attention_memory.py).

Each step is sized as grpo.py's setup sizes it (budget.size: budget.plan's gen_chunk, micro_batch and
the engine's layout under 80 GB or --gpu-gb, margin included; the header says which): the 8K step gets
gen_chunk 32, micro_batch 8 with the engine released for the update. It rolls out as grpo.py does: on CUDA
through the run's decode engine, made and reserved once as setup makes it (memtrace.run_engine), so the
update it measures holds the engine's cache (or not, where the plan releases it). The line "engine release"
measures what the released layout costs a step (benchmarks/engine_release.py), with the graphs a rollout
captured (each captured again every step once released).
Generation dominates the run time at 8K: three rollouts (memtrace.measure's two steps and the one here) of
8,192 decode steps per gen_chunk of rows; `--max-new-tokens 1024` prints the 1K table alone. Run on one H100
on 2026-11-25 (main at 9550070, before the decode engine; docs/gpu.md has the table). On the CPU,
`allocated` is memtrace.track_peak's count of live tensor bytes and there is no reserved pool ("-").

Departures (numbered):
 1. The prompts are random printable text of about --prompt-tokens tokens (the byte tokenizer of the random
    models: exactly), and the answer region is the last 8 response tokens of every row, so that every row is
    trained (A = +-1) and credited: the worst step, as memory.py counts it.
 2. The overhead's update runs grpo.update, grpo.train's micro-batch loop, on a fixed batch (the same rows
    for both signals); grpo.py's own step also reads rewards and logs, which cost the same with either signal.
 3. The bandwidth bound leaves out the prefill (compute-bound) and sampling: an upper bound on a perfectly
    bandwidth-bound decoder, not a prediction (benchmarks/decode_speed.py, its departure 1).

Time on one H100 (estimated from the work, before the decode engine; not measured since): the 1K table
takes minutes, the 8K one about 2 hours at the defaults, nearly all of it three rollouts of 8 chunks x 8,192
sequential decode steps. --quick measures the flow overhead alone at 1K and 8K in under 10 minutes: the
overhead is a training-forward figure (update with flow credit vs without, on the same batch), so its
rollouts are short (--quick-tokens new tokens, then random tokens up to R: the update reads the same
shapes) and its batch is 2 prompts x G rows unless --prompts-per-step says otherwise; no memory
measurement, no generation speed, no attention maps. It reports the overhead as a share of the update;
its share of the step needs a full rollout.

Run:  python benchmarks/gpu_headline.py                                  # one 80 GB GPU: the headline
      python benchmarks/gpu_headline.py --quick                          # the flow overhead, < 10 minutes
      python benchmarks/gpu_headline.py --max-new-tokens 1024 --rounds 5 # the 1K step only
      python benchmarks/gpu_headline.py --max-new-tokens 1024 --rounds 1 --lora-rank 16 --load-in-4bit \
          --gpu-gb 12                                                    # QLoRA held to a 12 GB card
      python benchmarks/gpu_headline.py --model tiny-qwen3 --device cpu --max-new-tokens 16 32 \\
          --prompt-tokens 16 --prompts-per-step 2 --group-size 2 --micro-batch 2 --gen-chunk 4 --rounds 1
                                                                         # the format, on a CPU, in seconds
"""

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
from benchmarks import attention_memory, engine_release  # noqa: E402
from benchmarks.decode_speed import bandwidth_bound, card_bandwidth  # noqa: E402
from data import build_batch  # noqa: E402
from evaluation import memtrace  # noqa: E402
from flowtracer import (
    head_mean_kernel,  # noqa: E402
    select_layers,  # noqa: E402
)
from training.credit import baselines  # noqa: E402
from training.decode.rollout import Sampling, generate  # noqa: E402
from training.memory import budget, phases
from training.run import log
from training.run.setup import load_for_update  # noqa: E402

ANSWER_TOKENS = 8  # departure 1


# ----------------------------------------------------------------------------- the step's pieces
def step_config(args, R):
    """(grpo.py's Config for this shape, parsed by grpo.py: its checks; whether the plan releases the engine
    for the update): on CUDA its chunks and the engine's layout sized to the card (or --gpu-gb, then enforced
    by the allocator) as grpo.py's setup sizes them (budget.size)."""
    flags = dict(
        model=args.model,
        device=args.device,
        max_new_tokens=R,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        micro_batch=args.micro_batch,
        gen_chunk=args.gen_chunk,
        credit="flow",
        lora_rank=args.lora_rank,
        gpu_gb=args.gpu_gb,
    )
    argv = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    cfg = grpo.parse_args(argv + ["--load-in-4bit"] * args.load_in_4bit)  # its one error line: no LoRA
    if args.device == "cuda":
        if args.gpu_gb:  # a smaller card on a large one: the allocator's limit
            total = torch.cuda.mem_get_info()[1]
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_gb * budget.GB / total))
        try:
            sized = budget.size(cfg, torch.device("cuda"), args.prompt_tokens)
        except ValueError as e:
            raise SystemExit(f"gpu_headline.py: error: R = {R}: {e}") from None
        return cfg, sized.plan.release
    return budget.largest(cfg), False  # the CPU's sizes, as setup's


def synced(device):
    """perf_counter after the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def load(cfg, device, P, short=0):
    """The policy and optimizer as run.setup makes them (trainable.load_policy), the `run` grpo's step
    functions read, and on CUDA the run's decode engine (run.engine), made and reserved as setup makes it
    (preflight.make_engine: memtrace.run_engine), for the prompts `prompts` (run.prompts) and every row
    running to its budget (min_new_tokens: max_new_tokens, or --quick's `short`)."""
    run = load_for_update(cfg, device)  # run.setup's policy and credit
    g = torch.Generator().manual_seed(0)
    lens = [P - (i * 7) % max(1, P // 4) for i in range(cfg.prompts_per_step)]  # as memtrace.measure's
    run.prompts = [
        "".join(chr(32 + int(c)) for c in torch.randint(95, (n,), generator=g)) for n in lens
    ]  # departure 1
    run.new = min(short, cfg.max_new_tokens) if short else cfg.max_new_tokens
    run.policy.model.generation_config.min_new_tokens = run.new  # the engine reads it when it is made
    run.engine = memtrace.run_engine(cfg, run.policy.model, run.policy.tok, run.prompts, device)
    return run, run.policy.tok


def rollout(run, tok, P, short=0):
    """One rollout batch of every row at max_new_tokens: (Batch with the answer region, seconds, tokens),
    through the run's engine on CUDA (on the CPU, as before the engine: HF generate, min_new_tokens).
    short > 0 (--quick): `short` tokens are sampled, then random printable ones fill each row up to R."""
    cfg, g = run.cfg, torch.Generator().manual_seed(1)
    run.policy.model.eval()
    t0 = synced(run.policy.device)
    with torch.no_grad(), run.policy.autocast:
        n, extra = run.new, {} if run.engine is not None else {"min_new_tokens": run.new}
        gen = generate(
            run.policy.model,
            tok,
            run.prompts,
            cfg.group_size,
            Sampling.of(cfg)._replace(max_new_tokens=n),  # the run's sampling, n new tokens
            chunk_size=cfg.gen_chunk,
            engine=run.engine,
            **extra,
        )
    seconds = synced(run.policy.device) - t0
    if short:  # up to R: the shapes
        gen = gen._replace(
            response_ids=[
                r + torch.randint(32, 127, (cfg.max_new_tokens - len(r),), generator=g).tolist()
                for r in gen.response_ids
            ]
        )
    batch = build_batch(tok, gen.prompt_ids, gen.response_ids).to(run.policy.device)
    n = batch.response_mask.sum(-1, keepdim=True)  # (B, 1)
    col = torch.arange(batch.input_ids.shape[1], device=run.policy.device) - batch.prompt_width  # (T,)
    answer = (col >= n - ANSWER_TOKENS) & (col < n)  # (B, T) last tokens
    return batch._replace(answer_mask=answer), seconds, sum(map(len, gen.response_ids))


def update(run, tok, batch, signal):
    """grpo.update (grpo.py's own micro-batch loop) on `batch` with --credit `signal` (departure 2); returns
    its seconds (log.Clock: synchronized on CUDA)."""
    run.cfg = dataclasses.replace(run.cfg, credit=signal)
    run.layers = (
        select_layers(run.cfg.layers, run.policy.model.config.num_hidden_layers)
        if baselines.reads_maps(run.cfg)
        else []
    )  # as setup.py's setup
    if baselines.reads_maps(run.cfg) and run.head_mean is None:
        run.head_mean = head_mean_kernel(run.policy.device)
    B = batch.input_ids.shape[0]
    adv = torch.tensor([1.0, -1.0] * (B // 2) + [1.0] * (B % 2), device=run.policy.device)  # (B,) all trained
    clock = log.Clock(run.policy.device)  # grpo.update marks it
    grpo.update(run, batch, list(range(B)), adv, clock)
    return sum(clock.seconds.values())


# ----------------------------------------------------------------------------- the tables
def headline(args, R, device):
    """Every number of one table (response budget R) as a dict: memory, overhead, generation, attention."""
    cfg, release = step_config(args, R)
    P, B = args.prompt_tokens, cfg.prompts_per_step * cfg.group_size
    res = dict(
        max_new_tokens=R,
        prompt_tokens=P,
        rows=B,
        gen_chunk=cfg.gen_chunk,
        micro_batch=cfg.micro_batch,
        engine=budget.LAYOUTS[release] if device.type == "cuda" else "-",
    )
    if not args.quick:
        est = phases.estimate(cfg, phases.model_config(cfg.model), device.type, P, release=release)
        reserved = {}
        measured = memtrace.measure(cfg, P, grpo.update, device, reserved=reserved, release=release)
        res["memory"] = {
            ph: dict(
                estimate=sum(est[ph].values()),
                allocated=measured[ph],
                reserved=reserved.get(ph),
                ratio=sum(est[ph].values()) / measured[ph],
            )
            for ph in phases.PHASES
        }
        free(device)
    run, tok = load(cfg, device, P, args.quick_tokens if args.quick else 0)
    before = run.engine.captures if run.engine is not None else 0
    batch, gen_s, tokens = rollout(run, tok, P, args.quick_tokens if args.quick else 0)
    graphs = run.engine.captures - before if run.engine is not None else None  # a rollout's graphs
    if not args.quick:
        res["rereserve"] = engine_release.release_cost(
            cfg, run.policy.model, tok, run.prompts, run.engine, run.new, run.policy.autocast, graphs
        )
    if release and run.engine is not None:
        run.engine.release()  # the update without it, as grpo.py's
    times = {"none": [], "flow": []}
    update(run, tok, batch, "none")  # warm-up, not counted
    for r in range(args.rounds):
        for s in ("none", "flow") if r % 2 == 0 else ("flow", "none"):  # alternating
            times[s].append(update(run, tok, batch, s))
    off, on = (statistics.median(times[s]) for s in ("none", "flow"))
    res["overhead"] = dict(
        generate_s=gen_s,
        update_none_s=off,
        update_flow_s=on,
        step_none_s=gen_s + off,
        step_flow_s=gen_s + on,
        fraction=(on - off) / (gen_s + off),
        rounds=args.rounds,
        of_update=(on - off) / off,
        response_tokens=batch.input_ids.shape[1] - P,
    )
    if args.quick:  # a short rollout: no step share, no generation
        res["overhead"].update(generate_s=None, step_none_s=None, step_flow_s=None, fraction=None)
        del run, batch
        free(device)
        return res
    bound = bandwidth_bound(run.policy.model, cfg, P, args.bandwidth)
    res["generation"] = dict(
        tokens=tokens,
        seconds=gen_s,
        tok_s=tokens / gen_s,
        bound_tok_s=bound,
        of_bound=tokens / gen_s / bound,
        bandwidth=args.bandwidth,
    )
    if R == max(args.max_new_tokens):
        res["attention"] = attention_memory.attention_maps(
            run.policy.model, cfg.layers, args.attn_rows, P + R
        )
    del run, batch
    free(device)
    return res


def free(device):
    """Return what the last model held to the allocator, so that the next phase starts from it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def show(args, res, device):
    """One table as text: GB on a GPU, MB on the CPU."""
    unit, name = (1e9, "GB") if device.type == "cuda" else (1e6, "MB")
    f = lambda v: f"{v / unit:10.2f}" if v is not None else f"{'-':>10s}"  # noqa: E731
    m = res.get("memory", {})
    print(
        f"\n== {args.model} on {device.type}: {res['rows']} rows ({args.prompts_per_step} prompts x "
        f"{args.group_size}), {res['prompt_tokens']} + {res['max_new_tokens']} tokens, gen_chunk "
        f"{res['gen_chunk']}, micro_batch {res['micro_batch']}, engine {res['engine']} =="
    )
    if m:
        print(f"memory ({name})     estimate  allocated   reserved  estimate/allocated")
    for ph, d in m.items():
        print(f"  {ph:15s}{f(d['estimate'])} {f(d['allocated'])} {f(d['reserved'])} {d['ratio']:10.3f}")
    o = res["overhead"]
    if args.quick:
        print(
            f"flow credit    update {o['update_none_s']:.3f} s (none), {o['update_flow_s']:.3f} s (flow): "
            f"+{100 * o['of_update']:.2f}% of the update (rounds: {o['rounds']}; --quick: no step share)"
        )
        return
    print(
        f"flow credit    update {o['update_none_s']:.3f} s (none), {o['update_flow_s']:.3f} s (flow); "
        f"generate {o['generate_s']:.3f} s; {100 * o['fraction']:.2f}% of the step (rounds: {o['rounds']})"
    )
    g = res["generation"]
    print(
        f"generation     {g['tokens']} tokens in {g['seconds']:.2f} s = {g['tok_s']:.1f} tok/s; bound "
        f"{g['bound_tok_s']:.1f} tok/s at {g['bandwidth'] / 1e12:.2f} TB/s: "
        f"{100 * g['of_bound']:.3g}% of it"
    )
    if e := res.get("rereserve"):
        print(engine_release.line(e, unit, name))
    if a := res.get("attention"):
        attention_memory.show(a, unit, name)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="gpu_headline.py",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        epilog="Time on one H100 (estimated): the 1K table "
        "minutes, the 8K table about 2 hours (three 8K rollouts); --quick, the flow "
        "overhead alone at 1K and 8K: under 10 minutes.",
    )
    ap.add_argument(
        "--model", default="qwen3-4b-random", help="a load.py name (qwen3-4b-random: no download)"
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the format only")
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[1024, 8192], help="one table each")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt width (memory.py's default)")
    ap.add_argument(
        "--prompts-per-step", type=int, default=None, help="the paper's 1K step on one GPU: 16 (--quick: 2)"
    )
    ap.add_argument("--group-size", type=int, default=8, help="G rollouts per prompt (App. C.3)")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="rows per forward (grpo.py's; 0: sized to the card on CUDA, 8 on the CPU)",
    )
    ap.add_argument(
        "--gen-chunk",
        type=int,
        default=0,
        help="rows per generate call (grpo.py's; 0: sized to the card on CUDA, 64 on the CPU)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="alternating none / flow update rounds")
    ap.add_argument("--attn-rows", type=int, default=1, help="rows of the attention-map forward")
    ap.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="bytes/s (default: the card's, decode_speed.CARD_BANDWIDTH)",
    )
    ap.add_argument("--lora-rank", type=int, default=0, help="grpo.py's --lora-rank (0: full fine-tuning)")
    ap.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="grpo.py's --load-in-4bit (with --lora-rank): a 4-bit base",
    )
    ap.add_argument(
        "--gpu-gb",
        type=float,
        default=0.0,
        help="size the step to this many GB and hold the allocator to it (0: the card's own)",
    )
    ap.add_argument("--json", default="", help="also write every number here")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the flow overhead alone, short rollouts: < 10 minutes on an H100 (docstring)",
    )
    ap.add_argument("--quick-tokens", type=int, default=16, help="--quick: tokens sampled per row")
    args = ap.parse_args(argv)
    if args.prompts_per_step is None:
        args.prompts_per_step = 2 if args.quick else 16
    counts = ("prompt_tokens", "prompts_per_step", "rounds", "attn_rows", "quick_tokens")
    for flag, ok in [
        *((k, getattr(args, k) >= 1) for k in counts),
        *((k, getattr(args, k) >= 0) for k in ("micro_batch", "gen_chunk")),
        ("max_new_tokens", min(args.max_new_tokens) >= 1),
        ("group_size", args.group_size >= 2),
        ("bandwidth", args.bandwidth is None or math.isfinite(args.bandwidth) and args.bandwidth > 0),
    ]:
        if not ok:
            least = {"group_size": 2, "micro_batch": 0, "gen_chunk": 0}.get(flag, 1)
            ap.error(
                f"--{flag.replace('_', '-')} must be >= {least}"
                if flag != "bandwidth"
                else "--bandwidth must be a positive number of bytes/s"
            )
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible (--device cpu --model tiny-qwen3 shows the format)")
    device = torch.device(args.device)
    if args.bandwidth is None:
        args.bandwidth, card = card_bandwidth(device)
        print(f"bandwidth bound: {card}'s {args.bandwidth / 1e12:.2f} TB/s (--bandwidth to give another)")
    results = []
    for R in args.max_new_tokens:
        results.append(headline(args, R, device))
        show(args, results[-1], device)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
