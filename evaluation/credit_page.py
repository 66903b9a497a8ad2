"""Where the credit went in one saved step: each rollout's tokens coloured by their credit, as a page to read.

    python eval.py credit RUN_DIR [--step N]   ->   RUN_DIR/credit/step_N/credit.html, .png, .json, .md

A grpo.py run saves the rows of a step, every --rollouts-every steps, with their per-token credit
(training/run/log.py's save_rollouts) in RUN_DIR/rollouts/step_N.jsonl (N: 5 digits), one JSON object a
line:

  prompt    str      the prompt as the model read it: decoded with its special tokens (the chat template's)
  response  str      the response, decoded without special tokens
  reward    float    its reward r_i (the task's verifier, or the weighted sum of the --reward functions)
  adv       float    its advantage A_i (eq. 10, clipped to +-2); 0 when its group's rewards did not vary: the
                     row adds nothing to the loss, is not trained (grpo.py departure 7) and gets no credit
  tokens    [str]    the response's tokens, each decoded alone (special tokens included: the EOS)
  answer    [bool]   per token: inside the answer region, eq. 2's sink (--answer-pattern's last match, else
                     the last \\boxed{}, else <answer>...</answer>)
  score     [float]  per token: the credit signal's score (--credit flow: the throughput tau of eq. 4); 0 on a
                     row that was not trained
  weight    [float]  per token: gamma_it, the factor on its loss term (eq. 5-6): --gamma (1.5) on the top
                     --top-frac (40%) by tau, 1 on the rest; all 1 where the credit fell back (no answer
                     region, or no flow reached the response: plain GRPO for that row)
The rows are the step's kept rows in order: a prompt's group of G rows is consecutive (--dynamic-filter may
drop some).

The page shows the first --groups prompts of the step: each prompt apart (grey, its last lines; in the HTML
the whole prompt folded under it), then each of its responses with its reward and A beside it, its tokens on
a colour scale of the score (for tau: log10 over three decades below the page's largest, figures.py
departure 3; a token with tau = 0, after the answer for one, stays white), the answer region boxed in blue
and the boosted tokens (gamma > 1) underlined in purple. A row with A = 0 reads "no credit"; a trained row
whose credit fell back says why. credit.html is one self-contained file (inline CSS, no script, nothing
fetched); credit.png is the same page drawn by matplotlib; credit.json and credit.md give each row's numbers.

The page is drawn by token_page.py (as are eval.py plot's heatmap and inout figures).
Bad input (no run, no rollouts, a step that was not saved, a broken line) is a RunError with one line.

Run: python eval.py credit runs/embedded --step 6
Test: python -m pytest -q tests/evaluation/test_credit_page.py
"""

import argparse
import json
import re
import sys
from pathlib import Path

from evaluation.token_page import Row, Tok, scale, visible, write_page
from training.run.checkpoint import RUN_CONFIG
from training.run.directory import RunError

FIELDS = ("prompt", "response", "reward", "adv", "tokens", "answer", "score", "weight")
PROMPT_CHARS = 320  # the prompt's tail shown (the whole: folded under it in the HTML)


# ----------------------------------------------------------------------------- a run's saved step
def steps_saved(run):
    return sorted(
        int(p.stem.split("_")[1])
        for p in (Path(run) / "rollouts").glob("step_*.jsonl")
        if p.stem.split("_")[1].isdigit()
    )


def read_rollouts(run, step=None):
    """(step, path, rows) of RUN_DIR/rollouts/step_N.jsonl: `step`, or the last saved. A last line cut short
    by a kill is skipped (said on stderr); anything else wrong is a RunError naming the file and line."""
    run = Path(run)
    if not run.is_dir():
        raise RunError(f"{run}: not a run directory (give grpo.py's --out-dir, e.g. runs/embedded)")
    saved = steps_saved(run)
    if not saved:
        raise RunError(f"{run}: no rollouts/step_*.jsonl (a run saves them every --rollouts-every steps)")
    if step is not None and step not in saved:
        raise RunError(f"--step {step}: not saved in {run}/rollouts (saved: {', '.join(map(str, saved))})")
    step = saved[-1] if step is None else step
    path = run / "rollouts" / f"step_{step:05d}.jsonl"
    lines, rows = path.read_bytes().splitlines(), []
    for i, raw in enumerate(lines, 1):
        try:
            row = json.loads(raw.decode("utf-8"))
        except ValueError as e:
            if i == len(lines):
                print(f"eval.py: {path}, line {i}: cut short (a killed run?), skipped", file=sys.stderr)
                continue
            raise RunError(f"{path}, line {i}: not a JSON line ({e})") from None
        rows.append(check_row(row, f"{path}, line {i}"))
    if not rows:
        raise RunError(f"{path}: no rollouts")
    return step, path, rows


def check_row(row, where):
    """A rollout line as save_rollouts writes it, or a RunError naming what is not."""
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if not isinstance(row, dict) or any(k not in row for k in FIELDS):
        raise RunError(f"{where}: a rollout line has the fields {', '.join(FIELDS)}")
    n = len(row["tokens"]) if isinstance(row["tokens"], list) else -1
    if not all(isinstance(row[k], list) and len(row[k]) == n for k in FIELDS[4:]):
        raise RunError(f"{where}: tokens, answer, score and weight must be lists of one length")
    if not (
        isinstance(row["prompt"], str)
        and all(isinstance(t, str) for t in row["tokens"])
        and all(map(num, [row["reward"], row["adv"], *row["score"], *row["weight"]]))
    ):
        raise RunError(f"{where}: prompt and tokens must be text; reward, adv, score and weight numbers")
    return row


def run_config(run):
    """The run's flags (ckpt/run_config.json, else the newest ckpt-N/'s); {} where no checkpoint has them."""
    for d in [Path(run) / "ckpt", *sorted(Path(run).glob("ckpt-*"), reverse=True)]:
        try:
            return json.loads((d / RUN_CONFIG).read_text())
        except (OSError, ValueError):
            continue
    return {}


def groups(rows):
    """[(first, end)] of the runs of consecutive rows with one prompt: a step's groups."""
    out = []
    for i, r in enumerate(rows):
        if out and rows[out[-1][0]]["prompt"] == r["prompt"]:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def credit_note(row):
    """What became of a response's credit, in words."""
    w = row["weight"]
    if row["adv"] == 0:
        return "no credit"
    if not any(row["answer"]):
        return "no answer region: plain GRPO"
    if all(x == 1 for x in w):
        return "credit fell back: plain GRPO"
    up, down = sum(x > 1 for x in w), sum(x < 1 for x in w)
    return f"{up} of {len(w)} boosted" + (f", {down} damped" if down else "")


def prompt_row(prompt, label="prompt"):
    """The prompt set apart: its last lines (up to PROMPT_CHARS characters), the whole folded under it."""
    tail, keep = prompt.rstrip("\n"), []
    for line in reversed(tail.split("\n")):
        if keep and sum(map(len, keep)) + len(line) > PROMPT_CHARS:
            break
        keep.insert(0, line[-PROMPT_CHARS:])
    cut = "\n".join(keep) != tail
    words = re.findall(r"\S+\s*|\s+", visible(("…" if cut else "") + "\n".join(keep)))  # wraps at words
    return Row([label], [Tok(w) for w in words], prompt=True, full=visible(prompt) if cut else "")


def response_row(row, bar, sym="score"):
    """A saved rollout drawn: its tokens coloured by score (none where A = 0), marked; reward, A beside."""
    color = bar.color if row["adv"] != 0 else lambda s: None
    toks = [
        Tok(visible(t), color(s), bool(a), w > 1, f"{sym} {s:.3g} · γ {w:g}")
        for t, a, s, w in zip(row["tokens"], row["answer"], row["score"], row["weight"])
    ]
    return Row([f"reward {row['reward']:.3g}", adv_text(row["adv"]), credit_note(row)], toks)


def adv_text(a):
    return "A = 0" if a == 0 else f"A {a:+.3g}"


def describe(cfg):
    """The run's credit in words, from its run_config.json ({}: unknown)."""
    if not cfg:
        return "the run's flags are not known (no ckpt/run_config.json): the marks are the saved weights"
    rule = (
        f"γ = {cfg.get('gamma')} on the top {cfg.get('top_frac', 0):.0%} of each response's tokens by score"
        if cfg.get("shaping") == "topk"
        else f"shaping {cfg.get('shaping')}"
    )
    return f"{cfg.get('model')} on {cfg.get('dataset')}; credit {cfg.get('credit')}: {rule}"


COLUMNS = ["prompt", "row", "reward", "adv", "tokens", "answer_tokens", "boosted", "credit"]  # credit.md
#          (the prompt's group, from 1, as on the page; the row: its line in the rollouts file, from 0)


def draw(args):
    """eval.py credit: the page of one saved step into --out. Returns (result, table) for harness.save."""
    step, path, rows = read_rollouts(args.run_dir, args.step)
    cfg, spans = run_config(args.run_dir), groups(rows)
    shown = spans[: args.groups or None]
    args.out = args.out or str(Path(args.run_dir) / "credit" / f"step_{step:05d}")
    flow = cfg.get("credit", "flow") == "flow"
    label = "flow throughput τ (eq. 4)" if flow else f"score of --credit {cfg['credit']}"
    bar = scale([s for a, b in shown for r in rows[a:b] if r["adv"] != 0 for s in r["score"]], label)
    page = []
    for g, (a, b) in enumerate(shown):
        page += [prompt_row(rows[a]["prompt"], f"prompt {g + 1} ({b - a} responses)")]
        page += [response_row(r, bar, "τ" if flow else "score") for r in rows[a:b]]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    more = f", the first {len(shown)} drawn" if len(shown) < len(spans) else ""
    notes = [describe(cfg), f"{path}: {len(rows)} responses in {len(spans)} groups{more}"]
    title = f"Credit at step {step}: {Path(args.run_dir).resolve().name}"
    html_path, png_path = write_page(Path(args.out) / "credit", title, notes, page, [bar])
    table = [
        [
            g,
            i,
            r["reward"],
            r["adv"],
            len(r["tokens"]),
            sum(map(bool, r["answer"])),
            sum(w > 1 for w in r["weight"]),
            credit_note(r),
        ]
        for g, (a, b) in enumerate(spans, 1)
        for i, r in enumerate(rows[a:b], a)
    ]
    from evaluation.probes import markdown

    result = {
        "run": str(args.run_dir),
        "step": step,
        "rollouts": str(path),
        "config": describe(cfg),
        "html": str(html_path),
        "png": str(png_path),
        "rows": [dict(zip(COLUMNS, r)) for r in table],
    }
    return result, markdown(COLUMNS, table) + f"\npage: {html_path}\npng:  {png_path}"


def at_least(lo):
    """An argparse type: an int >= lo; else argparse's one line `eval.py: error: argument --flag: ...`."""

    def value(text):
        if int(text) < lo:  # not an int: argparse's "invalid ... value"
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return int(text)

    value.__name__ = f"int >= {lo}"
    return value


def add_flags(p):
    """eval.py credit's flags (its entry: eval.py's parse)."""
    p.usage = "%(prog)s RUN_DIR [--step N] [--groups N] [--out DIR]"
    p.add_argument("run_dir", metavar="RUN_DIR", help="a grpo.py run directory (its --out-dir)")
    p.add_argument(
        "--step",
        type=at_least(1),
        default=None,
        metavar="N",
        help="the saved step to draw (default: the last saved)",
    )
    p.add_argument(
        "--groups", type=at_least(0), default=4, metavar="N", help="draw the first N prompts' groups (0: all)"
    )
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/credit/step_N)")
    return p
