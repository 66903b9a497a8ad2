"""`eval.py bench`: pass@1 (the mean over n samples), unbiased pass@k and greedy accuracy per benchmark, the
paper's Tables 2-4. The formulas and the table: evaluation/stats.py.

For each benchmark: its first --n-problems test problems, prompted in grpo.py's style for the model, n
samples per problem and one greedy response, each scored by the task's reward (data.reward).

Departures (eval.py's departure 2):
 1. bench samples with the training settings of App. C.3 (T = 0.99, top-p 1.0, top-k 100); greedy is argmax.
    A response counts as correct when its reward is 1 (Countdown's 0.1 format reward is not a pass); a
    response with no final answer (no \\boxed{} / <answer>) is wrong, and how many there were is reported.

Run: python eval.py bench --benchmarks gsm8k math500 --n-problems 50 --n 4   (default model: smollm2-135m)
"""

from tqdm import tqdm

import data
from evaluation import stats
from evaluation.harness import auto_style, records_for, resolve_model
from training.decode.rollout import Sampling, generate

BENCHMARKS = [
    "gsm8k",
    "math500",
    "aime24",
    "aime25",
    "amc23",
    "olympiadbench",
    "minerva",
    "countdown",
    "crossthinkqa",
]


def add_flags(p, config):
    """bench's own flags: the benchmarks, samples per problem, the k of pass@k, the sampling (App. C.3:
    `config`'s, grpo.Config's defaults)."""
    p.add_argument(
        "--benchmarks",
        nargs="+",
        default=BENCHMARKS,
        choices=list(data.TASKS),
        metavar="TASK",
        help=f"tasks: {', '.join(data.TASKS)}",
    )
    p.add_argument("--n", type=int, default=4, help="samples per problem for pass@1 / pass@k")
    p.add_argument(
        "--ks",
        type=int,
        nargs="+",
        default=None,
        help="k values for pass@k, each <= n (default: 1 2 4 8 16 up to n)",
    )
    for name, off in (("temperature", ""), ("top_p", ""), ("top_k", " (0: off)")):  # grpo.py's, App. C.3
        v = getattr(config, name)
        p.add_argument(
            f"--{name.replace('_', '-')}", type=type(v), default=v, help="sampling, App. C.3" + off
        )


def evaluate(model, tok, args):
    """(result, table, rows) for harness.save: {model, benchmarks: {name: summary}}, the markdown table, one
    row per problem (its samples, greedy response and verdicts)."""
    ks, n = [k for k in args.ks if k <= args.n], args.n
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k)  # top_k 0: off
    argmax = Sampling(args.max_new_tokens, greedy=True)
    results, rows = {}, []
    for name in tqdm(args.benchmarks, desc="bench", unit="benchmark"):
        recs = records_for(args, name)
        style = auto_style(resolve_model(args.model), data.TASKS[name].task, args.style)
        prompts = [data.make_prompt(r, tok, style) for r in recs]
        smp = generate(model, tok, prompts, n, sampling, chunk_size=args.batch_size)
        grd = generate(model, tok, prompts, 1, argmax, chunk_size=args.batch_size)
        mine = stats.problem_rows(name, recs, smp, grd, n)  # correct: reward 1 (departure 1)
        rows += mine
        results[name] = stats.summary(mine, n, ks, style, smp, grd)
    return {"model": args.model, "benchmarks": results}, stats.table(results, n, ks), rows
