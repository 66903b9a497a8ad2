"""A page of tokens to read: each token on its colour, the answer region boxed, the boosted tokens underlined,
the prompt set apart, a colour bar; as one HTML file and as a PNG of the same (matplotlib).

  Tok, Row, Bar                  a token as drawn, a row of them with the lines beside it, a colour scale
  scale(values, label, cmap)     a Bar over values: log10 over DECADES below the largest (flow throughput), or
                                 linear where a value is negative
  write_page(stem, title, notes, rows, bars)   <stem>.html and <stem>.png
  visible(text)                  control characters as their Unicode pictures (a byte model's \\x10 as ␐)

The HTML page is self-contained: inline CSS, no script, nothing fetched; it opens in any browser, and each
token's hover text gives its score and gamma. The PNG lays the tokens on a monospace grid (DejaVu Sans Mono,
glyph advances unhinted so that they meet the grid). Used by `eval.py credit` (credit_page.py: a run's saved
step) and by `eval.py plot`'s heatmap and inout figures (figures.py).

Run the tests: python -m pytest -q tests/evaluation/test_credit_page.py
"""

import html
import math
from pathlib import Path
from typing import NamedTuple

ANSWER, BOOST, PROMPT = "#1565c0", "#8e24aa", "#f1f1f1"  # the answer's box, the boosted line, prompt ground
CMAP, DECADES = "YlOrRd", 3  # the score's colours; a log scale's span


# ----------------------------------------------------------------------------- what a page draws
class Tok(NamedTuple):
    text: str  # as drawn: visible(the token's text)
    color: tuple | None = None  # RGBA in [0, 1]; None: not coloured (a prompt, a row without credit)
    answer: bool = False  # inside the answer region (eq. 2's sink): boxed
    boosted: bool = False  # gamma > 1 on its loss term: underlined
    tip: str = ""  # the HTML's hover text: its score and gamma


class Row(NamedTuple):
    side: list  # the lines beside the tokens: reward, A, what became of the credit
    tokens: list  # [Tok]
    prompt: bool = False  # a prompt: set apart (grey ground); `full` is folded under it in the HTML
    full: str = ""


class Bar(NamedTuple):
    """One colour scale: value -> colour (None: not coloured), drawn as a colour bar with `label`."""

    cmap: object  # a matplotlib colormap (scale's: a named one without its two ends)
    norm: object  # a matplotlib Normalize (LogNorm for tau)
    label: str

    def color(self, x):
        if x is None or not math.isfinite(x) or (self.log and x <= 0):
            return None
        return tuple(self.cmap(float(self.norm(x))))

    @property
    def log(self):
        return type(self.norm).__name__ == "LogNorm"


PICTURES = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {0x7F: 0x2421}  # control pictures


def visible(text):
    """The text with each control character but tab and newline as its picture (U+2400...): a byte-level
    model's \\x10 drawn as ␐, not as nothing (or a missing glyph)."""
    return text.translate(PICTURES)


def scale(values, label, cmap=CMAP):
    """A Bar over `values`: log10 over DECADES below the largest when none is negative, else linear. Its
    colours are the named map's from 0.05 to 0.85: the text stays readable on the darkest."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, LogNorm, Normalize

    colors = ListedColormap(colormaps[cmap](np.linspace(0.05, 0.85, 256)))
    xs = [x for x in values if math.isfinite(x)] or [0.0]
    top = max(xs)
    if min(xs) >= 0:
        top = top if top > 0 else 1.0
        return Bar(colors, LogNorm(top / 10**DECADES, top, clip=True), label)
    return Bar(colors, Normalize(min(xs), top if top > min(xs) else min(xs) + 1, clip=True), label)


def ticks(bar, n=DECADES + 1):
    """(position in [0, 1], label) of a bar's ticks: each decade of a log bar, n steps of a linear one."""
    lo, hi = bar.norm.vmin, bar.norm.vmax
    vals = (
        [lo * 10**k for k in range(DECADES + 1)]
        if bar.log
        else [lo + (hi - lo) * k / (n - 1) for k in range(n)]
    )
    return [(float(bar.norm(v)), f"{v:.2g}") for v in vals]


# ----------------------------------------------------------------------------- the HTML page
CSS = f"""body{{font-family:system-ui,sans-serif;margin:1.2em 2em;color:#222}}
h1{{font-size:1.25em;margin:.2em 0}} .sub{{color:#555;margin:.2em 0 .8em}}
.legend{{display:flex;flex-wrap:wrap;gap:1.6em;align-items:flex-end;margin-bottom:1em;font-size:.9em}}
.bar{{width:22em}} .grad{{height:.9em;border:1px solid #999}} .ticks{{position:relative;height:1.2em}}
.ticks span{{position:absolute;transform:translateX(-50%);font-size:.8em;color:#444}}
.group{{border-top:2px solid #bbb;margin-top:.6em}}
.row{{display:grid;grid-template-columns:11em 1fr;gap:1em;padding:.35em 0;border-top:1px solid #e4e4e4}}
.side{{font-size:.85em;color:#333;line-height:1.5}} .side .note{{color:#777}}
.toks{{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:.9em;white-space:pre-wrap;
word-break:break-word;line-height:2}}
.prompt .toks{{background:{PROMPT};color:#666;padding:0 .3em}} .prompt .side{{color:#777}}
.ans{{outline:2px solid {ANSWER};outline-offset:1px}}
.boost{{border-bottom:3px solid {BOOST}}}
details{{color:#777;font-size:.85em}}
"""


def hex_color(c):
    return "#" + "".join(f"{round(255 * v):02x}" for v in c[:3])


def html_tokens(toks):
    """The tokens as spans; each run of answer tokens inside one <span class="ans">, so the box is one."""
    out, i = [], 0
    while i < len(toks):
        j = i + 1
        while toks[i].answer and j < len(toks) and toks[j].answer:
            j += 1
        spans = "".join(html_token(t) for t in toks[i:j])
        out.append(f'<span class="ans">{spans}</span>' if toks[i].answer else spans)
        i = j
    return "".join(out)


def html_token(t):
    style = f' style="background:{hex_color(t.color)}"' if t.color else ""
    cls = ' class="t boost"' if t.boosted else ' class="t"'
    tip = f' title="{html.escape(t.tip)}"' if t.tip else ""
    return f"<span{cls}{style}{tip}>{html.escape(t.text)}</span>"


def html_page(title, notes, rows, bars):
    """One self-contained page: inline CSS, no script, nothing fetched."""
    legend = []
    for bar in bars:
        stops = ", ".join(hex_color(bar.cmap(k / 10)) for k in range(11))
        marks = "".join(f'<span style="left:{100 * p:.1f}%">{html.escape(s)}</span>' for p, s in ticks(bar))
        legend.append(
            f'<div class="bar"><div>{html.escape(bar.label)}</div><div class="grad" '
            f'style="background:linear-gradient(to right, {stops})"></div>'
            f'<div class="ticks">{marks}</div></div>'
        )
    legend += [
        '<div><span class="toks"><span class="ans">answer</span></span> answer region (eq. 2)</div>',
        '<div><span class="toks"><span class="boost">token</span></span> boosted: γ &gt; 1</div>',
        '<div class="prompt"><span class="toks">prompt</span></div>',
    ]
    body = []
    for r in rows:
        if r.prompt and body:
            body.append('</section><section class="group">')
        side = "<br>".join(
            f'<span class="note">{html.escape(s)}</span>' if k > 1 else html.escape(s)
            for k, s in enumerate(r.side)
        )
        fold = (
            f"<details><summary>the whole prompt ({len(r.full)} characters)</summary>"
            f"<span class='toks'>{html.escape(r.full)}</span></details>"
            if r.full
            else ""
        )
        body.append(
            f'<div class="row{" prompt" if r.prompt else ""}"><div class="side">{side}</div>'
            f'<div><div class="toks">{html_tokens(r.tokens)}</div>{fold}</div></div>'
        )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n"
        + "".join(f'<p class="sub">{html.escape(n)}</p>\n' for n in notes)
        + f'<div class="legend">{"".join(legend)}</div>\n<section class="group">'
        + "\n".join(body)
        + "</section>\n</body></html>\n"
    )


# ----------------------------------------------------------------------------- the same page as a PNG
def wrap(toks, width):
    """Lines of (column, text, Tok): a token's newline starts a line, a full line wraps before a token, and a
    piece longer than a line goes on over the next ones."""
    lines, col = [[]], 0
    for t in toks:
        for n, piece in enumerate(t.text.replace("\t", "    ").split("\n")):
            if n or (col + len(piece) > width and col):
                lines.append([])
                col = 0
            while len(piece) > width - col:
                lines[-1].append((col, piece[: width - col], t))
                lines.append([])
                piece, col = piece[width - col :], 0
            if piece:
                lines[-1].append((col, piece, t))
                col += len(piece)
    return lines[:-1] if len(lines) > 1 and not lines[-1] else lines  # a last newline: no empty line


def answer_runs(line):
    """[(first column, end column)] of the runs of answer tokens on one wrapped line."""
    runs = []
    for col, piece, t in line:
        if t.answer and runs and runs[-1][1] == col:
            runs[-1][1] = col + len(piece)
        elif t.answer:
            runs.append([col, col + len(piece)])
    return runs


def png_page(path, title, notes, rows, bars, width=100):
    """The page drawn by matplotlib: a monospace grid, `width` token characters a line beside the side."""
    import textwrap

    from matplotlib import rc_context
    from matplotlib.cm import ScalarMappable

    from evaluation.probes import pyplot

    plt = pyplot()
    S, em, lh = 21, 0.602 * 8 / 72, 0.2  # side column (chars); DejaVu Sans Mono's em, a line (inches)
    laid = [(r, wrap(r.tokens, width), [x for s in r.side for x in textwrap.wrap(s, S - 2)]) for r in rows]
    n = sum(max(len(lines), len(side)) + 0.4 for r, lines, side in laid)
    head = 1.0 + 0.2 * len(notes)
    W, H = (S + width + 2) * em, head + n * lh + 0.2
    with rc_context({"text.hinting": "none"}):  # glyph advances as the font has them: tokens meet on the grid
        fig = plt.figure(figsize=(W, H))
        fig.text(0.01, 1 - 0.25 / H, title, fontsize=11, va="center", weight="bold")
        for k, note in enumerate(notes):
            fig.text(0.01, 1 - (0.5 + 0.2 * k) / H, note, fontsize=8, va="center", color="#444")
        y0 = 1 - (0.65 + 0.2 * len(notes)) / H
        for k, bar in enumerate(bars):  # the colour bars, then the marks' key
            cax = fig.add_axes([0.02 + 0.3 * k, y0 - 0.1 / H, 0.25, 0.1 / H])
            cb = fig.colorbar(ScalarMappable(bar.norm, bar.cmap), cax=cax, orientation="horizontal")
            cax.set_title(bar.label, fontsize=7, loc="left", pad=2)
            cb.ax.tick_params(labelsize=6)
        x0 = 0.04 + 0.3 * len(bars)
        fig.text(
            x0,
            y0 - 0.05 / H,
            "answer region (eq. 2)",
            fontsize=8,
            va="center",
            bbox={"facecolor": "none", "edgecolor": ANSWER, "lw": 1.5, "pad": 1.5},
        )
        fig.text(x0 + 0.2, y0 - 0.05 / H, "boosted: γ > 1", fontsize=8, va="center")
        fig.add_artist(plt.Line2D([x0 + 0.2, x0 + 0.3], [y0 - 0.12 / H] * 2, color=BOOST, lw=2.5))
        ax = fig.add_axes([0, 0, 1, (n * lh + 0.2) / H])
        ax.set(xlim=(0, S + width + 2), ylim=(n + 0.2, 0))
        ax.axis("off")
        y = 0.2
        for r, lines, side in laid:
            ax.axhline(y - 0.2, color="#bbb" if r.prompt else "#e4e4e4", lw=1.2 if r.prompt else 0.6)
            if r.prompt:
                ax.add_patch(plt.Rectangle((S, y), width + 1, len(lines), color=PROMPT, lw=0))
            for k, s in enumerate(side):
                ax.text(
                    0.5,
                    y + k + 0.5,
                    s,
                    fontsize=7.5,
                    va="center",
                    parse_math=False,
                    color="#777" if r.prompt or k >= 2 else "#222",
                )
            for k, line in enumerate(lines):
                for a, b in answer_runs(line):  # one box round each run of answer tokens
                    ax.add_patch(
                        plt.Rectangle(
                            (S + 0.5 + a, y + k + 0.02), b - a, 0.96, fill=False, lw=1.2, edgecolor=ANSWER
                        )
                    )
                for col, piece, t in line:
                    x = S + 0.5 + col
                    if t.color:
                        ax.add_patch(plt.Rectangle((x, y + k + 0.05), len(piece), 0.9, color=t.color, lw=0))
                    if t.boosted:
                        ax.plot(
                            [x + 0.05, x + len(piece) - 0.05],
                            [y + k + 0.93] * 2,
                            color=BOOST,
                            lw=2,
                            solid_capstyle="butt",
                        )
                    ax.text(
                        x,
                        y + k + 0.5,
                        piece,
                        family="monospace",
                        fontsize=8,
                        va="center",
                        parse_math=False,
                        color="#666" if r.prompt else "#111",
                    )
            y += max(len(lines), len(side)) + 0.4
        fig.savefig(path, dpi=110)
    plt.close(fig)


def write_page(stem, title, notes, rows, bars):
    """<stem>.html and <stem>.png of the same page; returns their paths."""
    stem = Path(stem)
    page = stem.with_name(stem.name + ".html")
    page.write_text(html_page(title, notes, rows, bars), encoding="utf-8")
    png = stem.with_name(stem.name + ".png")
    png_page(png, title, notes, rows, bars)
    return page, png
