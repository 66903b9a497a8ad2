"""evaluation/figures.py, as `eval.py plot` reads metrics files: the peak EMA by hand and its properties, a
killed run's metrics read and a malformed line named by file and line, an unknown key one line, and two runs
of the same name kept apart. A run's credit drawn: tests/evaluation/test_credit_page.py."""

import json

import pytest
from conftest import one_error
from hypothesis import given, settings
from hypothesis import strategies as st

from evaluation import figures
from evaluation.figures import peak_ema


def test_peak_ema_hand_sequence():
    # alpha 0.5: 1 -> .5*max(3,1)+.5*1 = 2 -> .5*max(2,2)+.5*2 = 2 -> .5*max(5,2)+.5*2 = 3.5 ->
    # .5*max(0,3.5)+.5*3.5
    assert peak_ema([1, 3, 2, 5, 0], alpha=0.5) == pytest.approx([1, 2, 2, 3.5, 3.5])
    assert peak_ema([4.0], alpha=0.3) == [4.0] and peak_ema([], 0.3) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_peak_ema_is_monotone_and_below_the_running_max(xs, alpha):
    e = peak_ema(xs, alpha)
    assert all(b >= a - 1e-9 for a, b in zip(e, e[1:]))
    assert all(v <= max(xs[: i + 1]) + 1e-9 for i, v in enumerate(e))


@pytest.mark.parametrize(
    "line",
    [
        '{"step": null, "acc": 0.2}',
        '{"step": "2", "acc": 0.2}',
        '{"step": 1.5, "acc": 0.2}',
        "step 2 acc 0.2",
        "[2, 0.2]",
    ],
)
def test_eval_plot_names_the_file_and_line_of_a_malformed_metrics_line(tmp_path, eval_main, line):
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(f'{{"step": 1, "acc": 0.5}}\n{line}\n{{"step": 3, "acc": 0.7}}\n')
    one_error(eval_main("plot", "--metrics", m, "--keys", "acc", "--out", tmp_path / "o"), f"{m}, line 2")
    assert not (tmp_path / "o" / "curves.png").exists()


def test_eval_plot_keeps_two_runs_of_the_same_name_apart(tmp_path, eval_main):
    paths = []
    for d, acc in (("a", 0.25), ("b", 0.75)):
        m = tmp_path / d / "run" / "metrics.jsonl"
        m.parent.mkdir(parents=True)
        m.write_text(json.dumps({"step": 1, "acc": acc}) + "\n")
        paths.append(m)
    p = eval_main("plot", "--metrics", *paths, "--keys", "acc", "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-2000:]
    ema = json.loads((tmp_path / "o" / "plot.json").read_text())["curves"]["final_peak_ema"]
    assert sorted(ema.values()) == [0.25, 0.75]  # two curves, not one overwritten by the other


def test_eval_plot_reads_a_killed_runs_metrics_and_names_a_bad_line(tmp_path, capsys):
    import eval as ev

    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text('{"step": 1, "acc": 0.5}\n{"step": 2, "acc": 0.7}\n{"step": 3, "ac')  # a kill cut line 3
    ev.main(["plot", "--metrics", str(m), "--keys", "acc", "--out", str(tmp_path / "o")])
    res = json.loads((tmp_path / "o" / "plot.json").read_text())
    assert res["curves"]["final_peak_ema"]["run/acc"] == pytest.approx(figures.peak_ema([0.5, 0.7])[-1])
    m.write_text('{"step": 1, "acc": 0.5}\nnot json\n{"step": 3, "acc": 0.7}\n')
    with pytest.raises(SystemExit) as e:
        ev.main(["plot", "--metrics", str(m), "--keys", "acc", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "metrics.jsonl, line 2" in err and err.startswith("eval.py: error:")


def test_eval_plot_unknown_key_is_an_error(tmp_path, capsys):
    import eval as ev

    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(json.dumps({"step": 1, "acc": 0.5}) + "\n")
    with pytest.raises(SystemExit) as e:
        ev.main(["plot", "--metrics", str(m), "--keys", "nosuch", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("eval.py: error: --keys nosuch")
