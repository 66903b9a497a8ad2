"""The learning experiment: does GRPO training help on held-out questions, and does flow credit beat
plain GRPO (the FlowTracer paper's Table 2)? Credit arms x seeds of grpo.py runs with one shared recipe.

  grid       arm-seed (a, s) = one grpo.py process, `python grpo.py <recipe> --credit a --seed s --eval-every
             N --eval-size M --eval-dataset T --out-dir <out>/runs/<a>-s<s>`, which evaluates the policy it
             trains at steps N, 2N, ... and the last (training/run/heldout.py: no reload, no restart) into its
             metrics.jsonl, where learn reads them. A killed run continues with grpo.py --resume: exact.
  held out   heldout.records: the first --eval-size questions of the dataset's test split, the same for every
             seed, none a training question. Greedy accuracy (the recipe's --max-new-tokens, --gen-chunk),
             strict (data.reward: 1) and lenient (or answers.last_number_equal: math); step 0 (the
             recipe's model) evaluated by learn, once, shared; mean@k at the recipe's sampling (departure 4).
  arms       grpo.py --credit values, default none, flow, random. random under the default --shaping topk
             is flow's gamma at random places: gamma on ceil(top_frac n) tokens of each row, as flow's, drawn
             uniformly, and all-1 on a row without an answer, as flow's fallback (shaping.py's prepare)
  statistics learn_report.py (stats.py) over seeds, the replicated unit: per arm, the mean gain (last step
             - step 0) +- a 95% t interval; each arm - none paired by seed: the mean difference, its t
             interval and p, a two-level bootstrap (seeds, then questions), the exact sign-flip test
             (smallest p 2 / 2^S), for the last step and the area under the held-out curve; the secondary
             endpoint, declared before the data: the training reward's area over steps 2..N; the seeds each
             effect size needs. A question-level table follows, labelled: conditional on the trained models.
  outputs    <out>/learn.json (per arm the runs: seed, before, after, lenient, mean@k, the held-out curve with
             every evaluation's per-question results, the training reward per step; then the summary),
             learn.md (the tables), learn.png (held-out accuracy and training reward against step: each arm's
             mean over seeds with a 95% t band, the seeds faintly).

Resumable: one run directory per arm-seed (<out>/runs/), one file per evaluation (<out>/eval/, atomic, the
last step's last: the done-marker; per-question results for the paired tests). Killed anywhere, the same
command skips what is done and continues a run from its checkpoint. Ctrl-C or SIGTERM: the grpo.py running
finishes its step and saves it, and learn exits 130 or 143 (128 + the signal, as grpo.py). Arms and seeds may
be added later to the same --out-dir; another recipe or evaluation setting there is an error (or
--overwrite).

Departures (numbered):
 1. Lenient scoring is defined for math tasks; Countdown and multiple choice score lenient = strict.
 2. --eval-k 0 evaluates greedily only: no checkpoint is loaded after training, more seeds for the same time.
 3. The training reward is grpo.py's reward/mean per step (figures.metric_series); skipped steps have none.
 4. mean@k at step 0 and the last step only, from the base model and the final checkpoint (grpo.py: greedy).

Run: python eval.py learn --arms none,flow,random --seeds 2 --eval-size 300 -- --dataset arithmetic --steps 40
     (learn's flags, then after -- grpo.py's, or -- --config recipe.yaml: the shared recipe; runs/learn/)
"""

import argparse
import contextlib
import io
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import data
from evaluation.figures import metric_series
from evaluation.learn_report import QUESTION_KEYS, SCORES, summarize
from training.config import flags, helptext
from training.credit import scoring
from training.decode.rollout import Sampling
from training.memory import budget
from training.model import trainable
from training.model.load import load_model
from training.model.pretrained import ModelError
from training.run import checkpoint as ckpt_io
from training.run import directory, heldout
from training.usercode import guard


@dataclass
class LearnConfig:
    arms: str = "none,flow,random"  # credit signals (grpo.py --credit values), comma-separated
    seeds: str = "2"  # N (seeds 0..N-1) or a comma-separated list of seeds
    out_dir: str = "runs/learn"  # learn.json, learn.md, learn.png; runs/, eval/, logs/ of the grid
    overwrite: bool = False  # delete a grid of another recipe in --out-dir first (else: an error)
    eval_every: int = 0  # evaluate every N steps and at the last; 0: every steps/4 (rounded up)
    eval_dataset: str = ""  # the held-out dataset ("": the recipe's --dataset); its test split
    eval_size: int = 500  # held-out questions: the first N of the test split (all, if fewer)
    eval_k: int = 4  # samples per question for mean@k (step 0, last); 0: greedy only
    eval_seed: int = 0  # torch seed of every evaluation's sampling (the same for every arm)
    bootstrap: int = 10_000  # paired bootstrap resamples


SET_BY_LEARN = (
    "--seed",
    "--credit",
    "--out-dir",
    "--resume",
    "--overwrite",
    "--no-overwrite",
    "--eval-every",
    "--eval-size",
    "--eval-dataset",
)
MAX_SEEDS = 1000  # --seeds N: at most this many (each seed is one grpo.py run per arm)


class LearnError(ValueError):
    """A grid that cannot go on (a failed run, a changed recipe): one line naming what to do."""


class LearnStopped(KeyboardInterrupt):
    """learn, or an arm-seed's grpo.py, stopped by a signal (args[0]: its number): main exits with 128 + it,
    as grpo.py does (143 SIGTERM, 130 Ctrl-C); the same command continues where it stopped."""


def refuse(msg):
    """argparse's error, as a LearnError: main prints it as one line (no usage block) and exits 2."""
    raise LearnError(msg)


# ----------------------------------------------------------------------------- the grid
class Grid:
    """What the grid needs before a model loads: flags, recipe, evaluation steps, held-out questions."""

    def __init__(self, cfg, recipe, arms, seeds, grpo):
        self.cfg, self.recipe, self.arms, self.seeds, self.out = cfg, recipe, arms, seeds, Path(cfg.out_dir)
        self.grpo = grpo  # the grpo.py module, passed in by eval.py
        self.rc = rc = [recipe_config(grpo, recipe, a, seeds[0], self.out / "runs") for a in arms][0]
        self.every = cfg.eval_every or (rc.steps + 3) // 4  # 0: four evaluations
        self.eval_steps = sorted({*range(self.every, rc.steps + 1, self.every), rc.steps})
        self.eval_dataset = (cfg.eval_dataset or rc.dataset).lower()
        try:  # the same questions as grpo.py's (heldout.py)
            self.recs = heldout.records(rc.dataset, self.eval_dataset, cfg.eval_size, seeds, rc.data_path)
        except ValueError as e:  # no test split; a held-out question in training
            raise LearnError(str(e)) from None
        self.style = (
            rc.prompt_style
            if rc.prompt_style != "auto"
            else data.default_style(rc.model, data.TASKS[rc.dataset.lower()].task)
        )  # grpo.py's rule
        self.setting = {
            "recipe": recipe,
            "eval_dataset": self.eval_dataset,
            "eval_size": len(self.recs),
            "style": self.style,
            "eval_steps": self.eval_steps,
            "eval_k": cfg.eval_k,
            "eval_seed": cfg.eval_seed,
            "eval_max_new_tokens": rc.max_new_tokens,
            "eval_chunk": budget.largest(rc).gen_chunk,
        }  # 0 (sized): the CPU's
        f = self.out / "grid.json"
        if f.is_file() and json.loads(f.read_text()) != self.setting:
            if not cfg.overwrite:
                raise LearnError(
                    f"{self.out} holds a grid of another recipe or evaluation ({f}): use "
                    "another --out-dir, or --overwrite to delete it"
                )
            for d in ("runs", "eval", "logs"):
                shutil.rmtree(self.out / d, ignore_errors=True)
        directory.write_atomic(f, json.dumps(self.setting, indent=1))

    def eval_file(self, run, step):
        """The done-marker and result of one evaluation; step 0 is shared by every arm-seed."""
        return self.out / "eval" / ("step00000.json" if step == 0 else f"{run}/step{step:05d}.json")

    def done(self, run, step):
        return self.eval_file(run, step).is_file()


def recipe_config(grpo, recipe, arm, seed, out):
    """grpo.py's Config of an arm-seed, from grpo.py's own parser; its error line becomes a LearnError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return grpo.parse_args([*recipe, "--credit", arm, "--seed", str(seed), "--out-dir", str(out)])
    except SystemExit:
        last = (err.getvalue().strip().splitlines() or ["invalid"])[-1]
        raise LearnError(f"recipe (grpo.py flags): {last.split('error: ', 1)[-1]}") from None


def run_grid(g):
    """Seed-major (the arms of a seed finish together, so a stopped grid still has pairs); progress in
    training steps (grpo.py's evaluations are inside them)."""
    runs, steps = [f"{a}-s{s}" for s in g.seeds for a in g.arms], g.rc.steps
    done = sum(min(steps, steps_logged(g.out / "runs" / r)) for r in runs)
    bar = tqdm(total=len(runs) * steps, initial=done, desc="learn", unit="step")
    if not g.done("", 0):  # step 0: the recipe's model, shared
        res = result(g, evaluate_model(g, g.rc.model))
        directory.write_atomic(g.eval_file("", 0), json.dumps(res))
        tqdm.write(f"learn: step 0: acc {res['acc']:.3f} (lenient {res['acc_lenient']:.3f})")
    for run in runs:
        if g.done(run, g.eval_steps[-1]):
            tqdm.write(f"learn: {run} finished earlier: skipped")
            continue
        train(g, run, bar)
        for e in g.eval_steps:  # the last step's file last: the done-marker
            if not g.done(run, e):
                res = record_evaluation(g, run, e)
                tqdm.write(f"learn: {run} step {e}: acc {res['acc']:.3f} (lenient {res['acc_lenient']:.3f})")
        summarize(g, *collect(g))  # partial results after every arm-seed
    bar.close()
    print(summarize(g, *collect(g)) + f"\nwrote {g.out}/learn.json, learn.md, learn.png")


def train(g, run, bar):
    """The arm-seed's grpo.py process, evaluating as it trains; --resume from its checkpoint if it has one.
    A run whose checkpoint is at the last step (killed before learn read its evaluations) is not rerun."""
    arm, seed = run.rsplit("-s", 1)
    d, log = g.out / "runs" / run, g.out / "logs" / f"{run}.log"
    try:
        ckpt = ckpt_io.find_checkpoint(d)
    except ckpt_io.RunError:  # not started, or stopped before its first save
        ckpt = None
    if ckpt and ckpt_io.read_state(ckpt)["step"] >= g.rc.steps:
        return
    script = str(Path(g.grpo.__file__))
    cmd = (
        [sys.executable, script, "--resume", str(d)]
        if ckpt
        else [
            sys.executable,
            script,
            *g.recipe,
            "--credit",
            arm,
            "--seed",
            seed,
            "--out-dir",
            str(d),
            "--overwrite",
            "--save-optimizer",
            "--eval-every",
            str(g.every),
            "--eval-size",
            str(g.cfg.eval_size),
            "--eval-dataset",
            g.eval_dataset,
        ]
    )  # an exact --resume
    log.parent.mkdir(parents=True, exist_ok=True)
    seen = steps_logged(d)
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:  # its own session: signals reach it from here, once
            while proc.poll() is None:
                time.sleep(1.0)
                now = min(g.rc.steps, steps_logged(d))
                bar.update(max(0, now - seen))
                seen = max(seen, now)
        finally:
            stop(proc)
    bar.update(max(0, min(g.rc.steps, steps_logged(d)) - seen))
    if proc.returncode in (guard.status(signal.SIGTERM), guard.status(signal.SIGINT)):  # its step saved
        raise LearnStopped(proc.returncode - 128)
    if proc.returncode != 0:
        tail = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
        raise LearnError(f"{run}: grpo.py exited with status {proc.returncode} ({tail}); see {log}")


def steps_logged(run_dir):
    return len(metric_series(run_dir / "metrics.jsonl", "step"))


def stop(proc):
    """learn stopped: grpo.py finishes its step, saves, exits; a second Ctrl-C kills it (kill-safe saves)."""
    try:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    except KeyboardInterrupt:
        proc.kill()
        raise


def evaluations(path):
    """{step: metrics line} of a metrics.jsonl's lines that hold an evaluation (a step's last line wins)."""
    rows = {}
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):  # a line cut by a kill
            row = json.loads(line)
            rows |= {row["step"]: row} if "eval/accuracy" in row else {}
    return rows


def result(g, right):
    """One evaluation's file: per question (right; samples None where not sampled), then the four means."""
    k, n = g.cfg.eval_k, len(g.recs)
    res = {"ids": [r["id"] for r in g.recs], "samples": None, "samples_lenient": None, **right}
    return res | {
        score + sfx: sum(res[key + sfx]) / (n * m) if res[key + sfx] is not None and m else None
        for score, key, m in (("acc", "greedy", 1), ("mean@k", "samples", k))
        for sfx in ("", "_lenient")
    }


def record_evaluation(g, run, step):
    """`step`'s evaluation from grpo.py's metrics.jsonl (+ the final checkpoint's mean@k), into its file."""
    path = g.out / "runs" / run / "metrics.jsonl"
    m = evaluations(path).get(step, {})
    if len(m.get("eval/right") or []) != len(g.recs):
        raise LearnError(
            f"{path}: no evaluation of {len(g.recs)} questions at step {step} (eval/right); "
            f"delete {path.parent} to run it again"
        )
    right = {"greedy": m["eval/right"], "greedy_lenient": m["eval/right_lenient"]}
    if step == g.eval_steps[-1] and g.cfg.eval_k:
        ckpt = ckpt_io.find_checkpoint(path.parent)
        if ckpt_io.read_state(ckpt)["step"] != step:
            raise LearnError(f"{ckpt}: not the checkpoint of step {step}; delete {path.parent} to rerun it")
        right |= evaluate_model(g, str(ckpt), greedy=False)
    res = result(g, right)
    directory.write_atomic(g.eval_file(run, step), json.dumps(res))
    return res


def evaluate_model(g, name, greedy=True):
    """The model `name` (the recipe's, a checkpoint) loaded as grpo.py loads it: its greedy results (if
    greedy) and its samples' (if --eval-k) on the held-out questions, one dict."""
    rc, cfg, device = g.rc, g.cfg, trainable.device_of(g.rc.device)
    model, tok = load_model(name, device=device, dtype=trainable.weight_dtype(rc, device))
    args, chunk = (model, tok, g.recs, g.style), g.setting["eval_chunk"]
    res = heldout.greedy(*args, rc.max_new_tokens, chunk) if greedy else {}
    if cfg.eval_k:
        res |= heldout.sampled(*args, Sampling.of(rc), chunk, cfg.eval_k, cfg.eval_seed)  # as the run samples
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next grpo.py run gets the GPU's memory back
    return res


# ----------------------------------------------------------------------------- results
def collect(g):
    """(runs, finals) for learn_report.summarize: per arm, the arm-seeds whose evaluations are all done, each
    with every evaluation's per-question results (so that every number can be recomputed); finals:
    (arm, seed) -> its last evaluation."""
    before, runs, finals = json.loads(g.eval_file("", 0).read_text()), {}, {}
    for arm in g.arms:
        for seed in (s for s in g.seeds if all(g.done(f"{arm}-s{s}", e) for e in g.eval_steps)):
            ev = [before] + [json.loads(g.eval_file(f"{arm}-s{seed}", e).read_text()) for e in g.eval_steps]
            finals[arm, seed] = ev[-1]
            runs.setdefault(arm, []).append(
                {
                    "seed": seed,
                    **{f"before{sfx}": before[m] for m, sfx in SCORES.items()},
                    **{f"after{sfx}": ev[-1][m] for m, sfx in SCORES.items()},
                    "auc": float(np.mean([x["acc"] for x in ev[1:]])),  # held-out area, steps > 0
                    "curve": [[e, *(x[m] for m in SCORES)] for e, x in zip([0, *g.eval_steps], ev)],
                    "questions": {
                        str(e): {q: x[q] for q in QUESTION_KEYS} for e, x in zip([0, *g.eval_steps], ev)
                    },
                    "reward": metric_series(
                        g.out / "runs" / f"{arm}-s{seed}" / "metrics.jsonl", "reward/mean"
                    ),
                }
            )
    return runs, finals


# ----------------------------------------------------------------------------- command line
def parse(argv, prog):
    """(config, recipe, arms, seeds), checked; Grid runs grpo.py's own checks (before any model loads)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(
        prog=f"{prog} learn",
        description=__doc__,
        allow_abbrev=False,
        usage="%(prog)s [--flag VALUE ...] [-- grpo.py flags]",
        epilog="every other flag, and all after --, is grpo.py's: the shared recipe",
        formatter_class=helptext.Formatter,
    )
    p.error = refuse  # one line, no usage block
    flags.add_fields(p, LearnConfig)
    ns, rest = p.parse_known_args(argv[:cut])
    cfg, recipe = LearnConfig(**vars(ns)), rest + argv[cut + 1 :]
    arms = [a.strip() for a in cfg.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in scoring.SIGNALS]
    try:
        seeds = (
            [int(s) for s in cfg.seeds.split(",") if s.strip()]
            if "," in cfg.seeds
            else list(range(min(int(cfg.seeds), MAX_SEEDS + 1)))
        )  # no list of 10**20 seeds
    except ValueError:
        p.error(f"--seeds {cfg.seeds!r}: give a number of seeds N (0..N-1) or a comma list like 0,1,2")
    taken = [f for f in recipe if f.split("=")[0] in SET_BY_LEARN]
    for bad, why in (
        (not arms, "--arms is empty: give credit signals, e.g. none,flow"),
        (unknown, f"--arms {','.join(unknown)}: unknown; signals: {', '.join(scoring.SIGNALS)}"),
        (len(set(arms)) < len(arms), f"--arms {cfg.arms}: an arm twice"),
        (not seeds, f"--seeds {cfg.seeds}: zero seeds; give N >= 1 or a comma list"),
        (len(seeds) > MAX_SEEDS, f"--seeds {cfg.seeds}: at most {MAX_SEEDS} (a run each)"),
        (any(not 0 <= s < 2**63 for s in seeds), f"--seeds {cfg.seeds}: each in [0, 2**63)"),
        (len(set(seeds)) < len(seeds), f"--seeds {cfg.seeds}: a seed twice"),
        (taken, f"{' '.join(taken)}: set by learn per arm-seed (its --arms, --seeds, --eval-*)"),
        (cfg.eval_every < 0, "--eval-every must be >= 0 (0: four evaluations)"),
        (
            cfg.eval_dataset and cfg.eval_dataset.lower() not in data.TASKS,
            f"--eval-dataset {cfg.eval_dataset}: unknown; tasks: {', '.join(data.TASKS)}",
        ),
        (cfg.eval_k < 0, "--eval-k must be >= 0 (0: greedy only)"),
        (directory.dir_problem(cfg.out_dir), f"--out-dir {directory.dir_problem(cfg.out_dir)}"),
        *((getattr(cfg, k) < 1, f"--{k.replace('_', '-')} must be >= 1") for k in ("eval_size", "bootstrap")),
    ):
        if bad:
            p.error(why)
    return cfg, recipe, arms, seeds


def stopped_by(signum, _frame):
    """learn's Ctrl-C and SIGTERM: LearnStopped, which stops the grpo.py running (`stop`: its step saved)."""
    raise LearnStopped(signum)


def main(argv, grpo, prog="eval.py"):
    """`eval.py learn`; grpo: the grpo.py module (its parser checks the recipe, its file is what runs). A
    Ctrl-C or SIGTERM stops the grpo.py running (its step saved) and exits 130 or 143 (128 + the signal)."""
    try:
        if threading.current_thread() is threading.main_thread():  # SIGTERM: stop like Ctrl-C (stop)
            for s in guard.SIGNALS:
                signal.signal(s, stopped_by)
        run_grid(Grid(*parse(argv, prog), grpo))  # parse: config, recipe, arms, seeds
    except (LearnError, data.DataError, ModelError, ckpt_io.RunError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # LearnStopped, or a KeyboardInterrupt from elsewhere: Ctrl-C's
        signum = e.args[0] if isinstance(e, LearnStopped) else signal.SIGINT
        print(
            f"{prog}: interrupted ({guard.name(signum)}); the same command continues where it stopped",
            file=sys.stderr,
        )
        sys.exit(guard.status(signum))
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
