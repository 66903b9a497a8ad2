"""eval.py deadend (evaluation/deadend.py): the twins are built as the design says, the AUC counts ties half,
raw-flow is eq. 4 on W, the verdict applies the pre-registered rules, and 4 pairs on tiny-qwen3 run through
eval.py's main into the --json schema, with the position signal at its known answer."""

import json

import numpy as np
import pytest
import torch
from scipy import stats as sps

import eval as ev
import flowtracer as ft
import grpo
from evaluation import deadend as dd
from training.model.load import load_model


def test_auc_counts_each_pair_once_and_ties_half():
    # used (3, 1) against dead-end (2, 1): 3>2 1, 3>1 1, 1<2 0, 1=1 1/2 -> 2.5 / 4
    assert dd.auc([3.0, 1.0], [2.0, 1.0]) == 0.625
    assert dd.auc([5.0], [1.0, 2.0, 3.0]) == 1.0
    assert dd.auc([1.0, 1.0], [1.0]) == 0.5  # all ties
    assert dd.auc([0.0], [1.0, 2.0]) == 0.0
    assert dd.auc([], [1.0]) is None and dd.auc([1.0], []) is None


def test_twins_differ_only_in_the_asked_line_and_are_balanced():
    rows = dd.make_twins(12, seed=3)
    assert len(rows) == 36  # per pair: two twins, one variant row
    for i in range(12):
        a, b, v = rows[3 * i : 3 * i + 3]
        assert (a.pair, b.pair, v.pair) == (i, i, i) and a.slot == b.slot == "" and v.slot == dd.SLOTS[i % 3]
        body = lambda t: t.response.rsplit("\\boxed", 1)[0]  # noqa: E731
        assert body(a) == body(b) and a.response != b.response  # only the boxed answer differs
        assert a.question.rsplit(" How many", 1)[0] == b.question.rsplit(" How many", 1)[0]
        assert (a.used, a.dead) == (b.dead, b.used)  # the roles swap at the same positions
        line = lambda t, s: t.response[s[0] : s[1]]  # noqa: E731
        digits = lambda s: {c for c in s if c.isdigit()}  # noqa: E731
        assert not digits(line(a, a.used)) & digits(line(a, a.dead))  # disjoint digits
        assert a.response.endswith(f"\\boxed{{{line(a, a.used).split('= ')[1][0]}}}.")  # the used result
        assert v.planted and not digits(line(v, v.planted))  # a line that computes nothing
        where = {"first": 0, "middle": 1, "last": 2}[v.slot]
        assert v.response.split("\n")[where] == line(v, v.planted)
    first = [rows[3 * i].used < rows[3 * i].dead for i in range(12)]
    assert sum(first) == 6  # the first twin's line comes first in half the pairs
    for slot in dd.SLOTS:  # within a slot the variant's used line is first in every other pair
        vs = [r for r in rows if r.slot == slot]
        assert [r.used < r.dead for r in vs] == [True, False] * 2


def test_raw_flow_is_eq4_on_w_without_the_h_transform():
    attn = torch.tensor(  # the notebook's 5-node DAG; x2 is a dead end
        [
            [1.0, 0, 0, 0, 0],
            [0.8, 0.2, 0, 0, 0],
            [0.3, 0.5, 0.2, 0, 0],
            [0.2, 0.6, 0.0, 0.2, 0],
            [0.1, 0.2, 0.0, 0.6, 0.1],
        ],
        dtype=torch.float64,
    )[None]
    q = torch.tensor([[True, False, False, False, False]])
    a = torch.tensor([[False, False, False, False, True]])
    v = torch.ones(1, 5, dtype=torch.bool)
    f = dd.raw_flow(attn, q, a, v)[0]
    # by hand: f0 = 1, f1 = 0.8, f2 = 0.3 + 0.5 * 0.8 = 0.7, f3 = 0.2 + 0.6 * 0.8 = 0.68,
    # f4 = 0.1 + 0.2 * 0.8 + 0.6 * 0.68 = 0.668
    assert torch.allclose(f, torch.tensor([1.0, 0.8, 0.7, 0.68, 0.668], dtype=torch.float64))
    assert f[2] > 0 and ft.trace_flow(attn[0], q[0], a[0]).flow[2] == 0  # only the h-transform drops x2


def signals(flow_auc, flow_ci, share, random_ci=(0.45, 0.55)):
    s = {
        k: {"auc": 0.5, "auc_ci": [0.45, 0.55], "share_diff": 0.0, "share_ci": [-0.1, 0.1]}
        for k in dd.SIGNAL_NAMES
    }
    s["flow"] = {
        "auc": flow_auc,
        "auc_ci": list(flow_ci),
        "share_diff": share,
        "share_ci": [share - 0.05, share + 0.05],
    }
    s["random"]["auc_ci"] = list(random_ci)
    return s


def test_the_verdict_applies_the_preregistered_rules():
    h_ok = {"flow - raw-flow": {"ci": [0.02, 0.1]}, "flow - attention": {"ci": [0.0, 0.1]}}
    h_no = {"flow - raw-flow": {"ci": [-0.01, 0.1]}, "flow - attention": {"ci": [0.0, 0.1]}}
    h_neg = {"flow - raw-flow": {"ci": [-0.2, -0.1]}, "flow - attention": {"ci": [0.0, 0.1]}}
    yes, no = "answer-targeted", "not answer-targeted at this scale: no learning claim can rest on it"
    assert dd.verdict(signals(0.60, (0.57, 0.63), 0.15), h_ok) == yes + ", and the h-transform is the cause"
    assert dd.verdict(signals(0.60, (0.57, 0.63), 0.15), h_no) == yes
    assert dd.verdict(signals(0.60, (0.57, 0.63), 0.15), h_neg) == yes  # excludes 0 below: not the cause
    assert dd.verdict(signals(0.60, (0.50, 0.70), 0.15), h_ok) == no  # the interval touches 0.5
    assert dd.verdict(signals(0.54, (0.52, 0.56), 0.15), h_ok) == no  # AUC below 0.55
    assert dd.verdict(signals(0.60, (0.57, 0.63), 0.09), h_ok) == no  # share difference below +0.10
    assert dd.verdict(signals(0.60, (0.57, 0.63), 0.15, (0.51, 0.6)), h_ok).startswith("no verdict")
    assert dd.verdict(signals(0.60, (0.57, 0.63), 0.15, (0.4, 0.49)), h_ok).startswith("no verdict")


def test_summary_intervals_are_over_pairs_from_scipy():
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(9):
        auc = {k: float(rng.uniform()) for k in dd.SIGNAL_NAMES}
        var = {"auc": dict(auc), "auc_planted": dict(auc), "share_planted": dict(auc)}
        pairs.append(dict(pair=i, slot=dd.SLOTS[i % 3], auc=auc, share_diff=dict(auc), variant=var))
    s = dd.summarize(pairs, "m", 0)
    x = [p["auc"]["flow"] for p in pairs]
    lo, hi = sps.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=sps.sem(x))
    assert s["signals"]["flow"]["auc_ci"] == pytest.approx([lo, hi])
    d = [p["auc"]["flow"] - p["auc"]["attention"] for p in pairs]
    assert s["paired"]["flow - attention"]["p_wilcoxon"] == pytest.approx(sps.wilcoxon(d).pvalue)
    assert s["variant"]["last"]["pairs"] == 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("deadend")
    argv = [
        "deadend",
        "--model",
        "tiny-qwen3",
        "--device",
        "cpu",
        "--n",
        "4",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    ev.main([*argv, "--json", str(out / "summary.json")])
    return out


def test_four_pairs_on_tiny_qwen3_write_the_json_schema(tiny_run):
    s = json.loads((tiny_run / "summary.json").read_text())
    assert list(s) == ["model", "n", "seed", "signals", "paired", "variant", "verdict"]
    assert (s["model"], s["n"], s["seed"]) == ("tiny-qwen3", 4, 0)
    assert list(s["signals"]) == list(dd.SIGNAL_NAMES)
    for v in s["signals"].values():
        assert set(v) == {"auc", "auc_ci", "share_diff", "share_ci"} and len(v["auc_ci"]) == 2
        assert 0 <= v["auc"] <= 1 and v["auc_ci"][0] <= v["auc"] <= v["auc_ci"][1]
    assert set(s["paired"]) == {"flow - attention", "flow - raw-flow"}
    assert set(s["variant"]) == set(dd.SLOTS) and s["variant"]["first"]["pairs"] == 2
    assert s["verdict"].startswith(("answer-targeted", "not answer-targeted", "no verdict"))
    full = json.loads((tiny_run / "deadend.json").read_text())
    assert full["rules"] == list(dd.RULES) and full["args"]["n"] == 4
    text = (tiny_run / "deadend.md").read_text()
    assert f"verdict: {s['verdict']}" in text and f"{s['signals']['flow']['auc']:.3f}" in text
    assert (tiny_run / "pair.png").stat().st_size > 0 and (tiny_run / "pair.html").is_file()


def test_position_gives_its_known_answer_row_by_row(tiny_run):
    """A hand-built case with a known answer, through tokenizer, batch and scoring: ranked by position, every
    used digit outranks every dead-end digit when the used line comes second (AUC 1) and none does when it
    comes first (AUC 0), so each pair of twins averages exactly 0.5; and the tokens found are the digits."""
    pairs = [json.loads(x) for x in (tiny_run / "deadend_rows.jsonl").read_text().splitlines()]
    assert [p["auc"]["position"] for p in pairs] == [0.5] * 4
    assert all(p["share_diff"]["position"] == 0.0 for p in pairs)
    model, tok = load_model("tiny-qwen3", device="cpu")
    twins = dd.make_twins(2, seed=0)
    recs = dd.score_twins(model, tok, twins, "question", grpo.Config(), 12)
    for t, r in zip(twins, recs):
        assert r["auc"]["position"] == (1.0 if t.used > t.dead else 0.0)
        digits = "".join(r["tokens"][k] for k in r["used"])
        line = t.response[t.used[0] : t.used[1]]
        assert digits == "".join(c for c in line if c.isdigit())  # the byte tokenizer: one digit a token


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--style", "countdown"], "--style countdown"),
        (["--n", "0"], "--n must be >= 1"),
        (["--json", "/"], "--json / is a directory"),
    ],
)
def test_bad_input_is_one_line(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        ev.main(
            ["deadend", "--model", "tiny-qwen3", "--device", "cpu", "--n", "1", "--out", str(tmp_path), *argv]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and words in err[-1] and err[-1].startswith("eval.py: error:")
