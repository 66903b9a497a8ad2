"""Credit overhead (FlowTracer Table 6, OAR Fig. 7): what each credit signal costs a whole GRPO step.

With the fused pass the credit of flow, attention and entropy happens inside the update's own forward, so
the only honest measure is whole steps: this script runs `grpo.py` once per configuration, in `--rounds`
alternating rounds (this machine is shared and noisy: alternation spreads the noise over every
configuration alike), each run a fresh process with the same seed and flags, and reads its metrics.jsonl.
The first `--warmup` steps of every run are not counted.

Printed per configuration (medians over the counted steps of all rounds):
  s/step, generate, credit, update        grpo.py's own phase timers (time/*)
  step ratio      s/step / s/step of the first configuration (--credit none by default)     Table 6's view
  sweep ratio     (credit + update) / (credit + update) of the first configuration          OAR Fig. 7's view:
                  the update sweep with GRPO = 1x (generation excluded)
  tok/s           generated tokens per second of generation

`--same-batch` times the credit alone against the noise of a shared machine: one process generates one
rollout batch, then runs grpo.train's step on that same batch (same weights, same rows) for each signal in
turn, `--rounds` times, alternating; a step is then generate (once) + reward + credit + update of that run.

`--grpo PATH` runs another checkout's grpo.py as well (e.g. the commit before the fused pass, from
`git worktree add /tmp/before <commit>`), labelled "before:<credit>", so that before/after is measured in
the same session.

Run:  python benchmarks/credit_overhead.py                      # SmolLM2, 4 prompts x 4 x 64 tokens, chat
      python benchmarks/credit_overhead.py --signals none flow oar-g oar-p --rounds 1 --steps 3
      python benchmarks/credit_overhead.py --grpo /tmp/before/grpo.py --signals none flow --every-row-trained
      python benchmarks/credit_overhead.py --same-batch --every-row-trained --rounds 5
      python benchmarks/credit_overhead.py --same-batch --cpu-clock --rounds 6 --prompt-style fewshot3 \
          --no-grad-checkpointing --lr 1e-12                  # flow/none at the embedded shape
Any other flag is passed on to grpo.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = [
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-new-tokens",
    "64",
    "--grad-checkpointing",
    "--prompt-style",
    "chat",
    "--save-every",
    "1000",
    "--rollouts-every",
    "1000",
]
# --every-row-trained: a reward that varies within every group (the fraction of digits in the response, plus
# a tie-breaker under 0.1 from its code points, so that a random model's digit-free group varies too), so
# that every row has A != 0 and gets credit, a forward and a backward: the worst case for the credit's
# cost. The verifier's reward on a small model is often 0 for a whole group, and such rows skip all of it.
TOY = "lambda txt, rec: sum(c.isdigit() for c in txt) / max(1, len(txt)) + sum(map(ord, txt)) % 97 / 970"
DRIVER = f"import sys, data, grpo; data.reward = {TOY}; grpo.train(grpo.parse_args(sys.argv[1:]))"
PAIRING = {"oar-g": "bilevel", "oar-p": "bilevel"}  # each signal's shaping in the papers; topk otherwise


def run_once(grpo_py, signal, steps, flags, threads, tmp, every_row):
    out = Path(tmp) / f"{Path(grpo_py).parent.name}-{signal}-{len(list(Path(tmp).iterdir()))}"
    cmd = [
        sys.executable,
        *(["-c", DRIVER] if every_row else [str(grpo_py)]),
        *SHAPE,
        *flags,
        "--credit",
        signal,
        "--shaping",
        PAIRING.get(signal, "topk"),
        "--steps",
        str(steps),
        "--out-dir",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(grpo_py).parent)
    if p.returncode != 0:
        raise SystemExit(f"credit_overhead.py: error: {' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def same_batch(args, flags):
    """Every signal's step on one cached rollout batch, in alternating rounds, in this process."""
    import time

    import torch

    sys.path.insert(0, str(ROOT))
    import grpo

    torch.set_num_threads(args.threads)
    cached, real = {}, grpo.generate
    now = time.process_time if args.cpu_clock else time.perf_counter

    def generate_once(*a, **k):  # the first call generates; every later step reuses it
        if "gen" not in cached:
            t0 = now()
            cached["gen"] = real(*a, **k)
            cached["s"] = now() - t0
        return cached["gen"]

    grpo.generate = generate_once
    if args.cpu_clock:  # phases in CPU seconds of this process (log.Clock's now)
        from training.run import log

        wall = log.Clock
        grpo.log.Clock = lambda device: wall(device, now=time.process_time)
    if args.every_row_trained:
        grpo.data.reward = eval(TOY)  # the DRIVER's reward, in this process
    rows = {s: [] for s in args.signals}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for s in args.signals:
                out = Path(tmp) / f"{s}-{r}"
                cfg = grpo.parse_args(
                    [
                        *SHAPE,
                        *flags,
                        "--credit",
                        s,
                        "--shaping",
                        PAIRING.get(s, "topk"),
                        "--steps",
                        "1",
                        "--out-dir",
                        str(out),
                    ]
                )
                m = grpo.train(cfg).history[0]
                rows[s].append(m)
                print(
                    f"round {r + 1}: {s:<14} credit {m['time/credit']:.2f} s  "
                    f"update {m['time/update']:.2f} s  rows trained {m['rows/trained']}",
                    flush=True,
                )
    med = {
        s: {k: statistics.median(m[k] for m in ms) for k in ("time/reward", "time/credit", "time/update")}
        for s, ms in rows.items()
    }
    step = {s: cached["s"] + d["time/reward"] + d["time/credit"] + d["time/update"] for s, d in med.items()}
    base = args.signals[0]
    print(
        f"\ngenerate (once) {cached['s']:.2f} s\n{'signal':<14}{'credit':>8}{'update':>8}{'step':>8}"
        f"{'step ratio':>12}{'sweep ratio':>13}"
    )
    for s, d in med.items():
        sweep = (d["time/credit"] + d["time/update"]) / (med[base]["time/credit"] + med[base]["time/update"])
        print(
            f"{s:<14}{d['time/credit']:>8.2f}{d['time/update']:>8.2f}{step[s]:>8.2f}"
            f"{step[s] / step[base]:>12.3f}{sweep:>13.3f}"
        )
    print(
        f"(medians of {args.rounds} alternating rounds on one batch, {args.threads} thread(s), "
        f"{'CPU seconds of this process' if args.cpu_clock else 'wall seconds'}; "
        f"load {os.getloadavg()[0]:.1f})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"generate_s": cached["s"], "median": med, "rows": rows}, indent=1)
        )
    return med


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="credit_overhead.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument("--signals", nargs="+", default=["none", "flow"], help="--credit values; the first is 1x")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds over the configurations")
    ap.add_argument("--steps", type=int, default=5, help="GRPO steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run not counted")
    ap.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of each run")
    ap.add_argument("--grpo", default="", help="another checkout's grpo.py to time too (labelled before:)")
    ap.add_argument(
        "--every-row-trained",
        action="store_true",
        help="a toy reward that varies in every group: every row trained and credited (DRIVER)",
    )
    ap.add_argument(
        "--same-batch",
        action="store_true",
        help="one process, one cached rollout batch, each signal's step on it in turn (same_batch above)",
    )
    ap.add_argument(
        "--cpu-clock",
        action="store_true",
        help="with --same-batch: time the phases in CPU "
        "seconds of this process (time.process_time), which other jobs on a shared machine do "
        "not stretch",
    )
    ap.add_argument("--json", default="", help="also write the per-step rows and the summary here")
    args, flags = ap.parse_known_args(argv)
    if args.rounds < 1 or args.steps <= args.warmup or args.warmup < 0 or args.threads < 1:
        ap.error("need --rounds >= 1, --steps > --warmup >= 0, --threads >= 1")
    if args.cpu_clock and not args.same_batch:
        ap.error("--cpu-clock needs --same-batch (one process; the runs of the other mode are subprocesses)")
    if args.same_batch:
        return same_batch(args, flags)
    configs = [(ROOT / "grpo.py", s, s) for s in args.signals]
    if args.grpo:
        configs += [(Path(args.grpo).resolve(), s, f"before:{s}") for s in args.signals]
    rows = {label: [] for *_, label in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for grpo_py, signal, label in configs:
                steps = [
                    m
                    for m in run_once(
                        grpo_py, signal, args.steps, flags, args.threads, tmp, args.every_row_trained
                    )
                    if "skipped" not in m
                ][args.warmup :]
                rows[label] += steps
                print(
                    f"round {r + 1}: {label:<14} "
                    + " ".join(f"{m['time/step']:.1f}" for m in steps)
                    + f"   rows trained: {[m.get('rows/trained', '?') for m in steps]}",
                    flush=True,
                )
    keys = ("time/step", "time/generate", "time/credit", "time/update")
    med = {label: {k: statistics.median(m[k] for m in ms) for k in keys} for label, ms in rows.items() if ms}
    given = dict(zip(SHAPE + flags, (SHAPE + flags)[1:]))
    B = int(given["--prompts-per-step"]) * int(given["--group-size"])  # rows generated per step (last wins)
    for label, ms in rows.items():
        if ms:
            tokens = [m.get("gen/tokens", m["len/mean"] * B) for m in ms]
            med[label]["tok/s"] = statistics.median(n / m["time/generate"] for n, m in zip(tokens, ms))
    base = med[configs[0][2]]
    sweep = lambda d: d["time/credit"] + d["time/update"]  # noqa: E731
    print(
        f"\n{'config':<16}{'s/step':>8}{'generate':>10}{'credit':>8}{'update':>8}{'step ratio':>12}"
        f"{'sweep ratio':>13}{'tok/s':>8}   n"
    )
    for label, d in med.items():
        ratio, sweep_ratio = d["time/step"] / base["time/step"], sweep(d) / sweep(base)
        print(
            f"{label:<16}{d['time/step']:>8.2f}{d['time/generate']:>10.2f}{d['time/credit']:>8.2f}"
            f"{d['time/update']:>8.2f}{ratio:>12.3f}{sweep_ratio:>13.3f}{d['tok/s']:>8.1f}"
            f"   {len(rows[label])}"
        )
    print(
        f"(medians of {args.rounds} alternating rounds x {args.steps - args.warmup} steps; shape "
        f"{' '.join(SHAPE[:6])} {' '.join(flags)}, {args.threads} thread(s); "
        f"load {os.getloadavg()[0]:.1f})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"median": med, "rows": rows, "argv": argv or sys.argv[1:]}, indent=1)
        )
    return med


if __name__ == "__main__":
    main()
