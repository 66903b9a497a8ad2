"""Each rollout's credit, drawn: `eval.py credit` (evaluation/credit_page.py, token_page.py) and
`eval.py plot --run` (evaluation/figures.py).

A real run on tiny-qwen3 (one step, rollouts saved) holds one group whose rewards do not vary (A = 0: "no
credit") and one whose rewards alternate (every row trained, flow credit on its answer region, the last word).
Its page is rendered by headless Chromium (Debian's package; the test skips, saying so, where it is absent):
the dumped DOM holds each response's tokens, its answer region and its boosted tokens as the rollouts file
has them, and the screenshot shows the answer box's and the boosted line's colours.

Run: python -m pytest -q tests/evaluation/test_credit_page.py
"""

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

import eval as ev
import grpo
from evaluation import credit_page, token_page
from training.run.directory import RunError

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
ROWS = [{"q": "Say a word.", "a": 0, "kind": "flat"}, {"q": "Say two words.", "a": 0, "kind": "varied"}]
REWARD = """import itertools

calls = itertools.count()


def score(completion, record):                 # flat: one reward for all (A = 0); varied: 0, 1, 0, 1 ...
    return 0.5 if record["kind"] == "flat" else float(next(calls) % 2)
"""
PATTERN = r"(\S+)\s*$"  # the last word: every response has an answer region


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("credit")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (d / "reward.py").write_text(REWARD)
    grpo.main(
        [
            "--model",
            "tiny-qwen3",
            "--device",
            "cpu",
            "--dataset",
            "custom",
            "--data-path",
            str(d / "train.jsonl"),
            "--question-field",
            "q",
            "--answer-field",
            "a",
            "--reward",
            f"{d / 'reward.py'}:score",
            "--answer-pattern",
            PATTERN,
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "12",
            "--steps",
            "1",
            "--rollouts-every",
            "1",
            "--warmup-steps",
            "1",
            "--device",
            "cpu",
            "--out-dir",
            str(d / "run"),
        ]
    )
    rows = [json.loads(line) for line in open(d / "run" / "rollouts" / "step_00001.jsonl")]
    assert sorted(r["adv"] == 0 for r in rows) == [False] * 4 + [True] * 4  # the two kinds of group
    return d / "run", rows


def test_the_page_of_a_run_s_step(run, tmp_path):
    path, rows = run
    ev.main(["credit", str(path)])
    out = path / "credit" / "step_00001"
    res = json.loads((out / "credit.json").read_text())
    assert res["step"] == 1 and len(res["rows"]) == 8 and (out / "credit.png").stat().st_size > 0
    for r, saved in zip(res["rows"], rows):
        assert r["boosted"] == sum(w > 1 for w in saved["weight"])
        want = "no credit" if saved["adv"] == 0 else f"{r['boosted']} of {r['tokens']} boosted"
        assert r["credit"] == want
        assert (r["boosted"] > 0) == (saved["adv"] != 0)  # flow credit where trained, only there
    assert "| no credit |" in (out / "credit.md").read_text()


class Shown(HTMLParser):
    """What the page's rows hold: per row, the side's text, the tokens' text, the answer region's text and
    the boosted tokens' text."""

    def __init__(self):
        super().__init__()
        self.rows, self.stack = [], []

    def handle_starttag(self, tag, attrs):
        cls = (dict(attrs).get("class") or "").split()
        if tag == "div" and "row" in cls:
            self.rows.append({"prompt": "prompt" in cls, "side": "", "text": "", "answer": "", "boosted": []})
        self.stack.append((tag, cls))
        if tag == "span" and "boost" in cls and self.rows:
            self.rows[-1]["boosted"].append("")

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        classes = {c for _, cls in self.stack for c in cls}
        if not self.rows or "legend" in classes or "details" in {t for t, _ in self.stack}:
            return
        row = self.rows[-1]
        if "side" in classes:
            row["side"] += data
        elif "toks" in classes:
            row["text"] += data
            row["answer"] += data if "ans" in classes else ""
            if self.stack[-1][1] and "boost" in self.stack[-1][1]:
                row["boosted"][-1] += data


def chromium(*flags, page, profile):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium: .ci/run does, where apt works)")
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            *flags,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_headless_chromium_shows_the_tokens_the_answer_and_the_boosted(run, tmp_path):
    path, rows = run
    ev.main(["credit", str(path), "--out", str(tmp_path / "page")])
    page = tmp_path / "page" / "credit.html"
    shot, parser = tmp_path / "page.png", Shown()  # one launch: the DOM and a screenshot
    parser.feed(
        chromium(
            "--dump-dom",
            "--hide-scrollbars",
            "--window-size=1200,1600",
            f"--screenshot={shot}",
            page=page,
            profile=tmp_path / "profile",
        )
    )
    shown = [r for r in parser.rows if not r["prompt"]]
    prompts = [p["side"] for p in parser.rows if p["prompt"]]
    assert prompts == ["prompt 1 (4 responses)", "prompt 2 (4 responses)"]
    assert len(shown) == len(rows) == 8
    for s, saved in zip(shown, rows):
        toks, weight = saved["tokens"], saved["weight"]
        seen = token_page.visible  # control characters as their pictures
        assert s["text"] == seen("".join(toks))  # every token
        assert s["answer"] == seen("".join(t for t, a in zip(toks, saved["answer"]) if a)) != ""  # answer
        assert s["boosted"] == [seen(t) for t, w in zip(toks, weight) if w > 1]  # the boosted ones
        assert f"reward {saved['reward']:.3g}" in s["side"]
        assert ("A = 0" in s["side"] and "no credit" in s["side"]) == (saved["adv"] == 0)
        assert saved["adv"] == 0 or f"A {saved['adv']:+.3g}" in s["side"]
    import numpy as np
    from matplotlib.image import imread

    pixels = (imread(shot)[..., :3] * 255).round()  # (H, W, 3)
    for mark in (token_page.ANSWER, token_page.BOOST):  # the answer's box, the boosted line
        rgb = np.array([int(mark[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(-1) <= 8).sum() >= 20, mark


def test_plot_draws_a_saved_response_with_the_run_s_checkpoint(run, tmp_path):
    path, rows = run
    ev.main(
        [
            "plot",
            "--run",
            str(path),
            "--device",
            "cpu",
            "--figures",
            "heatmap",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "p"),
        ]
    )
    res = json.loads((tmp_path / "p" / "plot.json").read_text())
    assert res["args"]["model"] == str(path) and res["n_responses"] == 8 and res["n_no_answer"] == 0
    page = (tmp_path / "p" / "heatmap.html").read_text()
    assert 'class="ans"' in page and "t boost" in page and "flow throughput τ" in page and "prompt" in page


@pytest.mark.parametrize(
    "argv, words",
    [
        (lambda d: ["credit", str(d / "nope")], "not a run directory"),
        (lambda d: ["credit", str(d)], "no rollouts/step_*.jsonl"),
        (lambda d: ["credit", str(d), "--step", "7"], "--step 7: not saved"),
        (lambda d: ["plot", "--run", str(d), "--responses", str(d / "x.jsonl")], "leave out --responses"),
        (lambda d: ["credit", str(d), "--groups", "-1"], "argument --groups: must be >= 0, got -1"),
        (lambda d: ["plot", "--run", str(d), "--step", "0"], "argument --step: must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, argv, words):
    if "--step" in argv(tmp_path):
        (tmp_path / "rollouts").mkdir()
        (tmp_path / "rollouts" / "step_00002.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        ev.main(argv(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("eval.py: error: ") and words in err[-1], err


def test_read_step_skips_a_line_cut_by_a_kill_and_names_a_broken_one(tmp_path, capsys):
    row = {k: [] if k in credit_page.FIELDS[4:] else "x" for k in credit_page.FIELDS}
    row.update(reward=0, adv=0)
    (tmp_path / "rollouts").mkdir()
    f = tmp_path / "rollouts" / "step_00003.jsonl"
    f.write_text(json.dumps(row) + "\n" + json.dumps(row)[:20])
    assert credit_page.read_rollouts(tmp_path) == (3, f, [row])
    assert "line 2: cut short" in capsys.readouterr().err
    f.write_text(json.dumps(row)[:20] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(RunError, match="line 1: not a JSON line"):
        credit_page.read_rollouts(tmp_path, 3)
    f.write_text(json.dumps({**row, "answer": [True]}) + "\n")
    with pytest.raises(RunError, match="lists of one length"):
        credit_page.read_rollouts(tmp_path)
    f.write_text(json.dumps({**row, "adv": None}) + "\n")
    with pytest.raises(RunError, match="reward, adv, score and weight numbers"):
        credit_page.read_rollouts(tmp_path)


def test_groups_notes_and_wrapping_by_hand():
    rows = [{"prompt": p} for p in "aabbba"]
    assert credit_page.groups(rows) == [[0, 2], [2, 5], [5, 6]]
    base = {"adv": 1.0, "answer": [0, 1], "weight": [1.0, 1.5]}
    assert credit_page.credit_note({**base, "adv": 0.0}) == "no credit"
    assert credit_page.credit_note({**base, "answer": [0, 0]}) == "no answer region: plain GRPO"
    assert credit_page.credit_note({**base, "weight": [1.0, 1.0]}) == "credit fell back: plain GRPO"
    assert credit_page.credit_note(base) == "1 of 2 boosted"
    T = token_page.Tok
    lines = token_page.wrap([T("ab"), T("cd\ne"), T("fghij")], 4)  # a newline; a token longer than a line
    assert [[(c, s) for c, s, _ in line] for line in lines] == [
        [(0, "ab"), (2, "cd")],
        [(0, "e")],
        [(0, "fghi")],
        [(0, "j")],
    ]
    assert token_page.visible("a\x10b\tc\nd\x7f") == "a\u2410b\tc\nd\u2421"  # control characters seen


def test_a_log_bar_spans_three_decades_below_the_largest():
    bar = token_page.scale([0.0, 2e-4, 0.02, 2.0, float("nan")], "tau")
    assert bar.log and bar.norm.vmin == pytest.approx(2e-3) and bar.norm.vmax == 2.0
    assert bar.color(0.0) is None and bar.color(float("nan")) is None  # tau = 0 stays white
    assert bar.color(2e-4) == bar.color(2e-3) != bar.color(2.0)  # clipped at the floor
    assert [s for _, s in token_page.ticks(bar)] == ["0.002", "0.02", "0.2", "2"]
    assert not token_page.scale([-1.0, 1.0], "x").log  # a signed score: linear
