"""The GPU report in one command: does this fit, and how fast is it, on this card.

On any CUDA card it runs, in this order, each part a subprocess under its own time limit (past it, SIGTERM to
its process group, SIGKILL 10 s later), each writing its log (<out>/<part>.log) and one JSON line
(<out>/report.jsonl) as it finishes, so that a part cut short leaves the others' figures:

  preflight  grpo.py's setup and one small step on qwen3-4b-random (1 prompt x 2 rows, 16 new tokens): the
             preflight's lines (training/memory/preflight.py: each GPU part tried once, or its fallback) and
             time
  headline   benchmarks/gpu_headline.py --max-new-tokens 1024 --rounds 1: the 1K step of 128 rows on
             qwen3-4b-random: generation's share of the bandwidth bound, the step's time, each phase's
             memory beside its estimate, flow credit's share of the update
  lora24     the same with --lora-rank 16 --gpu-gb 24: sized as grpo.py sizes a 24 GB card, the allocator
             held to 24 GB (torch.cuda.set_per_process_memory_fraction): each phase's peak beside its estimate
  backward   eval.py memory --model qwen3-4b-random --measure --snapshot: the 1K step's phases beside their
             estimate, and what the 2nd micro-batch's backward holds at its peak, by site (the allocator's
             history: <out>/backward.pickle, its sums beside it in backward.pickle.json)
  backward-unshared  the same with --no-share-prefix: one pass over each row, no prompt pass to wait for
  decoders   benchmarks/generate_speed.py --device cuda --no-static --model-step: the engine (its fused
             step), the engine on the model's own forward (its step before) and HF generate with its dynamic
             cache on the same rows (64 rows, 256 + 256 tokens, greedy, bf16): tok/s beside the bandwidth
             bound, and the greedy rows equal to HF's in fp32
  lora       the same with --lora-rank 16 (every decoder on peft's adapters): LoRA's engine against full
             fine-tuning's (decoders) on the same rows
  suite      the test suite as docs/gpu.md runs it on a GPU machine (pytest -o addopts="" -n auto), with the
             time left: its counts, and those of its cuda cases
  static     generate_speed.py's whole table: HF's static cache, compiled, beside the other two; last, so it
             runs only when the time allows
Then each goal (docs/gpu.md, "Not yet measured") with its figure: met, short, or why there is none
(benchmarks/gpu_figures.py reads each part's figures and judges the goals).

--budget SECONDS: a part runs only when its limit fits in the time left; the suite's limit is the time left
(at most SUITE_S). A part is never shrunk: one that does not fit is cut whole ("cut: no time left"), so its
figures compare across cards. --limit NAME=SECONDS moves a part's limit (when it is killed, not what it
does); --parts NAME ... runs those parts only, in the table's order. Without CUDA: one line, exit 2. Exit 1
when a part that ran failed or was killed, else 0.

Departures (numbered):
 1. The limits (LIMITS) are the parts' times on one H200 with margin for an H100; decoders', lora's,
    static's and the two backward parts' are estimates (not yet run on a GPU). A slower card needs --limit
    or a larger --budget.
 2. The preflight's part runs its small step in a scratch directory (the checkpoint grpo.py writes at the
    end, 8 GB for a 4B model without its optimizer's state, is deleted with it); the report keeps only logs
    and JSON.

Run:  python benchmarks/gpu_report.py --out runs/gpu-report                 # every part, 77 min at most
      python benchmarks/gpu_report.py --out $OUT --budget 540              # what fits in 9 minutes
      python benchmarks/gpu_report.py --out runs/r --parts headline lora24 # two parts
Test: python -m pytest -q tests/benchmarks/test_gpu_report.py (the parts' order and limits, a part that hangs)
"""

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_figures import (  # noqa: E402
    backward_figures,
    decoder_figures,
    preflight_figures,
    step_figures,
    suite_figures,
    table,
)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GRACE_S = 10  # seconds between SIGTERM and SIGKILL
SUITE_S = 1800  # the suite's limit without --budget (and its most with one)
SUITE_MIN_S = 120  # less time left than this: the suite is cut


class Part(NamedTuple):
    name: str
    limit_s: object  # seconds; None: the time left (the suite), at most SUITE_S, at least SUITE_MIN_S
    command: Callable  # (out folder, scratch folder) -> argv
    figures: Callable  # (out folder, log text) -> dict of figures, or None when it left none


# Each part's limit (s): its time on one H200 (2026-11-28, docs/gpu.md: preflight 35, headline 191, lora24
# 330) with room for an H100's slower memory and the fused step's compile; decoders, lora, static and the
# backward parts not yet run on a GPU (estimates).
LIMITS = {
    "preflight": 120,
    "headline": 480,
    "lora24": 720,
    "backward": 420,  # two 1K steps (the second measured), the backward's allocator history
    "backward-unshared": 420,
    "decoders": 480,
    "lora": 420,
    "suite": None,
    "static": 600,
}
PREFLIGHT = "grpo.py --model qwen3-4b-random --device cuda --steps 1 --prompts-per-step 1 --group-size 2 "
PREFLIGHT += "--max-new-tokens 16 --no-save-optimizer --out-dir"  # a scratch directory (departure 2)
HEADLINE = "benchmarks/gpu_headline.py --max-new-tokens 1024 --rounds 1"
BACKWARD = "eval.py memory --model qwen3-4b-random --device cuda --measure --snapshot"  # + its pickle's path
DECODE = "benchmarks/generate_speed.py --device cuda --model qwen3-4b-random --rounds 2"
SUITE = "-m pytest -q -o addopts= -n auto -rfEs --tb=line -p no:cacheprovider tests --junitxml"
PARTS = [
    Part(
        "preflight",
        LIMITS["preflight"],
        lambda out, tmp: [PY, *PREFLIGHT.split(), str(tmp / "run")],
        preflight_figures,
    ),
    Part(
        "headline",
        LIMITS["headline"],
        lambda out, tmp: [PY, *HEADLINE.split(), "--json", str(out / "headline.json")],
        step_figures("headline"),
    ),
    Part(
        "lora24",
        LIMITS["lora24"],
        lambda out, tmp: [
            PY,
            *HEADLINE.split(),
            *"--lora-rank 16 --gpu-gb 24 --json".split(),
            str(out / "lora24.json"),
        ],
        step_figures("lora24"),
    ),
    Part(
        "backward",
        LIMITS["backward"],
        lambda out, tmp: [PY, *BACKWARD.split(), str(out / "backward.pickle")],
        backward_figures("backward"),
    ),
    Part(
        "backward-unshared",
        LIMITS["backward-unshared"],
        lambda out, tmp: [PY, *BACKWARD.split(), str(out / "backward-unshared.pickle"), "--no-share-prefix"],
        backward_figures("backward-unshared"),
    ),
    Part(
        "decoders",
        LIMITS["decoders"],
        lambda out, tmp: [
            PY,
            *DECODE.split(),
            *"--no-static --model-step --json".split(),
            str(out / "decoders.json"),
        ],
        decoder_figures("decoders"),
    ),
    Part(
        "lora",
        LIMITS["lora"],
        lambda out, tmp: [
            PY,
            *DECODE.split(),
            *"--no-static --lora-rank 16 --json".split(),
            str(out / "lora.json"),
        ],
        decoder_figures("lora", beside="decoders"),
    ),
    Part(
        "suite", LIMITS["suite"], lambda out, tmp: [PY, *SUITE.split(), str(out / "suite.xml")], suite_figures
    ),
    Part(
        "static",
        LIMITS["static"],
        lambda out, tmp: [PY, *DECODE.split(), "--json", str(out / "static.json")],
        decoder_figures("static"),
    ),
]


# ----------------------------------------------------------------------------- running the parts
def stop(p):
    """SIGTERM to the part's process group, SIGKILL GRACE_S later if anything of it is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    p.wait()


def run_part(part, limit, out):
    """Runs one part under `limit` seconds; its record (the JSON line's fields)."""
    log = out / f"{part.name}.log"
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]  # kept behind
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path)}
    with tempfile.TemporaryDirectory(prefix=f"gpu-report-{part.name}-") as tmp, open(log, "w") as f:
        cmd = part.command(out, Path(tmp))
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        t0 = time.monotonic()
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            rc = p.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            stop(p)
            rc, status = p.returncode, "killed"
        except BaseException:  # Ctrl-C: the part goes with the report
            stop(p)
            raise
        seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    try:
        figures = part.figures(out, text)
    except Exception as e:  # noqa: BLE001 (said in the record)
        figures = {"error": f"{type(e).__name__}: {e}"}
    return {
        "part": part.name,
        "status": status,
        "rc": rc,
        "seconds": round(seconds, 1),
        "limit_s": limit,
        "log": log.name,
        "command": shlex.join(cmd),
        "figures": figures,
        "tail": text.splitlines()[-12:] if status != "ok" else [],
    }


def limit_of(part, left, given):
    """The part's limit, or None when it is cut: its own (or --limit's) must fit in the time left; the
    suite's is the time left, at most SUITE_S, and it is cut under SUITE_MIN_S."""
    limit = given.get(part.name, part.limit_s)
    if limit is None:
        limit = SUITE_S if left is None else min(SUITE_S, int(left))
        return limit if limit >= SUITE_MIN_S else None
    return limit if left is None or limit <= left else None


def run(parts, out, budget=None, given=None, start=None):
    """Runs `parts` in order, appending each one's record to <out>/report.jsonl as it ends; the records.
    budget: seconds from `start` (time.monotonic(); default now) for all of them; given: --limit's."""
    out.mkdir(parents=True, exist_ok=True)
    start, given, records = start or time.monotonic(), given or {}, []
    with open(out / "report.jsonl", "a") as jl:
        for i, part in enumerate(parts):
            left = None if budget is None else budget - (time.monotonic() - start)
            limit, say = limit_of(part, left, given), f"[{i + 1}/{len(parts)}] {part.name}"
            if limit is None:
                own = given.get(part.name, part.limit_s) or SUITE_MIN_S
                why = f"cut: no time left ({max(0, left):.0f} s left, the part needs {own:.0f} s)"
                rec = {"part": part.name, "status": "cut", "why": why, "figures": None}
                print(f"{say}: {why}", flush=True)
            else:
                print(f"{say} (limit {limit:.0f} s) ...", flush=True)
                try:
                    rec = run_part(part, limit, out)
                except BaseException:  # SIGTERM or Ctrl-C: its line, then the report stops
                    why = "stopped: the report was stopped while this part ran"
                    jl.write(json.dumps({"part": part.name, "status": "stopped", "why": why}) + "\n")
                    raise
                rc = "" if rec["status"] == "ok" else f" (exit {rec['rc']}; {out / rec['log']})"
                print(f"{say}: {rec['status']} in {rec['seconds']:.0f} s{rc}", flush=True)
                for line in rec["tail"]:
                    print(f"    {line}")
            records.append(rec)
            jl.write(json.dumps(rec) + "\n")
            jl.flush()
    return records


CARD = (
    "import torch; d = torch.cuda.get_device_properties(0); print(d.name, f'{d.total_memory / 1e9:.1f} GB')"
)


def device_line():
    """The card, from a child process (no CUDA context is kept in this one: the parts measure memory)."""
    p = subprocess.run([PY, "-c", CARD], capture_output=True, text=True, check=False)
    return f"{p.stdout.strip() or 'unknown card'}, torch {torch.__version__}"


def limits(items, names):
    """--limit's NAME=SECONDS items as {name: seconds}; None when one is not that."""
    given = {}
    for item in items:
        name, _, sec = item.partition("=")
        if name not in names or not re.fullmatch(r"\d+(\.\d*)?", sec) or not float(sec) > 0:
            return None
        given[name] = float(sec)
    return given


def main(argv=None):
    doc, names = __doc__.splitlines()[0], [p.name for p in PARTS]
    ap = argparse.ArgumentParser(prog="gpu_report.py", description=doc, allow_abbrev=False)
    ap.add_argument("--out", default="runs/gpu-report", help="the folder of the logs and report.jsonl")
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds in all: the parts that do not fit are cut"
    )
    own = ", ".join(f"{k} {v or f'the time left, at most {SUITE_S}'} s" for k, v in LIMITS.items())
    ap.add_argument("--limit", nargs="+", default=[], metavar="NAME=SECONDS", help=f"a part's limit ({own})")
    ap.add_argument(
        "--parts", nargs="+", choices=names, metavar="NAME", help=f"only these: {', '.join(names)}"
    )
    args = ap.parse_args(argv)
    given = limits(args.limit, names)
    if given is None:
        ap.error(f"--limit: want NAME=SECONDS, SECONDS > 0, NAME one of {', '.join(names)}")
    if args.budget is not None and not args.budget > 0:
        ap.error("--budget must be > 0 seconds")
    if not torch.cuda.is_available():
        print(
            "gpu_report.py: error: needs CUDA (torch.cuda.is_available() is false); on the CPU, "
            "python -m pytest -q -m benchmark runs every benchmark's smoke test",
            file=sys.stderr,
        )
        sys.exit(2)
    start, out = time.monotonic(), Path(args.out).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a part running then goes with the report
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in PARTS if args.parts is None or p.name in args.parts]
    head = {"part": "device", "status": "ok", "device": device_line(), "date": str(datetime.date.today())}
    head.update(budget_s=args.budget, parts=[p.name for p in parts], argv=argv or sys.argv[1:])
    with open(out / "report.jsonl", "w") as f:
        f.write(json.dumps(head) + "\n")
    budget = "none" if args.budget is None else f"{args.budget:.0f} s"
    print(f"gpu_report.py: {head['device']}; {len(parts)} part(s); budget {budget}; into {out}", flush=True)
    records = run(parts, out, args.budget, given, start)
    print("\n" + table(records))
    sys.exit(1 if any(r["status"] in ("failed", "killed") for r in records) else 0)


if __name__ == "__main__":
    main()
