"""Generation speed on the CPU: what transformers offers, measured at grpo.py's embedded shape.

Generation is the largest phase of a CPU GRPO step once the credit is fused. This script times
models.generate at the shape of benchmarks/credit_overhead.py (SmolLM2-135M, 4 prompts x G = 4 rows,
64 new tokens, chat prompts, sampling at App. C.3's settings, one thread) with each option, in alternating
rounds (the machine is shared), and prints the median seconds, tokens/s and the ratio to the baseline:

  baseline   models.generate as grpo.py calls it: a dynamic KV cache, gen_chunk rows per generate call
  static     cache_implementation="static": a preallocated KV cache
  compile    the static cache plus torch.compile of the model's forward (the decode step); the first call
             compiles, and its time is printed apart (a GRPO run meets new prompt widths every step)
  bucketed   prompts sorted by token length before chunking, so a chunk pads less (only matters when
             rows > gen_chunk); rows are put back in the grouped order

Run:  python benchmarks/generate_speed.py                    # ~10 minutes on 2 CPU cores
      python benchmarks/generate_speed.py --options baseline static --rounds 2 --gen-chunk 16
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
from models import generate, load_model  # noqa: E402

OPTIONS = ("baseline", "static", "compile", "bucketed")


def run(model, tok, prompts, args, option, seed):
    torch.manual_seed(seed)
    extra = {"cache_implementation": "static"} if option in ("static", "compile") else {}
    order = sorted(range(len(prompts)), key=lambda i: len(tok(prompts[i]).input_ids)) if option == "bucketed" \
        else list(range(len(prompts)))
    t0 = time.perf_counter()
    g = generate(model, tok, [prompts[i] for i in order], n=args.group_size, max_new_tokens=args.max_new_tokens,
                 temperature=0.99, top_p=1.0, top_k=100, chunk_size=args.gen_chunk, **extra)
    return time.perf_counter() - t0, sum(map(len, g.response_ids))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="generate_speed.py", description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=OPTIONS, help="options to time")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--model", default="smollm2-135m", help="a models.load_model name")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per generate call")
    ap.add_argument("--group-size", type=int, default=4, help="rows per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="response budget")
    ap.add_argument("--gen-chunk", type=int, default=8, help="rows per generate call (grpo.py's embedded 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    if min(args.rounds, args.prompts, args.group_size, args.max_new_tokens, args.gen_chunk, args.threads) < 1:
        ap.error("every count must be >= 1")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device="cpu", dtype=torch.float32)
    recs = data.load_task("arithmetic", split="train", seed=0)
    prompts = [data.make_prompt(r, tok, "chat") for r in recs[:args.prompts * 8:8]]     # varied lengths
    if "compile" in args.options:
        compiled = torch.compile(model.forward, dynamic=True)
    times = {o: [] for o in args.options}
    for r in range(args.rounds):
        for o in args.options:
            if o == "compile":
                model.forward, plain = compiled, model.forward
            try:
                s, n = run(model, tok, prompts, args, o, seed=r)
            finally:
                if o == "compile":
                    model.forward = plain
            times[o].append((s, n))
            print(f"round {r + 1}: {o:<9} {s:7.2f} s  {n} tokens", flush=True)
    base = statistics.median(s for s, _ in times["baseline"]) if "baseline" in times else None
    print(f"\n{'option':<10}{'median s':>10}{'tok/s':>8}{'ratio':>10}   (first call, incl. compile)")
    for o, ts in times.items():
        steady = ts[1:] if o == "compile" and len(ts) > 1 else ts
        med = statistics.median(s for s, _ in steady)
        tps = statistics.median(n / s for s, n in steady)
        ratio = f"{med / base:10.3f}" if base else "         -"
        print(f"{o:<10}{med:>10.2f}{tps:>8.1f}{ratio}   ({ts[0][0]:.1f} s)")
    print(f"({args.prompts} prompts x {args.group_size} x {args.max_new_tokens} new tokens, gen_chunk "
          f"{args.gen_chunk}, {args.threads} thread(s), {args.rounds} rounds; load {os.getloadavg()[0]:.1f})")
    return times


if __name__ == "__main__":
    main()
