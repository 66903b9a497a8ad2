"""The learning grid says what it can (evaluation/learn_report.py, learn.py): the training reward's area over
steps 2..N as a secondary endpoint, declared in the learn.json of every grid summarized from now on and
printed "chosen after the data" for a grid saved before; the seeds each effect size needs, from the measured
spread; and the random arm, which boosts as many tokens per row as flow, at random places."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import data
import grpo
from evaluation import learn_report as lr
from evaluation.stats import seed_test, seeds_needed
from flowtracer import flow_credit, trace_flow
from training.credit import scoring, shaping
from training.model.load import load_model


def test_reward_area_is_the_mean_of_steps_2_to_n():
    assert lr.reward_area({"reward": [[1, 1.0], [2, 0.5], [3, 0.25], [5, 0.0]]}) == 0.25  # step 4 skipped
    assert math.isnan(lr.reward_area({"reward": [[1, 1.0]]}))


def run(seed, after, auc, rewards):
    return {"seed": seed, "after": after, "auc": auc, "reward": [[s + 1, r] for s, r in enumerate(rewards)]}


GRID = {  # three seeds; flow's step-2.. rewards are 0.1 below none's in seed 0, 0.2 in 1, 0 in 2
    "arms": {
        "none": [
            run(0, 0.3, 0.3, [0.1, 0.5, 0.5]),
            run(1, 0.4, 0.3, [0.1, 0.6, 0.4]),
            run(2, 0.2, 0.2, [0, 0, 0]),
        ],
        "flow": [
            run(0, 0.2, 0.2, [0.1, 0.4, 0.4]),
            run(1, 0.5, 0.4, [0.1, 0.4, 0.2]),
            run(2, 0.2, 0.2, [0, 0, 0]),
        ],
    }
}


def test_a_saved_grid_reads_chosen_after_the_data_unless_it_declared_the_endpoint():
    text = lr.saved_grid([(GRID, "old/learn.json")])
    assert "chosen after the data" in text and "declared before the data" not in text
    t = seed_test([0.4, 0.3, 0.0], [0.5, 0.5, 0.0])  # reward areas, steps 2..3
    assert t["diff"] == pytest.approx(-0.1) and f"{t['diff']:+.3f}" in text and f"{t['ci95'][0]:+.3f}" in text
    assert "declared before the data" in lr.saved_grid([({**GRID, "secondary": lr.SECONDARY}, "new")])
    pooled = lr.saved_grid(
        [(GRID, "a"), ({"arms": {"none": [run(7, 0, 0, [0, 1])], "flow": [run(7, 0, 0, [0, 1])]}}, "b")]
    )
    assert "| flow - none | 4 |" in pooled  # pooled by seed


def test_the_seeds_each_effect_needs_come_from_the_measured_sd():
    by = {(r["seed"], a): r for a, rs in GRID["arms"].items() for r in rs}
    got = lr.effect_seeds(by, "flow", [0, 1, 2])
    sd = float(np.std([-0.1, 0.1, 0.0], ddof=1))  # held-out, last step
    assert got["held-out greedy, last step"]["sd"] == pytest.approx(sd)
    assert got["held-out greedy, last step"]["seeds"] == {
        f"{e:g}": seeds_needed(sd, delta=e) for e in lr.EFFECTS
    }
    assert got["training reward, steps 2..N"]["sd"] == pytest.approx(float(np.std([-0.1, -0.2, 0.0], ddof=1)))
    assert "Seeds per arm for 80% power" in lr.seeds_markdown({"flow": got})


def test_summarize_declares_the_secondary_endpoint_and_tests_it(tmp_path):
    rng = np.random.default_rng(0)
    Q, seeds = 6, [0, 1, 2]
    runs, finals = {}, {}
    for arm, rs in GRID["arms"].items():
        for r in rs:
            right = rng.integers(0, 2, size=Q).tolist()
            row = {**r, "before": 0.1, "before_lenient": 0.1, "after_lenient": r["after"]}
            row |= {"before_mean@k": None, "before_mean@k_lenient": None, "after_mean@k": None}
            row |= {
                "after_mean@k_lenient": None,
                "curve": [[0, 0.1, 0.1, None, None], [3, r["after"]] + [0] * 3],
            }
            runs.setdefault(arm, []).append(row)
            finals[arm, r["seed"]] = {"greedy": right, "greedy_lenient": right}
    setting = {"eval_size": Q, "eval_dataset": "arithmetic", "eval_steps": [3], "recipe": [], "eval_k": 0}
    g = SimpleNamespace(recs=[{}] * Q, cfg=SimpleNamespace(bootstrap=200), setting=setting, out=tmp_path)
    g.seeds = seeds
    md = lr.summarize(g, runs, finals)
    res = json.loads((tmp_path / "learn.json").read_text())
    assert res["secondary"] == lr.SECONDARY
    assert res["summary"]["vs_none"]["flow"]["reward_area"]["diff"] == pytest.approx(-0.1)
    assert "training reward, steps 2..N (secondary, declared before the data)" in md
    assert "Seeds per arm for 80% power" in md
    assert "declared before the data" in lr.saved_grid([(res, "new/learn.json")])


def test_the_random_arm_boosts_as_many_tokens_per_row_as_flow():
    """--credit random --shaping topk (learn's random arm) is flow's gamma at random places: in every row
    ceil(top_frac n) tokens get gamma, as flow_credit gives flow, and a row without an answer gets all 1."""
    _, tok = load_model("tiny-qwen3", device="cpu")
    responses = ["So 3 + 4 = 7.\nThe answer is \\boxed{7}.", "I think it is \\boxed{12}.", "No answer here."]
    b = data.build_batch(tok, [tok("What is it?").input_ids] * 3, [tok(r).input_ids for r in responses])
    cfg = grpo.Config(credit="random", seed=5)
    rnd = shaping.SHAPINGS["topk"](scoring.SIGNALS["random"](None, b, cfg), b, cfg)
    tau = torch.rand(b.response_mask.shape) * b.response_mask  # any throughput on the response
    flow = flow_credit(tau, b.response_mask, cfg.top_frac, cfg.gamma)
    n = b.response_mask.sum(-1)
    for row in range(2):  # rows with an answer
        k = math.ceil(cfg.top_frac * int(n[row]))
        assert int((rnd.weight[row] > 1).sum()) == int((flow.weight[row] > 1).sum()) == k
    assert bool(rnd.fallback[2]) and (rnd.weight[2][b.response_mask[2]] == 1).all()
    T = b.input_ids.shape[1]  # flow on that row: no answer, no sink, no flow, the same all-1 fallback
    attn = torch.softmax(torch.randn(T, T).masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf), -1)
    tau2 = trace_flow(attn, b.question_mask[2], b.answer_mask[2], b.attention_mask[2]).throughput
    c = flow_credit(tau2, b.response_mask[2])
    assert bool(c.fallback) and (c.weight[b.response_mask[2]] == 1).all()
