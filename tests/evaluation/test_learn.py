"""learn.py (`python eval.py learn`): the grid end to end on tiny-qwen3 (one grpo.py process per arm-seed),
resuming without redoing, its evaluations equal to those of runs stopped and restarted at each evaluation
step, the statistics against hand computations, and a bad grid as one line. tiny-qwen3 is random: its
rewards are 0, so the grid tests check the mechanics, not learning."""

import json
import math

import numpy as np
import pytest

import data
import grpo
from evaluation import learn, stats
from evaluation.stats import paired_bootstrap, sign_test, t_interval
from tasks.answers import last_number_equal
from training.memory import budget
from training.model.load import load_model
from training.run import heldout

RECIPE = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--dataset",
    "arithmetic",
    "--steps",
    "2",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
]


def grid_args(out, seeds="1"):
    return [
        "--arms",
        "none,flow",
        "--seeds",
        seeds,
        "--eval-size",
        "4",
        "--eval-k",
        "2",
        "--eval-every",
        "2",
        "--bootstrap",
        "200",
        "--out-dir",
        str(out),
        "--",
        *RECIPE,
    ]


# ----------------------------------------------------------------------------- statistics by hand
def test_t_interval_by_hand():
    m, h = t_interval([0.1, 0.2, 0.3])  # sd = 0.1, t_{0.975, 2} = 4.303 (a t table)
    assert m == pytest.approx(0.2) and h == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-4)
    m, h = t_interval([0.05, 0.15])  # sd = 0.0707, t_{0.975, 1} = 12.706
    assert m == pytest.approx(0.1) and h == pytest.approx(12.706 * math.sqrt(0.005) / math.sqrt(2), rel=1e-4)
    assert t_interval([0.4]) == (0.4, None)  # one seed: no interval


def test_seed_test_by_hand():
    # d = a - b over 3 seeds = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, t = 0.2 / (0.1 / sqrt 3) = 3.464 on 2 df
    r = stats.seed_test([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])
    assert r["diff"] == pytest.approx(0.2) and r["seeds"] == 3
    h = 4.303 * 0.1 / math.sqrt(3)  # t_{0.975, 2} = 4.303 (a t table)
    assert r["ci95"] == pytest.approx([0.2 - h, 0.2 + h], abs=1e-4)
    assert r["p_t"] == pytest.approx(0.0742, abs=5e-4)  # t table: P(|T_2| > 3.464)
    # exact sign flips of (0.1, 0.2, 0.3): only +++ and --- reach |mean| 0.2: p = 2/8, the smallest there is
    assert r["p_signflip"] == pytest.approx(2 / 8) and r["p_signflip_min"] == pytest.approx(2 / 8)
    # (0.1, -0.2, 0.3): sums over the 8 sign patterns 0.6 0 0.2 -0.4 0.4 -0.2 0 -0.6; |sum| >= 0.2: six
    assert stats.seed_test([0.1, -0.2, 0.3], [0, 0, 0])["p_signflip"] == pytest.approx(6 / 8)
    four = stats.seed_test([1, 1, 1, 1], [0, 0, 0, 0])  # four seeds can never go below 0.125
    assert four["p_signflip"] == pytest.approx(0.125) == four["p_signflip_min"] and four["p_t"] is None
    assert stats.seed_test([0.3], [0.1])["ci95"] is None  # one seed: no interval


def test_the_seed_level_interval_widens_when_seeds_disagree():
    """Same mean paired difference (+0.1) over 4 seeds x 200 questions: every seed +0.1, or seeds at +0.4,
    -0.2, +0.3, -0.1. The seed-level intervals (t, two-level bootstrap) widen; the question-level bootstrap
    (conditional on the trained models) barely moves: it cannot see seed variance."""

    def arms(per_seed):  # a right on the first 100 + 200 d_s questions, b on 100
        a = np.array([[1] * int(100 + 200 * d) + [0] * int(100 - 200 * d) for d in per_seed])
        return a, np.array([[1] * 100 + [0] * 100] * len(per_seed))

    agree, disagree = arms([0.1] * 4), arms([0.4, -0.2, 0.3, -0.1])
    width = lambda lo, hi: hi - lo  # noqa: E731
    tl = [width(*stats.two_level(*x, n_boot=2000)[1:]) for x in (agree, disagree)]
    qb = [width(*paired_bootstrap(*x, n_boot=2000)[1:3]) for x in (agree, disagree)]
    st = [stats.seed_test(x[0].mean(1), x[1].mean(1)) for x in (agree, disagree)]
    assert stats.two_level(*agree)[0] == pytest.approx(0.1) == stats.two_level(*disagree)[0]
    assert tl[1] > 4 * tl[0] and width(*st[1]["ci95"]) > 0.5 and width(*st[0]["ci95"]) == 0
    assert qb[1] < 1.5 * qb[0]


def test_two_level_equals_a_hand_rolled_loop():
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2, (3, 12)), rng.integers(0, 2, (3, 12))
    d, lo, hi = stats.two_level(a, b, n_boot=300, seed=5)
    draw, boot = np.random.default_rng(5), []
    s_idx, q_idx = draw.integers(0, 3, size=(300, 3)), draw.integers(0, 12, size=(300, 3, 12))
    for i in range(300):  # seeds with replacement, then questions within each
        boot.append(
            np.mean([np.mean([a[s][q] - b[s][q] for q in q_idx[i, j]]) for j, s in enumerate(s_idx[i])])
        )
    assert d == pytest.approx((a - b).mean()) and (lo, hi) == pytest.approx(
        tuple(np.percentile(boot, [2.5, 97.5]))
    )


def test_seeds_needed_and_variance_parts_by_hand():
    # half-width 0.05 at sd 0.1: t_16 2.120 * 0.1 / sqrt 17 = 0.0514 > 0.05; t_17 2.110 * 0.1 / sqrt 18 =
    # 0.0497
    assert stats.seeds_needed(0.1, half_width=0.05) == 18
    assert stats.seeds_needed(1.0, delta=1.0) == 10  # effect size 1, 80% power, alpha 0.05: n = 10
    assert stats.seeds_needed(1.0, delta=1e-3, cap=50) is None
    v = stats.variance_parts([0.2, 0.4], 100)  # var 0.02; binomial mean(.16, .24) / 100 = 0.002
    assert v["sd"] == pytest.approx(math.sqrt(0.02)) and v["binomial_sd"] == pytest.approx(math.sqrt(0.002))
    assert v["training_sd"] == pytest.approx(math.sqrt(0.018))
    assert (
        stats.fmt_p(0.0, 10_000) == "< 1/10000"
        and stats.fmt_p(0.0412) == "0.0412"
        and stats.fmt_p(None) == "n/a"
    )


def test_sign_test_by_hand():
    # 2 seeds x 8 questions; pairs where only a is right: 8, only b: 2, ties: 6
    a = [[1, 1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 1, 0, 0]]
    b = [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 0]]
    wins, losses, p = sign_test(a, b)
    assert (wins, losses) == (8, 2)
    assert p == pytest.approx(2 * (1 + 10 + 45) / 2**10)  # = 0.109375
    assert sign_test(b, a) == (2, 8, pytest.approx(0.109375))
    assert sign_test([1, 0], [1, 0]) == (0, 0, 1.0)  # no discordant pair
    assert sign_test([1] * 3, [0] * 3)[2] == pytest.approx(2 / 8)  # 3:0 -> 2 * (1/2)^3


def test_paired_bootstrap_equals_a_hand_rolled_loop():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 2, (3, 20)), rng.integers(0, 2, (3, 20))  # 3 seeds x 20 questions
    d, lo, hi, p = paired_bootstrap(a, b, n_boot=500, seed=7)
    draw, boot = np.random.default_rng(7), []
    for _ in range(500):  # resample questions, the same ones for every seed
        qs = draw.integers(0, 20, size=20)
        boot.append(sum(a[s][q] - b[s][q] for s in range(3) for q in qs) / 60)
    assert d == pytest.approx((a - b).sum() / 60)
    assert (lo, hi) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])))
    assert p == pytest.approx(min(1, 2 * min(sum(x <= 0 for x in boot), sum(x >= 0 for x in boot)) / 500))


def test_paired_bootstrap_small_cases():
    assert paired_bootstrap([[1, 1, 1]], [[0, 0, 0]], 100) == (1.0, 1.0, 1.0, 0.0)  # every resample +1
    # two questions, d = (1, 0): Delta* is 0, 1/2, 1 with probability 1/4, 1/2, 1/4
    d, lo, hi, p = paired_bootstrap([[1, 0]], [[0, 0]], 20_000, seed=3)
    assert (d, lo, hi) == (0.5, 0.0, 1.0) and p == pytest.approx(2 * 0.25, abs=0.02)


def test_lenient_is_the_last_number():
    assert last_number_equal("She had 3, then 12 apples.", "12")
    assert last_number_equal("1,000 minus 988 is 12.0", "12")
    assert not last_number_equal("12 then 13", "12") and not last_number_equal("no number", "5")


# ----------------------------------------------------------------------------- the grid
def run(argv, capsys):
    learn.main(argv, grpo)
    cap = capsys.readouterr()
    return cap.out + cap.err


def test_grid_end_to_end_then_resume_skips_what_is_done(tmp_path, capsys):
    out = tmp_path / "learn"
    first = run(grid_args(out), capsys)
    assert {p.name for p in out.iterdir()} >= {"learn.json", "learn.md", "learn.png", "runs", "eval", "logs"}
    res = json.loads((out / "learn.json").read_text())
    before = json.loads((out / "eval" / "step00000.json").read_text())
    for arm in ("none", "flow"):
        (r,) = res["arms"][arm]
        assert r["seed"] == 0 and r["before"] == before["acc"] and [c[0] for c in r["curve"]] == [0, 2]
        assert [s for s, _ in r["reward"]] == [1, 2]  # from the run's metrics.jsonl
        assert len(json.loads((out / "eval" / f"{arm}-s0" / "step00002.json").read_text())["greedy"]) == 4
        assert [len(r["questions"][e]["greedy"]) for e in ("0", "2")] == [
            4,
            4,
        ]  # per question, per evaluation
    assert res["summary"]["vs_none"]["flow"]["seeds"] == [0]
    for arm in ("none", "flow"):  # one grpo.py process per arm-seed; its evaluation, read back
        assert (out / "logs" / f"{arm}-s0.log").read_text().count("\n$ ") == 1
        line = learn.evaluations(out / "runs" / f"{arm}-s0" / "metrics.jsonl")[2]
        ev = json.loads((out / "eval" / f"{arm}-s0" / "step00002.json").read_text())
        assert ev["greedy"] == line["eval/right"] and ev["acc"] == line["eval/accuracy"]
        assert len(ev["samples"]) == 4 and ev["mean@k"] is not None  # mean@k: the final checkpoint
    md = (out / "learn.md").read_text()
    assert (
        "flow - none" in md and "not a test of the method" in md and (out / "learn.png").stat().st_size > 1000
    )
    assert "skipped" not in first
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.parent != out)  # runs, eval, logs
    stamp = {p: p.stat().st_mtime_ns for p in files}

    again = run(grid_args(out), capsys)  # nothing left to do
    assert all(f"{run} finished earlier: skipped" in again for run in ("none-s0", "flow-s0"))
    assert {p: p.stat().st_mtime_ns for p in files} == stamp  # no run, no evaluation redone

    killed = out / "eval" / "flow-s0" / "step00002.json"  # as if killed between training and evaluation
    killed.unlink()
    third = run(grid_args(out), capsys)
    assert "none-s0 finished earlier: skipped" in third and "flow-s0 step 2" in third
    assert killed.is_file()
    assert {p: p.stat().st_mtime_ns for p in files if p != killed} == {
        p: t for p, t in stamp.items() if p != killed
    }  # no grpo.py rerun

    with pytest.raises(SystemExit) as e:  # another recipe, same out-dir
        learn.main([*grid_args(out), "--lr", "1e-3"], grpo)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "holds a grid of another recipe" in err[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--arms", "none,foo"], "--arms foo: unknown"),
        (["--arms", ","], "--arms is empty"),
        (["--seeds", "0"], "zero seeds"),
        (["--seeds", "two"], "--seeds 'two'"),
        (["--", "--lr", "-1"], "recipe (grpo.py flags): --lr must be > 0"),
        (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3"),
        (["--", "--seed", "3"], "--seed: set by learn"),
        (["--eval-k", "-1"], "--eval-k must be >= 0"),
        (["--eval-dataset", "nope"], "--eval-dataset nope: unknown"),
        (
            ["--", "--eval-every", "3"],
            "--eval-every: set by learn per arm-seed (its --arms, --seeds, --eval-*)",
        ),
    ],
)
def test_bad_grid_is_one_line(argv, says, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        learn.main(
            [*argv, "--out-dir", str(tmp_path / "x")]
            if "--" not in argv
            else ["--out-dir", str(tmp_path / "x"), *argv],
            grpo,
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("eval.py: error: ") and says in err[0]
    assert not (tmp_path / "x").exists()  # nothing written, nothing loaded


def test_evaluation_steps_and_the_questions_are_grpos(tmp_path):
    def grid(*flags):
        return learn.Grid(*learn.parse([*flags, "--", *RECIPE, "--steps", "6"], "eval.py"), grpo)

    g = grid("--eval-size", "3", "--out-dir", str(tmp_path / "a"))
    assert g.every == 2 and g.eval_steps == [2, 4, 6]  # 0: every steps/4, rounded up
    assert g.recs == heldout.records("arithmetic", "", 3, seed=0)
    assert grid("--eval-every", "4", "--out-dir", str(tmp_path / "b")).eval_steps == [4, 6]  # and the last


def even_length(text, record):  # a stand-in reward: right when the response has even length
    return float(len(text) % 2 == 0)


def test_one_process_evaluates_as_the_restarted_runs_did(tmp_path, monkeypatch):
    """learn's former grid stopped grpo.py at each evaluation step, loaded its checkpoint, evaluated it, and
    resumed. One process evaluating the policy it trains gives the same numbers, step by step (CPU, greedy).
    The reward is even_length, so that tiny-qwen3 is trained and its held-out counts are not all zero."""
    monkeypatch.setattr(data, "reward", even_length)
    recipe = [*RECIPE, "--lr", "3e-2", "--warmup-steps", "1", "--save-optimizer"]
    grpo.main([*recipe, "--eval-every", "1", "--eval-size", "6", "--out-dir", str(tmp_path / "one")])
    got = learn.evaluations(tmp_path / "one" / "metrics.jsonl")
    recs, style = heldout.records("arithmetic", "", 6, seed=0), data.default_style("tiny-qwen3", "math")
    seg = tmp_path / "seg"
    cfg, want = budget.largest(grpo.parse_args(RECIPE)), {}  # gen_chunk 0: the CPU's
    for step in (1, 2):  # the former segments
        grpo.main(
            [*recipe, "--steps", "1", "--out-dir", str(seg)]
            if step == 1
            else ["--resume", str(seg), "--steps", "2"]
        )
        model, tok = load_model(str(seg / "ckpt"), device="cpu")
        want[step] = heldout.greedy(model, tok, recs, style, cfg.max_new_tokens, cfg.gen_chunk)
    model, tok = load_model("tiny-qwen3", device="cpu")
    base = heldout.greedy(model, tok, recs, style, cfg.max_new_tokens, cfg.gen_chunk)
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert got[step]["eval/right"] == want[step]["greedy"] and got[step]["eval/total"] == 6
        assert got[step]["eval/right_lenient"] == want[step]["greedy_lenient"]
        assert got[step]["eval/correct"] == sum(want[step]["greedy"])
    assert 0 < sum(base["greedy"]) < 6  # the stand-in reward: some right
    assert base["greedy"] != got[1]["eval/right"] != got[2]["eval/right"]  # each step: its own model


def test_eval_py_dispatches_learn(capsys):
    import eval as ev

    with pytest.raises(SystemExit) as e:
        ev.main(["learn", "--arms", "nope"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"eval.py: error: --arms nope: unknown; signals: {', '.join(learn.scoring.SIGNALS)}"
    ]
