"""Evaluation and the paper's experiments, one subcommand each; each writes <out>/<cmd>.json and .md.

  bench      pass@1 (mean over n samples), unbiased pass@k and greedy accuracy per benchmark (Tables 2-4)
             Samples with the training settings of App. C.3 (departure 2); the formulas: evaluation/stats.py.
  intervene  mask tokens by flow (high, low) or at random, regenerate, count changed answers (Table 1)
             App. E.1: 20% of the tokens before a random truncation point are masked, the response is
             regenerated, answer changes and correctness reversals are counted (evaluation/probes.py).
  recall     recall@K% of the Oracle's causal tokens per credit signal (OAR §5.1, Fig. 5a, 5b)
             A token is causal when replacing it by the next most probable token, then decoding greedily,
             makes a correct answer wrong (OAR eq. 19); recall@K% = their share in a signal's top K%.
  memory     the bytes of each phase of grpo.py's step and its peak, from grpo.py's flags
             An estimate from the model's config (evaluation/memory.py); --measure also runs one step and
             compares (evaluation/memtrace.py). Any grpo.py flag may follow memory's own.
  plot       flow heatmap (Fig. 2), a token's inflow / outflow (Fig. 7), high-flow tokens (Fig. 3), curves
             Fig. 2 draws the flow throughput of one response's tokens (PNG + HTML), Fig. 3 the most frequent
             high- and low-flow tokens; curves draws --metrics runs with a peak-tracking EMA (figures.py).
  credit     a run's saved step: each response's tokens coloured by their credit, as a page (HTML + PNG)
  learn      the learning experiment: credit arms x seeds of grpo.py runs, held-out gains, paired tests
             Its own flags: `python eval.py learn --help` (evaluation/learn.py).
  answer-forms  overlap of the high-flow sets when the answer is rewritten in other forms (Table 11a)
             The forms: the full answer line, with an explanation, multiple-choice (evaluation/highflow.py).
  deadend    where the credit lands: twin prompts whose answer is computed on one line or the other
             Teacher-forced twins; per signal the AUC of used-line digits over dead-end digits with 95% t
             intervals over pairs, a planted line as the limit, a pre-registered verdict (deadend.py).

Formulas (pass@k: evaluation/stats.py):
  EMA_t   = alpha * max(x_t, EMA_{t-1}) + (1 - alpha) * EMA_{t-1},  EMA_0 = x_0   (App. C.3, "Plot Settings")

Departures (numbered; probes.py and recall.py list those of intervene and recall):
 1. The paper does not give alpha for its EMA: default 0.2. It does not say how EMA_0 is set: EMA_0 = x_0.
 2. bench samples with the training settings of App. C.3 and counts a response correct when its reward is 1:
    evaluation/bench.py.
 3. plot colours throughput on a log scale, and counts Fig. 3's tokens per sentence: figures.py.
 4. intervene and answer-forms take a seeded random sample of --n-problems test problems (App. E.1: "randomly
    sampled"); bench, recall and plot take the first N.

Bad input: one line `eval.py: error: ...`, exit 2. Every flag is checked before a model loads (parse,
check_ranges; whether --layers and --max-new-tokens fit the model: harness.model_for, once it loaded); a bad
data file, model or checkpoint (ValueErrors naming the file) is caught around the command in main. Exit 1
when there is nothing to report (no response has an answer), after writing the counts.

Run: python eval.py bench --benchmarks gsm8k math500 --n-problems 50 --n 4   (default model: smollm2-135m)
     python eval.py intervene --n-problems 200 --max-new-tokens 160 --batch-size 16 --dtype bfloat16 \
         --threads 1
     python eval.py recall --task arithmetic --n-responses 24 --max-positions 24 --max-new-tokens 96
     python eval.py plot [--metrics runs/a/metrics.jsonl ...]
     python eval.py credit runs/embedded [--step 6]       (evaluation/credit_page.py)
     python eval.py memory --model qwen3-4b-random [--max-new-tokens 8192 --micro-batch 4 --gen-chunk 16]
     python eval.py answer-forms --task arithmetic --n-problems 24 --max-new-tokens 128 --threads 1
     python eval.py deadend --n 200 --threads 1 [--json summary.json]   (evaluation/deadend.py)
Table 6 (credit overhead) is measured by benchmarks/credit_overhead.py, in whole GRPO steps.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import data
import grpo
from evaluation import bench, credit_page, figures, highflow, memory, probes
from evaluation import deadend as twins
from evaluation import recall as recall_probe
from evaluation.harness import EvalError, fail, inputs, model_for, save
from flowtracer import select_layers
from training.config import helptext
from training.credit import oar, scoring
from training.model.load import device_problem
from training.model.pretrained import ModelError
from training.run import checkpoint as ckpt_io
from training.run import directory

CMDS = helptext.commands(__doc__)  # {name: (summary, description)}: the subcommands' --help


# ----------------------------------------------------------------------------- bench (Tables 2-4)
def bench_table(args):
    """pass@1, pass@k and greedy accuracy per benchmark (evaluation/bench.py, the formulas: stats.py)."""
    model, tok, _ = model_for(args, args.benchmarks[0])
    save(args, *bench.evaluate(model, tok, args))


# ------------------------------------------------------------------- intervene, recall (probes.py, recall.py)
def credit_config(args):
    """The probes' credit: grpo.py's Config (the paper's top_frac, gamma) at --layers and --seed."""
    return grpo.Config(layers=args.layers, seed=args.seed)


def intervene(args):
    model, tok, style = model_for(args, args.task)
    rows = inputs(args, tok, style, sample=True)
    out, s = probes.intervene(model, tok, rows, args, style, credit_config(args))
    save(args, {"model": args.model, "summary": s}, probes.intervene_table(s, args), out)
    if s["n"] == 0:
        fail(f"empty result set: none of the {s['n_responses']} responses has an answer", 1)


def recall(args):
    model, tok, style = model_for(args, args.task)
    try:
        out, s = recall_probe.recall(model, tok, inputs(args, tok, style), args, style, credit_config(args))
    except ValueError as e:
        fail(str(e), 1)
    save(args, {"model": args.model, "summary": s}, recall_probe.recall_table(s), out)
    if not s["n_causal"]:
        fail("empty result set: the Oracle found no causal token, so recall is undefined", 1)
    recall_probe.recall_figure(s, Path(args.out) / "recall.png")


def answer_forms(args):
    model, tok, style = model_for(args, args.task)
    rows = inputs(args, tok, style, sample=True)
    out, s = highflow.answer_forms(model, tok, rows, args, style, credit_config(args))
    save(args, {"model": args.model, "summary": s}, highflow.forms_table(s, args), out)
    if s["n"] == 0:
        fail(f"empty result set: none of the {s['n_responses']} responses has an answer", 1)


def deadend(args):
    """Twin prompts, teacher-forced: where each signal's credit lands (evaluation/deadend.py); the first
    pair drawn as <out>/pair.html, .png; --json: the summary alone."""
    model, tok, style = model_for(args, "math")
    if not data.style_fits(style, "math"):
        fail(
            f"--style {style}: the twins are arithmetic questions; use question, chat, plain or a "
            "few-shot style"
        )
    cfg = credit_config(args)
    recs, pairs, s = twins.probe(model, tok, args.n, args.seed, style, cfg, args.batch_size, args.model)
    save(args, s, twins.report(s), pairs)
    keys = ("model", "n", "seed", "signals", "paired", "variant", "verdict")
    try:
        page = twins.draw_pair(Path(args.out) / "pair", [r for r in recs if r["pair"] == 0])
        if args.json:
            Path(args.json).write_text(json.dumps({k: s[k] for k in keys}, indent=1))
    except OSError as e:
        fail(f"{e.filename}: cannot be written ({e.strerror})")
    print(f"wrote {page[0]}, {page[1]}" + (f", {args.json}" if args.json else ""))


# ----------------------------------------------------------------------------- plot (figures.py)
def plot(args):
    figs = args.figures or (["curves"] if args.metrics else ["heatmap", "inout", "tokens"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"figures": figs}
    try:
        figures.use_run(args, grpo.Config())  # --run: its rollouts, checkpoint, answer pattern, gamma
        if "curves" in figs:
            if not args.metrics:
                fail("plot --figures curves needs --metrics run/metrics.jsonl [...]")
            runs = figures.metrics_runs(args.metrics)  # a bad file, a bad line: ValueError
            if not all(runs.values()):
                fail(f"empty result set: {next(n for n, r in runs.items() if not r)} has no metrics rows", 1)
            result["curves"] = figures.curves(runs, args.keys, args.alpha, out / "curves.png")
        if set(figs) & {"heatmap", "inout", "tokens"}:
            model, tok, style = model_for(args, args.task)
            rows = figures.run_rows(args, tok) if args.run else inputs(args, tok, style)
            if "response" not in rows[0]:
                rows = probes.sample_responses(
                    model, tok, rows, args, style, args.temperature, args.seed, "plot: sample"
                )
            result.update(figures.flow_figures(model, tok, rows, args, figs, out))
    except ValueError as e:  # a bad metrics line, an unknown key, --token
        fail(str(e))
    if result.get("n_no_answer", 0) and result["n_no_answer"] == result["n_responses"]:
        fail(
            f"empty result set: none of the {result['n_responses']} responses has an answer, so there is "
            "no flow",
            1,
        )
    save(args, result, probes.markdown(["figure", "files"], [[f, f"{f}.png"] for f in figs]))


# ----------------------------------------------------------------------------- memory (memory.py)
def memory_table(args):
    """The bytes of each phase of grpo.py's step, estimated (memory.py); --measure runs one step too."""
    try:
        print(memory.command(args, grpo))  # grpo.py's flags: its parser, its errors
    except (ValueError, OSError) as e:
        fail(str(e))


# ----------------------------------------------------------------------------- command line
def parse(argv=None):
    ap = argparse.ArgumentParser(
        prog="eval.py",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        epilog="eval.py CMD --help: its flags",
        formatter_class=helptext.Formatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True, title="commands", metavar="CMD")

    def command(name, fn, **kw):  # the summary and description: the docstring's table
        p = sub.add_parser(
            name,
            allow_abbrev=False,
            help=CMDS[name][0].replace("%", "%%"),
            description=CMDS[name][1],
            formatter_class=helptext.Formatter,
            usage="%(prog)s [--flag VALUE ...]",
            **kw,
        )
        p.error = ap.error  # every error reads "eval.py: error: ..."
        return p.set_defaults(func=fn) or p

    def cmd(name, fn, task="gsm8k", max_new=256, batch=8, problems=None, model=True, sampled=True):
        """sampled=False: responses written, not generated (deadend): no --n-problems, --max-new-tokens."""
        p = command(name, fn)
        p.add_argument("--out", default=f"results/{name}", help="output directory")
        p.add_argument("--seed", type=int, default=0, help="seed for sampling, truncation points, selections")
        if model:
            p.add_argument(
                "--model", default="smollm2-135m", help="any name grpo.py accepts, or a checkpoint directory"
            )
            p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
            p.add_argument(
                "--dtype",
                default=None,
                choices=["float32", "bfloat16", "float16"],
                help="weights' dtype (default: bfloat16 on CUDA, float32 on the CPU)",
            )
            p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
            p.add_argument(
                "--style",
                default="auto",
                choices=["auto", *data.STYLES],
                help="prompt style (auto: as grpo.py)",
            )
            if task:
                p.add_argument("--task", default=task, choices=list(data.TASKS), help="the test split's task")
            if sampled:
                p.add_argument(
                    "--n-problems",
                    type=int,
                    default=problems,
                    help="N problems of the test split "
                    "(None: all); intervene, answer-forms: a seeded random sample, others: the first",
                )
                p.add_argument("--max-new-tokens", type=int, default=max_new, help="response budget")
            p.add_argument("--batch-size", type=int, default=batch, help="sequences per forward / generate")
        if model and task:
            p.add_argument(
                "--layers",
                default="middle",
                help="the flow graph's attention layers: middle, early, late, all or A:B",
            )
            p.add_argument(
                "--responses",
                default=None,
                help="JSONL of fixed responses {question, answer, response} instead of sampling",
            )
        return p

    bench.add_flags(cmd("bench", bench_table, task=None, max_new=1024), grpo.Config)
    p = cmd("intervene", intervene, problems=200)
    p.add_argument("--temperature", type=float, default=0.7, help="App. E.1: responses, regeneration at T")
    p.add_argument("--frac", type=float, default=0.2, help="share of the tokens before t0 masked (Table 1)")
    p = cmd("recall", recall, task="arithmetic", problems=100)
    p.add_argument("--n-responses", type=int, default=32, help="correct greedy responses to probe")
    p.add_argument("--max-positions", type=int, default=32, help="oracle positions per response (seeded)")
    p.add_argument(
        "--signals",
        nargs="+",
        default=[
            "flow",
            "attention",
            "fai",
            "entropy",
            "gradient",
            "correlation",
            "random",
            "oar-p",
            "oar-g",
        ],
        choices=list(scoring.SIGNALS),
        help="credit signals to rank tokens by",
    )
    p.add_argument(
        "--oar-outcomes",
        nargs="+",
        choices=oar.OUTCOMES,
        default=[grpo.Config.oar_outcome],
        help="OAR's outcome for oar-p / oar-g (OAR §6.2, Fig. 5b); several: a row for each",
    )
    p = cmd("plot", plot, problems=8)
    p.add_argument(
        "--figures",
        nargs="+",
        choices=["heatmap", "inout", "tokens", "curves"],
        default=None,
        help="default: curves with --metrics, else heatmap inout tokens",
    )
    p.add_argument("--metrics", nargs="+", default=None, help="metrics.jsonl files of runs to compare")
    p.add_argument("--keys", nargs="+", default=["acc", "reward/mean"], help="metrics to plot")
    p.add_argument("--alpha", type=float, default=0.2, help="peak-tracking EMA weight (departure 1)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (App. E.1)")
    p.add_argument("--index", type=int, default=0, help="which response (among those with an answer) to draw")
    p.add_argument(
        "--answer-pattern",
        default=None,
        type=helptext.answer_pattern,
        help="regex of the answer "
        "region, as grpo.py's (default: the last \\boxed{}, else <answer>...</answer>)",
    )
    p.add_argument("--token", type=int, default=None, help="inout: response position (default: top flow)")
    p.add_argument("--context", type=int, default=48, help="prompt tokens shown before the response")
    p.add_argument(
        "--frac", type=float, default=0.2, help="top / bottom share per response for the token charts"
    )
    p.add_argument("--top", type=int, default=20, help="bars per token chart")
    figures.add_run_flags(p)
    credit_page.add_flags(command("credit", lambda a: save(a, *credit_page.draw(a))))
    p = cmd("answer-forms", answer_forms, task="math500", problems=32, max_new=512)
    p.add_argument("--temperature", type=float, default=0.7, help="responses sampled at T (App. E.1)")
    p.add_argument(
        "--forms",
        nargs="+",
        choices=list(highflow.FORMS),
        default=list(highflow.FORMS),
        help="answer forms to compare with answer-only",
    )
    p.add_argument("--percents", type=int, nargs="+", default=highflow.PERCENTS, help="top K%% sets")
    p = cmd("deadend", deadend, task=None, batch=12, sampled=False)
    p.set_defaults(style="question", out="runs/deadend")  # deadend.py departure 5; results/deadend: kept
    p.add_argument("--n", type=int, default=200, help="twin pairs (each: two twins and one planted-line row)")
    p.add_argument(
        "--layers",
        default="middle",
        help="the flow graph's attention layers: middle, early, late, all or A:B",
    )
    p.add_argument(
        "--json", default=None, help="also write the summary alone (signals, paired, variant, verdict) here"
    )
    memory.add_flags(command("memory", memory_table, epilog="and any grpo.py flag (python grpo.py --help)"))
    sub.add_parser("learn", help=CMDS["learn"][0], add_help=False)  # listed; main hands it to learn.py
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "memory":  # memory hands the rest to grpo.parse_args
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.grpo_flags = rest
    check_ranges(ap, args)
    if args.cmd == "bench" and args.ks is None:
        args.ks = [k for k in (1, 2, 4, 8, 16) if k <= args.n]
    if args.cmd == "bench" and any(k < 1 or k > args.n for k in args.ks):
        ap.error(f"--ks must be in 1..--n ({args.n}): pass@k needs k <= n samples, got {args.ks}")
    return args


def check_ranges(ap, args):
    """Every flag's range (each value of a list), checked before any model loads: one line `eval.py: error:
    ...`, exit 2. An integer must first fit in int64: torch's integers, range()'s (no OverflowError later)."""
    each = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
    for name, v in vars(args).items():
        if any(isinstance(x, int) and abs(x) >= 2**63 for x in each(v)):
            ap.error(f"--{name.replace('_', '-')} must fit in int64 (|value| < 2**63), got {v}")
    sampling = args.cmd == "bench"  # bench samples; the others may be greedy
    counts = ("n", "batch_size", "max_new_tokens", "n_responses", "max_positions", "top", "prompt_tokens")
    rules = [
        *((name, lambda v: v >= 1, ">= 1") for name in counts),
        ("n_problems", lambda v: v >= 1, ">= 1 (leave it out for every problem)"),
        ("threads", lambda v: 1 <= v <= (os.cpu_count() or 1), f"in 1..{os.cpu_count()}"),
        ("seed", lambda v: 0 <= v < 2**63, "in [0, 2**63) (torch seeds are 64-bit)"),
        (
            "temperature",
            (lambda v: v > 0) if sampling else (lambda v: v >= 0),
            "> 0" if sampling else ">= 0 (0: greedy)",
        ),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("top_k", lambda v: v >= 0, ">= 0 (0: off)"),
        ("frac", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("percents", lambda v: 0 < v <= 100, "in 1..100"),
        ("alpha", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("index", lambda v: v >= 0, ">= 0"),
        ("token", lambda v: v >= 0, ">= 0"),
        ("context", lambda v: v >= 0, ">= 0"),
    ]
    for flag, ok, rule in rules:
        v = getattr(args, flag, None)
        if v is not None and not all((isinstance(x, int) or math.isfinite(x)) and ok(x) for x in each(v)):
            ap.error(f"--{flag.replace('_', '-')} must be {rule}, got {v}")
    for flag, problem in (
        ("--device", getattr(args, "device", None) and device_problem(args.device)),
        ("--out", getattr(args, "out", None) and directory.dir_problem(args.out)),
        ("--json", getattr(args, "json", None) and json_problem(args.json)),
    ):
        if problem:  # a GPU that is not there, an --out that cannot be written: now
            ap.error(f"{flag} {problem}")
    try:  # the spec's syntax here; whether it fits the model's depth: setup
        select_layers(getattr(args, "layers", None), 1000)
    except ValueError as e:
        ap.error(f"--layers: {e}")


def json_problem(path):
    """Why a --json file cannot be written there, as one sentence, or None (checked before a model loads)."""
    if Path(path).is_dir():
        return f"{path} is a directory"
    return directory.dir_problem(Path(path).parent)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["learn"]:  # its own parser and recipe: learn.py
        from evaluation import learn

        return learn.main(argv[1:], grpo)
    args = parse(argv)
    try:
        args.func(args)
    except (EvalError, data.DataError, ModelError, ckpt_io.RunError) as e:  # one line, never a bug's
        msg, code = e.args if isinstance(e, EvalError) else (e, 2)
        print(f"eval.py: error: {msg}", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
