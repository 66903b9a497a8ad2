"""Credit overhead: each signal's credit time (signal + shaping) as a ratio of one GRPO step.

FlowTracer Table 6 reports its credit at 2.1-4.5% of a step; OAR Fig. 7 reports the whole step with OAR-G at
1.4x a GRPO step and with OAR-P at 4.2x. This script measures both ratios here, on one rollout batch:

  1. grpo.train runs `--bench-steps` (default 2) plain GRPO steps with a capturing signal: it records the
     step's rollout batch (flowtracer.Batch), the policy and the config, and returns all-1 scores (plain
     GRPO). The step time is "time/step" of the last step (the first one is a warm-up).
  2. Each signal then runs on that same policy and batch under grpo's own context (no_grad, bf16 autocast on
     CUDA), followed by its shaping rule: one warm-up call, then the median of `--repeats` timed calls.

Printed per signal: seconds, credit / step, and (step + credit) / step, the normalisation of OAR Fig. 7.
Targets: flow <= 5% of a step on the CPU (Table 6: 2-4.5% on GPUs); OAR-G (step + credit) / step <= 1.4 and
OAR-P <= 4.2 (OAR Fig. 7, a stricter reading than credit / step).

Any flag grpo.py accepts is passed on (the default is grpo's embedded SmolLM2-135M setting on the CPU).
Run:  python benchmarks/credit_overhead.py
      python benchmarks/credit_overhead.py --signals flow oar-g --max-new-tokens 256 --device cuda
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import credit  # noqa: E402
import grpo  # noqa: E402

PAIRING = {"none": "topk", "flow": "topk", "random": "topk", "entropy": "topk", "attention": "topk",
           "attention-max": "topk", "oar-g": "bilevel", "oar-p": "bilevel"}  # each signal's shaping in the papers
TARGET = {"flow": ("credit/step", 0.05), "oar-g": ("(step+credit)/step", 1.4), "oar-p": ("(step+credit)/step", 4.2)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_signal(name, model, batch, cfg, repeats):
    """Median seconds of SIGNALS[name] + its shaping on the batch, under grpo's credit context."""
    device = batch.input_ids.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    for i in range(repeats + 1):                      # call 0 is a warm-up (allocator, kernels, caches)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), autocast:
            scores = credit.SIGNALS[name](model, batch, cfg)
            w = credit.SHAPINGS[PAIRING.get(name, "topk")](scores, batch, cfg).weights
        sync(device)
        if not torch.isfinite(w).all():
            raise FloatingPointError(f"{name}: non-finite credit weights")
        times.append(time.perf_counter() - t0)
        if i == 0 and times[0] > 60:                  # slow signal: the warm-up call is the measurement
            return times[0]
    return statistics.median(times[1:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--signals", nargs="+", default=[s for s in credit.SIGNALS if s != "none"],
                    choices=sorted(credit.SIGNALS), help="signals to time")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per signal after one warm-up")
    ap.add_argument("--bench-steps", type=int, default=2, help="GRPO steps; the last one is timed")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default); on a shared "
                    "machine 1 avoids threads spinning against other processes")
    args, rest = ap.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    captured = {}

    def capture(model, batch, cfg):                   # plain GRPO, remembering what the credit phase saw
        captured.update(model=model, batch=batch, cfg=cfg)
        return credit.signal_none(model, batch, cfg)

    credit.SIGNALS["capture"] = capture
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = grpo.parse_args(rest + ["--credit", "capture", "--shaping", "topk", "--steps", str(args.bench_steps),
                                          "--out-dir", tmp, "--save-every", "1000000", "--rollouts-every", "1000000"])
            metrics = grpo.train(cfg)
    finally:
        del credit.SIGNALS["capture"]
    if not metrics or "batch" not in captured:
        raise SystemExit("grpo.train ran no step (every prompt skipped or filtered?); nothing to time")
    step = metrics[-1]
    model, batch, cfg = captured["model"], captured["batch"], captured["cfg"]
    B, T = batch.input_ids.shape
    n = int(batch.response_mask.sum())
    dev = batch.input_ids.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{cfg.model} on {name}: batch {B} x {T} tokens ({n} response tokens), prompt width {batch.prompt_width}")
    print(f"GRPO step {step['time/step']:.2f} s = generate {step['time/generate']:.2f}"
          f" + reward {step['time/reward']:.2f} + credit {step['time/credit']:.2f}"
          f" + update {step['time/update']:.2f} (step {step['step']})\n")
    print(f"{'signal':<14}{'shaping':<9}{'credit s':>10}{'credit/step':>13}{'(step+credit)/step':>20}  target")
    rows = []
    for s in args.signals:
        t = time_signal(s, model, batch, cfg, args.repeats)
        r = {"signal": s, "shaping": PAIRING.get(s, "topk"), "seconds": t, "credit/step": t / step["time/step"],
             "(step+credit)/step": 1 + t / step["time/step"]}
        goal = TARGET.get(s)
        verdict = f"{goal[0]} <= {goal[1]}: {'met' if r[goal[0]] <= goal[1] else 'MISSED'}" if goal else ""
        print(f"{s:<14}{r['shaping']:<9}{t:>10.3f}{r['credit/step']:>13.3f}{r['(step+credit)/step']:>20.3f}  {verdict}")
        rows.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": cfg.model, "device": name, "batch": [B, T],
                                               "step": step, "signals": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
