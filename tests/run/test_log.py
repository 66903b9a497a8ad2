"""training/run/log.py: the notice of responses without an answer region (the rule and one reply, cut short),
the curves (whole steps, a y label per panel, the run named), and a full disk while logging the metrics,
named. The phase clock: tests/run/test_log_clock.py."""

import json

import pytest
from conftest import enospc

from training.run import checkpoint as ckpt_io
from training.run import log


def test_the_notice_shows_the_rule_and_one_reply_cut_short():
    texts = ["\\boxed{3}", "So the total is 41 apples, " * 10, "x"]
    notice = log.answers_notice(2, 2, 3, "", texts)
    assert notice.startswith("step 2: 2 of 3 responses have no answer region")
    assert "the last \\boxed{...}, else <answer>...</answer>" in notice
    assert f"one reply (270 characters): {texts[1][:60]!r} [...] {texts[1][-100:]!r}" in notice  # not \boxed
    mine = log.answers_notice(1, 1, 1, r"ANSWER: (\d+)", ["the answer is 4"])
    assert r"matched against: --answer-pattern 'ANSWER: (\d+)'" in mine and "'the answer is 4'" in mine


def test_the_curves_show_whole_steps_a_y_label_per_panel_and_the_run(tmp_path):
    rows = [
        {"step": s, "reward/mean": 0.1 * s, "acc": 0.25 * s, "entropy": 1.0 / s, "len/mean": 10 + s}
        for s in (1, 2, 3)
    ]  # 3 steps: matplotlib's own ticks are 1.5, 2.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = log.plot_curves(
        tmp_path / "metrics.jsonl", tmp_path / "curves.png", "smollm2-135m", "arithmetic", "flow/topk"
    )
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert [ax.get_ylabel() for ax in fig.axes] == list(log.CURVES.values())
    assert all(label.strip() for label in log.CURVES.values())
    for ax in fig.axes:
        ticks = ax.get_xticks()
        assert ax.get_xlabel() == "step" and all(float(t).is_integer() for t in ticks), ticks
    assert all(s in fig.get_suptitle() for s in ("smollm2-135m", "arithmetic", "flow/topk"))


def test_a_full_disk_while_logging_names_the_file(tmp_path):
    class Full:
        name = str(tmp_path / "metrics.jsonl")
        write = staticmethod(enospc)

    with pytest.raises(ckpt_io.RunError, match="metrics.jsonl: no space left .* step 3"):
        log.write_metrics(Full(), {"step": 3})
