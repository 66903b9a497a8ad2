"""The figures of `eval.py plot`: where the flow goes in one response, and how training curves move.

  flow_figures(model, tok, rows, args, figs, out)  Fig. 2, 7 and 3 from one forward over rows with responses
      heatmap   Fig. 2: the response's tokens coloured by flow throughput tau, with its colour bar, the answer
                region boxed and the boosted tokens (the top --top-frac by tau, gamma) underlined; the prompt
                apart, uncoloured (PNG + HTML, drawn by token_page.write_page)
      inout     Fig. 7: the inflow phi(i -> k) into one token k, and its outflow phi(k -> j), phi = f W'
                (two colour bars, the same marks)
      tokens    Fig. 3: the most frequent high- and low-flow tokens, as two bar charts
  use_run(args, cfg), run_rows(args, tok)  plot --run RUN_DIR: a run's saved rollouts (--step), drawn with the
                                     run's checkpoint, answer pattern, top_frac and gamma (add_run_flags)
  curves(runs, keys, alpha, png)     training curves, raw and smoothed by the peak-tracking EMA (App. C.3)
  metrics_rows(path)                 the rows of a metrics.jsonl that a killed run may have cut short
  metrics_runs(paths)                {run name: rows} of several metrics.jsonl files (eval.py plot --metrics)
  token_figure(path, tokens, colors, title)   tokens as text on coloured boxes: <path>.png and <path>.html
  log_scale(x)                       throughput -> colour values in [0, 1]

Departures (eval.py's departure 3; 1 is the EMA's alpha and EMA_0 = x_0, peak_ema below):
 3. Colours are on a log scale over three decades (the paper's Fig. 2 scale is not given). The token charts
    (Fig. 3 is a word cloud) count the top / bottom 20% tokens by throughput within each sentence (App. E.1),
    among the tokens before the answer ends (highflow.py departure 3).

Bad input is a ValueError with a one-line message (eval.py prints it as `eval.py: error: ...`, exit 2).

Run: python eval.py plot [--metrics runs/a/metrics.jsonl ...]
"""

import html
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch

from evaluation import credit_page, highflow, probes, token_page
from flowtracer import dag_weights, flow_credit, reweight, trace_flow
from training.credit.attention import attention_graph
from training.run.directory import file_problem


def token_figure(path, tokens, colors, title, width=100):
    """Tokens as text on coloured boxes, wrapped at `width` characters; saves PNG and HTML."""
    plt, lines, col = probes.pyplot(), [[]], 0
    for t, c in zip(tokens, colors):
        for n, piece in enumerate(t.split("\n")):
            if n or (col + len(piece) > width and col):  # a newline, or the line is full
                lines.append([])
                col = 0
            if piece:
                lines[-1].append((col, piece, c))
                col += len(piece)
    fig = plt.figure(figsize=(width * 0.602 * 8 / 72, 0.22 * len(lines) + 0.5))  # DejaVu Sans Mono: 0.602 em
    ax = fig.add_axes([0, 0, 1, 1 - 0.3 / (0.22 * len(lines) + 0.5)])
    ax.set(xlim=(0, width), ylim=(len(lines), 0), title=title)
    ax.axis("off")
    for y, line in enumerate(lines):
        for x, piece, c in line:
            ax.add_patch(plt.Rectangle((x, y + 0.05), len(piece), 0.9, color=c, lw=0))
            ax.text(x, y + 0.5, piece, family="monospace", fontsize=8, va="center", parse_math=False)
    fig.savefig(str(path) + ".png", dpi=110)
    plt.close(fig)
    rgba = lambda c: f"rgba({int(255 * c[0])},{int(255 * c[1])},{int(255 * c[2])},{c[3]:.2f})"  # noqa: E731

    def span(t, c):
        return f'<span style="background:{rgba(c)}">{html.escape(t).replace(chr(10), "<br>")}</span>'

    Path(str(path) + ".html").write_text(
        f"<html><body><h3>{html.escape(title)}</h3>"
        "<pre style='white-space:pre-wrap'>"
        + "".join(span(t, c) for t, c in zip(tokens, colors))
        + "</pre></body></html>"
    )


def log_scale(x):
    """x >= 0 -> [0, 1]: log10 of x / max(x) over three decades (departure 3)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    top = x.max().clamp_min(1e-300)
    return (1 + torch.log10((x / top).clamp_min(1e-3)) / 3).where(x > 0, torch.zeros_like(x)).tolist()


# ----------------------------------------------------------------------------- training curves
def metric_series(path, key):
    """[[step, value], ...] of one numeric metric of a metrics.jsonl, by step; the last line of a step wins,
    a line cut by a kill is skipped, a missing file gives []."""
    rows, path = {}, Path(path)
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get(key), (int, float)) and "step" in row:
            rows[row["step"]] = row[key]
    return [[s, v] for s, v in sorted(rows.items())]


def peak_ema(xs, alpha=0.2):
    """Peak-tracking EMA (App. C.3): EMA_t = alpha max(x_t, EMA_{t-1}) + (1 - alpha) EMA_{t-1},
    EMA_0 = x_0."""
    out = []
    for x in xs:
        out.append(x if not out else alpha * max(x, out[-1]) + (1 - alpha) * out[-1])
    return out


def metrics_rows(path):
    """The JSON objects of a metrics.jsonl; a last line cut by a kill is skipped, another bad one an error."""
    lines = Path(path).read_bytes().splitlines()
    rows = []
    for i, raw in enumerate(lines, 1):
        try:
            row = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except ValueError as e:  # JSON or UTF-8
            if i == len(lines):
                print(f"eval.py: {path}, line {i}: cut short (a killed run?), skipped", file=sys.stderr)
                continue
            raise ValueError(f"{path}, line {i}: not a JSON metrics line ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {i}: expected a JSON object, got {type(row).__name__}")
        step = row.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # null, "3", 1.5, -1
            raise ValueError(f"{path}, line {i}: step {json.dumps(step)[:40]} is not a step (an int >= 0)")
        rows += [row] if row else []
    return rows


def metrics_runs(paths):
    """{run name: metrics rows} of metrics.jsonl files, each named by its directory (the whole path where two
    directories share a name); a file that cannot be read is a ValueError naming it."""
    names = [Path(p).parent.name or str(p) for p in paths]
    runs = {}
    for p, name in zip(paths, names):
        if file_problem(p):  # missing, a directory, a symlink loop or dangling
            raise ValueError(f"--metrics {file_problem(p)} (give a run's metrics.jsonl)")
        runs[name if names.count(name) == 1 else str(p)] = metrics_rows(p)
    return runs


def curves(runs, keys, alpha, png):
    """One panel per metric key, one line per run ({name: metrics rows}): the peak-tracking EMA over the raw
    curve. Returns {"final_peak_ema": {"run/key": last EMA value}}."""
    missing = [k for k in keys if not any(k in r for rows in runs.values() for r in rows)]
    if missing:
        known = sorted({k for rows in runs.values() for r in rows for k in r})
        raise ValueError(f"--keys {' '.join(missing)}: in no metrics row (known: {', '.join(known)})")
    plt, smooth = probes.pyplot(), {}
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, rows in runs.items():
            pts = [
                (r.get("step", i), r[key])
                for i, r in enumerate(rows, 1)
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
            ]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ema = peak_ema(ys, alpha)
            (line,) = ax.plot(xs, ema, label=name)
            ax.plot(xs, ys, color=line.get_color(), alpha=0.25, lw=0.8)
            smooth[f"{name}/{key}"] = ema[-1]
        ax.set(title=f"{key} (peak EMA, alpha={alpha})", xlabel="step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return {"final_peak_ema": smooth}


# ----------------------------------------------------------------------------- the flow of one response
def add_run_flags(p):
    """plot's --run and --step; --model's default becomes the run's checkpoint (use_run)."""
    p.add_argument(
        "--run",
        default=None,
        metavar="RUN_DIR",
        help="draw a grpo.py run's saved rollouts "
        "(rollouts/step_N.jsonl) with its checkpoint, --answer-pattern, --top-frac and --gamma",
    )
    p.add_argument(
        "--step",
        type=credit_page.at_least(1),
        default=None,
        metavar="N",
        help="--run's saved step (default: the last saved)",
    )
    model = p._option_string_actions["--model"]
    model.default, model.help = None, model.help + " (default: --run's checkpoint, else smollm2-135m)"


def use_run(args, cfg):
    """plot --run RUN_DIR: the run's checkpoint as --model unless one is given, and its --answer-pattern,
    --top-frac and --gamma (the boosted marks) from its run_config.json; without --run: smollm2-135m and
    cfg's top_frac and gamma (grpo.Config's: the paper's)."""
    saved = credit_page.run_config(args.run) if args.run else {}
    if args.run and args.responses:
        raise ValueError("plot: --run draws the run's rollouts; leave out --responses")
    if args.run and not args.model and not saved:
        raise ValueError(
            f"--run {args.run}: no checkpoint (ckpt/run_config.json) to draw the flow with; give --model"
        )
    args.model = args.model or args.run or "smollm2-135m"
    if args.answer_pattern is None:
        args.answer_pattern = saved.get("answer_pattern") or None
    args.top_frac = saved.get("top_frac", cfg.top_frac)
    args.gamma = saved.get("gamma", cfg.gamma)


def run_rows(args, tok):
    """The rollouts of --run's saved step as flow_figures takes them: the prompt and the response tokenised
    again from their saved text (the response's tokens joined: its EOS included), with the reward and A."""
    step, path, saved = credit_page.read_rollouts(args.run, args.step)
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    rows = [
        {
            "record": {"id": f"step {step}, row {i}"},
            "prompt": ids(r["prompt"]),
            "response": ids("".join(r["tokens"])),
            "reward": r["reward"],
            "adv": r["adv"],
        }
        for i, r in enumerate(saved)
    ]
    rows = [r for r in rows if r["response"] and r["prompt"]]
    if not rows:
        raise ValueError(f"{path}: no rollout with a prompt and a response")
    return rows


def flow_figures(model, tok, rows, args, figs, out):
    """The flow figures named in `figs` for rows with responses (probes.regions); returns their numbers. When
    no response has an answer it draws nothing and n_no_answer == n_responses."""
    batch = probes.regions(tok, rows, getattr(args, "answer_pattern", None))
    dev, P = model.device, batch.prompt_width
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    attn = attention_graph(model, ids, mask, args.layers)  # (B, T, T)
    valid, ans = batch.attention_mask.bool().to(dev), batch.answer_mask.to(dev)
    fl = trace_flow(attn, batch.question_mask.to(dev), ans, attention_mask=valid)
    has = [b for b in range(len(rows)) if batch.answer_mask[b].any()]
    res = {"n_responses": len(rows), "n_no_answer": len(rows) - len(has)}
    if not has:
        return res
    b = has[min(args.index, len(has) - 1)]
    lo, end = P - min(args.context, int(batch.attention_mask[b, :P].sum())), P + len(rows[b]["response"])
    toks = [token_page.visible(tok.decode([t])) for t in batch.input_ids[b, lo:end].tolist()]
    gamma, top = args.gamma, args.top_frac  # use_run's: the run's, else the paper's
    c = flow_credit(fl.throughput[b], batch.response_mask[b].to(dev), top, gamma, prompt_width=P)  # eq. 6
    n, tau = P - lo, fl.throughput[b, lo:end].tolist()  # n: the prompt tokens drawn
    side = [f"reward {rows[b]['reward']:.3g}"] if isinstance(rows[b].get("reward"), (int, float)) else []
    side += [credit_page.adv_text(rows[b]["adv"])] if isinstance(rows[b].get("adv"), (int, float)) else []
    marks = Marks(
        toks,
        n,
        batch.answer_mask[b, P:end].tolist(),
        c.weight[: end - P].tolist(),
        tau,
        side + [f"γ {gamma:g}: top {top:.0%} by τ"],
        f"{rows[b]['record']['id']}: response {has.index(b) + 1} of the {len(has)} with an answer "
        f"region (--index); the prompt's last {n} tokens above it",
    )
    if "heatmap" in figs:  # Fig. 2
        bar = token_page.scale(tau[n:], "flow throughput τ (eq. 4)")
        marks.draw(
            out / "heatmap",
            f"flow throughput, {rows[b]['record']['id']}",
            [None] * n + [bar.color(x) for x in tau[n:]],
            [bar],
        )
    if "inout" in figs:  # Fig. 7
        resp_tau = torch.where(batch.answer_mask[b, P:end].to(dev), 0, fl.throughput[b, P:end])
        if args.token is not None and not 0 <= args.token < end - P:
            raise ValueError(f"--token {args.token}: the response has {end - P} tokens")
        k = P + (args.token if args.token is not None else int(resp_tau.argmax()))
        Wp = reweight(dag_weights(attn[b : b + 1], ans[b : b + 1], valid[b : b + 1]), fl.h[b : b + 1])[
            0
        ]  # (T, T) W'
        inflow, outflow = fl.flow[b] * Wp[:, k], fl.flow[b, k] * Wp[k]  # phi(i -> k), phi(k -> j)
        vin, vout = inflow[lo:end].tolist(), outflow[lo:end].tolist()
        bin_ = token_page.scale(vin, f"inflow φ(i → k) into {toks[k - lo]!r} (red)", "Blues")
        bout = token_page.scale(vout, "outflow φ(k → j)", "Oranges")
        colors = [
            (1, 0.2, 0.2, 1) if lo + j == k else bin_.color(a) if lo + j < k else bout.color(c)
            for j, (a, c) in enumerate(zip(vin, vout))
        ]
        title = f"inflow (blue) into / outflow (orange) from {toks[k - lo]!r} (red)"
        marks.draw(out / "inout", title, colors, [bin_, bout])
        res["inout"] = {
            "token": toks[k - lo],
            "position": k - P,
            "inflow_total": float(inflow.sum()),
            "outflow_total": float(outflow.sum()),
            "inflow_from_prompt": float(inflow[:P].sum()),
        }
    if "tokens" in figs:  # Fig. 3
        res["tokens"] = token_charts(tok, batch, fl, has, args, out / "tokens.png")
    return res


class Marks(NamedTuple):
    """One response drawn by a flow figure: its prompt's last n tokens apart, then the response's tokens with
    the answer region and the boosted tokens marked (token_page's page: PNG + HTML)."""

    toks: list  # the tokens drawn: n prompt tokens, then the response's
    n: int
    answer: list  # per response token: in the answer region (eq. 2)
    weight: list  # per response token: gamma (eq. 6); > 1: boosted
    tau: list  # per token drawn: the throughput (the hover text)
    side: list  # the lines beside the response: reward, A, the rule of the marks
    note: str  # the line under the title: which response, which prompt tokens

    def draw(self, stem, title, colors, bars):
        """<stem>.png and <stem>.html: the tokens on `colors` (one per token drawn), `bars` their scales."""
        n, Tok = self.n, token_page.Tok
        prompt = [Tok(self.toks[j], colors[j], tip=f"τ {self.tau[j]:.3g}") for j in range(n)]
        resp = [
            Tok(
                self.toks[j],
                colors[j],
                self.answer[j - n],
                self.weight[j - n] > 1,
                f"τ {self.tau[j]:.3g} · γ {self.weight[j - n]:g}",
            )
            for j in range(n, len(self.toks))
        ]
        token_page.write_page(
            stem,
            title,
            [self.note],
            [token_page.Row(["prompt"], prompt, prompt=True), token_page.Row(self.side, resp)],
            bars,
        )


def token_charts(tok, batch, fl, has, args, png):
    """Fig. 3: the args.top most frequent tokens among each sentence's top and bottom args.frac by
    throughput, over the responses `has` (departure 3)."""
    plt, P, high, low = probes.pyplot(), batch.prompt_width, Counter(), Counter()
    for i in has:
        a_end = int(batch.answer_mask[i].nonzero().max()) + 1
        pieces = [tok.decode([x]) for x in batch.input_ids[i, P:a_end].tolist()]
        hi, lo = highflow.per_sentence(fl.throughput[i, P:a_end].tolist(), pieces, args.frac)  # App. E.1
        high.update(pieces[j] for j in hi)
        low.update(pieces[j] for j in lo)
    fig, axes = plt.subplots(1, 2, figsize=(10, 5))
    panels = (("high-flow (top", high, "tab:red"), ("low-flow (bottom", low, "tab:gray"))
    for ax, (name, cnt, color) in zip(axes, panels):
        top = cnt.most_common(args.top)[::-1]  # spaces as ␣, newlines as \n
        ax.barh([repr(w)[1:-1].replace(" ", "␣") for w, _ in top], [c for _, c in top], color=color)
        ax.set_title(f"{name} {args.frac:.0%} of each sentence)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return {"high": high.most_common(args.top), "low": low.most_common(args.top)}
