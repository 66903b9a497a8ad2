"""Rollout speed: plain HF generate against shared-prefix rollouts (CPU), the decode engine against HF (GPU).

rollout.generate(share_prefix=True) prefills the prefix that all prompts share once, each prompt's own suffix
once, copies the cache to the prompt's G rows and decodes into a preallocated cache, dropping each row from
the forward once it has emitted EOS (rollout.py departure 1).
share_prefix=False is plain HF generate on the repeated, left-padded rows. This script times both on the same
prompts with the same seed, alternating rounds (the machine is shared), checks that they return the same
tokens, and prints the median wall and CPU seconds and the ratios shared / plain, at two shapes:

  embedded   grpo.py's embedded run: SmolLM2-135M, 2 few-shot arithmetic prompts (~375 tokens) x G = 4,
             128 new tokens, gen_chunk 8, App. C.3 sampling (T = 0.99, top-k 100)
  long       8 prompts x 8 rows, 512-token prompts (a shared 448-token preamble, then the question), 64 new
             tokens, gen_chunk 64

--profile adds a torch profile of one shared call (the top operators by self time): where a decode step goes.
--device cuda (or --engine on the CPU) times the GPU's decoders instead, at the shape gpu (or tiny, the CPU
smoke test): benchmarks/decode_speed.py's table (the engine, HF generate with its dynamic and static cache,
each beside the bandwidth bound), with the same flags.
--update times the update's forward + backward instead (token_logprobs, each prompt read once): one
micro-batch of the first prompt's G rows (its first --prompt-tokens, if given) with random responses of
R - 3j tokens (row j, R = --response-tokens), each prompt read once (shared) against one pass over every
row's [prompt | response] (plain); the log-probs agree to 1e-4. --grad-checkpointing runs it with the decoder
layers checkpointed by `checkpointing`, as grpo.py sets them up. The decoder's passes are counted: a shared
call that fell back to the full pass (one pass, not two) prints one line, and its ratio is no measurement.
After the timed rounds, one more call of each path under memtrace.track_peak gives its peak live tensor bytes
(weights and gradients included).

Run:  python benchmarks/generate_speed.py                          # embedded shape, 3 rounds, one thread
      python benchmarks/generate_speed.py --device cuda --model qwen3-4b-random --rounds 2   # the GPU table
      python benchmarks/generate_speed.py --device cuda --model qwen3-4b-random --rounds 2 --no-static \
          --json runs/decoders.json                                     # the engine and HF dynamic only
      python benchmarks/generate_speed.py --device cuda --model qwen3-4b-random --max-new-tokens 1024 \
          --sampled --rounds 1                                          # the 1K table's sampled shape
      python benchmarks/generate_speed.py --device cpu --engine --model tiny-qwen3 --shape tiny --rounds 1
      python benchmarks/generate_speed.py --shape long --rounds 1
      python benchmarks/generate_speed.py --rounds 1 --profile
      python benchmarks/generate_speed.py --update --rounds 5           # the update's micro-batch
      python benchmarks/generate_speed.py --update --grad-checkpointing --response-tokens 64 --rounds 4
      python benchmarks/generate_speed.py --update --grad-checkpointing --prompt-tokens 150 \
          --response-tokens 512 --rounds 2                              # a DAPO-like prompt, long responses
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import grpo  # noqa: E402
from benchmarks import decode_speed  # noqa: E402
from data import build_batch  # noqa: E402
from training.decode.rollout import Sampling, generate, prompt_ids  # noqa: E402
from training.model.load import load_model  # noqa: E402
from training.policy import checkpointing, token_logprobs  # noqa: E402

SHAPES = {
    "embedded": dict(prompts=2, group_size=4, max_new_tokens=128, gen_chunk=8),
    "long": dict(prompts=8, group_size=8, max_new_tokens=64, gen_chunk=64),
    **decode_speed.SHAPES,  # gpu, tiny: the decoders' table (--engine)
}


def shape_prompts(tok, shape, n):
    """The embedded run's few-shot prompts, or (long) 512-token prompts: a shared preamble of exemplars,
    then each question (decode_speed.wide_prompts)."""
    if shape == "embedded":
        recs = data.load_task("arithmetic", split="train", seed=0)[:n]
        return [data.make_prompt(r, tok, "fewshot3") for r in recs]
    return decode_speed.wide_prompts(tok, 512, n)


def run(model, tok, prompts, s, share, seed):
    """(wall seconds, CPU seconds of this process, the generations): on a shared machine the CPU time is the
    steadier of the two (other jobs stretch the wall clock, not this process's own work)."""
    sampling = Sampling.of(grpo.Config(max_new_tokens=s["max_new_tokens"]))  # grpo.py's rollouts (App. C.3)
    torch.manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    g = generate(
        model, tok, prompts, s["group_size"], sampling, chunk_size=s["gen_chunk"], share_prefix=share
    )
    return time.perf_counter() - t0, time.process_time() - c0, g


def update(model, tok, prompts, s, share, seed):
    """--update: (wall seconds, CPU seconds, (the log-probs, the decoder's passes)) of one update micro-batch,
    forward + backward."""
    b = update_batch(model, tok, prompts, s, seed)
    t0, c0 = time.perf_counter(), time.process_time()
    out = forward_backward(model, b, share)
    return time.perf_counter() - t0, time.process_time() - c0, out


def forward_backward(model, b, share):
    """One update micro-batch from zero gradients, forward + backward: the (B, R) log-probs, detached, and
    how many times the decoder ran forward (shared: 2, the prompts then the responses; the full pass: 1)."""
    model.train()
    model.zero_grad(set_to_none=True)
    passes = []
    hook = model.get_decoder().register_forward_hook(lambda *_: passes.append(1))
    try:
        lp, _ = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, share_prefix=share)
    finally:
        hook.remove()
    (lp * b.response_mask[:, b.prompt_width :]).sum().backward()
    return lp.detach(), len(passes)


def update_batch(model, tok, prompts, s, seed):
    """The G rows of the first prompt (cut to s["prompt_tokens"] if set) with random responses of R - 3j."""
    g, R = torch.Generator().manual_seed(seed), s["response_tokens"]
    vocab = min(len(tok), model.config.vocab_size)
    prompt = prompt_ids(tok, prompts[:1])[0][: s["prompt_tokens"] or None]
    resp = [torch.randint(vocab, (R - 3 * j,), generator=g).tolist() for j in range(s["group_size"])]
    return build_batch(tok, [prompt] * s["group_size"], resp)


def update_peak(model, tok, prompts, s, share):
    """Peak live tensor bytes of one update micro-batch (memtrace.track_peak), weights and gradients in."""
    from evaluation.memtrace import track_peak

    b = update_batch(model, tok, prompts, s, 0)
    model.zero_grad(set_to_none=True)  # the previous call's gradients are not this call's
    with track_peak(model) as tr:
        tr.phase("update")
        forward_backward(model, b, share)
    return tr.peak["update"]


def profile(model, tok, prompts, s):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        _, _, g = run(model, tok, prompts, s, True, seed=0)
    steps = max(map(len, g.response_ids))
    print(f"\nprofile of one shared call ({steps} decode steps):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="generate_speed.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument(
        "--shape",
        default=None,
        choices=SHAPES,
        help="embedded or long; with --engine: gpu or tiny (default embedded; gpu with --engine)",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the GPU table (--engine)")
    ap.add_argument(
        "--engine",
        action="store_true",
        help="the engine beside HF generate, dynamic and static cache (the default with --device cuda)",
    )
    ap.add_argument("--sampled", action="store_true", help="with --engine: time App. C.3 sampling")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="with --engine: override the shape's")
    ap.add_argument(
        "--no-static",
        action="store_true",
        help="with --engine: leave out HF's static cache (and its compilation); ratios to HF's dynamic cache",
    )
    ap.add_argument("--model-step", action="store_true", help="with --engine: + the engine's model step")
    ap.add_argument(
        "--lora-rank", type=int, default=0, help="with --engine: the decoders on LoRA of this rank"
    )
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (plain / shared, or decoders)")
    ap.add_argument("--model", default="smollm2-135m", help="a load.load_model name")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--profile", action="store_true", help="also profile one shared call")
    ap.add_argument("--update", action="store_true", help="time the update's micro-batch instead (above)")
    ap.add_argument("--grad-checkpointing", action="store_true", help="with --update: checkpointed layers")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="with --update: cut the prompt to this many tokens (0: the shape's whole prompt)",
    )
    ap.add_argument("--response-tokens", type=int, default=100, help="with --update: R, row j has R - 3j")
    ap.add_argument("--json", default="", help="also write what is printed here (with --engine)")
    args = ap.parse_args(argv)
    args.engine |= args.device == "cuda"
    args.shape = args.shape or ("gpu" if args.engine else "embedded")
    if args.engine and (args.update or args.profile or args.shape not in ("gpu", "tiny")):
        ap.error("--device cuda / --engine: --shape gpu or tiny, without --update or --profile")
    if not args.engine and (
        args.sampled
        or args.max_new_tokens
        or args.no_static
        or args.json
        or args.model_step
        or args.lora_rank
        or args.shape in ("gpu", "tiny")
    ):
        ap.error(
            "--sampled, --max-new-tokens, --no-static, --model-step, --lora-rank, --json and --shape gpu / "
            "tiny need --engine (or --device cuda)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible (--device cpu --engine --shape tiny shows the format)")
    if min(args.rounds, args.threads) < 1 or min(args.prompt_tokens, args.max_new_tokens, args.lora_rank) < 0:
        ap.error("--rounds and --threads must be >= 1, --prompt-tokens, --max-new-tokens, --lora-rank >= 0")
    if args.response_tokens < 3 * SHAPES[args.shape]["group_size"]:
        ap.error(f"--response-tokens must be >= {3 * SHAPES[args.shape]['group_size']} (row j has R - 3j)")
    if not args.update and (args.grad_checkpointing or args.prompt_tokens or args.response_tokens != 100):
        ap.error("--grad-checkpointing, --prompt-tokens and --response-tokens need --update")
    torch.set_num_threads(args.threads)
    s = {**SHAPES[args.shape], "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens}
    if args.engine:
        out = decode_speed.compare(args, {**s, "max_new_tokens": args.max_new_tokens or s["max_new_tokens"]})
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return out
    model, tok = load_model(args.model, device="cpu", dtype=torch.float32)
    if args.grad_checkpointing:
        checkpointing(model)  # as grpo.py: the shared prompt's keys survive
    prompts = shape_prompts(tok, args.shape, s["prompts"])
    lens = [len(p) for p in prompt_ids(tok, prompts)]
    times, cpu, same, fell = {"plain": [], "shared": []}, {"plain": [], "shared": []}, True, False
    for r in range(args.rounds):
        outs = {}
        for name in ("plain", "shared") if r % 2 == 0 else ("shared", "plain"):
            sec, c, outs[name] = (update if args.update else run)(model, tok, prompts, s, name == "shared", r)
            times[name].append(sec)
            cpu[name].append(c)
            if args.update:
                outs[name], passes = outs[name]
                if name == "shared" and passes < 2 and not fell:  # said once
                    print(
                        "generate_speed.py: the shared-prompt update fell back to the full pass (one "
                        "decoder pass): shared/full below is no measurement of sharing"
                    )
                    fell = True
            made = (
                f"log-probs {tuple(outs[name].shape)}"
                if args.update
                else f"{sum(map(len, outs[name].response_ids))} tokens"
            )
            print(f"round {r + 1}: {name:<7}{sec:8.2f} s wall {c:8.2f} s CPU  {made}", flush=True)
        same &= (
            torch.allclose(outs["plain"], outs["shared"], atol=1e-4)
            if args.update
            else outs["plain"] == outs["shared"]
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    if args.update:
        P = min(lens[0], args.prompt_tokens or lens[0])
        shape = (
            f"update: {s['group_size']} rows of a {P}-token prompt, {args.response_tokens} - 3j "
            f"response tokens{', gradient checkpointing' if args.grad_checkpointing else ''}"
        )
    else:
        shape = (
            f"{args.shape}: {s['prompts']} prompts x {s['group_size']}, prompt tokens {min(lens)}-"
            f"{max(lens)}, {s['max_new_tokens']} new tokens, gen_chunk {s['gen_chunk']}"
        )
    print(f"\n{shape}, {args.threads} thread(s), {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for what, m in (("wall", med), ("CPU", mcpu)):
        print(
            f"{what:<5} {'full pass' if args.update else 'plain HF'} {m['plain']:8.2f} s   shared "
            f"{m['shared']:8.2f} s   ratio shared/plain {m['shared'] / m['plain']:.3f}"
        )
    print(
        f"same {'log-probs' if args.update else 'tokens'} in every round: {same}"
        f"{'; the shared update FELL BACK to the full pass' if fell else ''}"
    )
    peak = {}
    if args.update:
        peak = {name: update_peak(model, tok, prompts, s, name == "shared") for name in ("plain", "shared")}
        print(
            f"peak  full pass {peak['plain'] / 1e6:8.1f} MB   shared {peak['shared'] / 1e6:8.1f} MB   "
            f"ratio shared/plain {peak['shared'] / peak['plain']:.3f}"
        )
    if args.profile:
        profile(model, tok, prompts, s)
    return {"wall": med, "cpu": mcpu, "same": same, "peak": peak, "fell_back": fell}


if __name__ == "__main__":
    main()
