"""training/run/heldout.py: held-out greedy accuracy inside the training process, on tiny-qwen3 with a handful
of arithmetic records. tiny-qwen3 is random (its responses never hold a right \\boxed{} answer), so the reward
is replaced by a rule on the response text that some responses meet: the counts are then not all zero."""

import json

import pytest
import torch

import data
from tasks.answers import last_number_equal
from training.decode import rollout
from training.model.load import load_model
from training.run import heldout

STYLE, BUDGET, CHUNK = "plain", 8, 2


def even_length(text, record):  # a stand-in reward: right when the response has even length
    return float(len(text) % 2 == 0)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny-qwen3", device="cpu")


@pytest.fixture
def recs():
    return heldout.records("arithmetic", "", 5, seed=0)  # 5 records in chunks of 2: a last chunk of 1


def former(model, tok, recs, style, budget, batch, k, rc, seed):
    """learn.py's evaluation before it moved here (its `evaluate`, per-question part), the reference."""
    prompts = [data.make_prompt(r, tok, style) for r in recs]
    torch.manual_seed(seed)
    g = rollout.generate(model, tok, prompts, 1, rollout.Sampling(budget, greedy=True), chunk_size=batch)
    sampling = rollout.Sampling(budget, rc["temperature"], rc["top_p"], rc["top_k"])
    s = rollout.generate(model, tok, prompts, k, sampling, chunk_size=batch)
    res = {"greedy": [], "greedy_lenient": [], "samples": [], "samples_lenient": []}
    for i, r in enumerate(recs):
        for key, texts in (("greedy", g.texts[i : i + 1]), ("samples", s.texts[i * k : (i + 1) * k])):
            strict = [data.reward(t, r) >= 1 for t in texts]
            res[key].append(sum(strict))
            res[key + "_lenient"].append(
                sum(
                    x or (r["task"] == "math" and last_number_equal(t, r["answer"]))
                    for t, x in zip(texts, strict)
                )
            )
    return res


def test_counts_add_up_and_equal_learns_former_path(tiny, recs, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(data, "reward", even_length)
    rc = {"temperature": 0.99, "top_p": 1.0, "top_k": 100}
    ref = former(model, tok, recs, STYLE, BUDGET, CHUNK, 2, rc, seed=3)
    m = heldout.accuracy(model, tok, recs, STYLE, BUDGET, CHUNK)
    assert m["eval/total"] == 5 and m["eval/right"] == ref["greedy"]
    assert m["eval/correct"] == sum(m["eval/right"]) and 0 < m["eval/correct"] < 5  # not all, not none
    assert m["eval/accuracy"] == pytest.approx(m["eval/correct"] / 5) and 0 <= m["eval/accuracy"] <= 1
    assert m["eval/right_lenient"] == ref["greedy_lenient"]
    assert m["eval/accuracy_lenient"] == pytest.approx(sum(ref["greedy_lenient"]) / 5)
    sampling = rollout.Sampling(BUDGET, rc["temperature"], rc["top_p"], rc["top_k"])
    s = heldout.sampled(model, tok, recs, STYLE, sampling, CHUNK, 2, seed=3)
    assert s == {"samples": ref["samples"], "samples_lenient": ref["samples_lenient"]}
    assert all(0 <= x <= 2 for x in s["samples"]) and 0 < sum(s["samples"]) < 10


def test_the_mode_is_eval_inside_and_restored_after_and_the_rng_untouched(tiny, recs, monkeypatch):
    model, tok = tiny
    seen, real = [], rollout.generate

    def watched(m, *a, **kw):
        seen.append(m.training)
        return real(m, *a, **kw)

    monkeypatch.setattr(heldout, "generate", watched)
    for mode in (True, False):
        model.train(mode)
        rng = torch.get_rng_state()
        heldout.accuracy(model, tok, recs, STYLE, BUDGET, CHUNK)
        assert all(m.training is mode for m in model.modules())
        assert torch.equal(torch.get_rng_state(), rng)  # greedy: the training's samples are unmoved
    assert seen == [False, False]
    model.eval()


def test_records_are_the_first_of_the_test_split_for_every_seed():
    first = data.load_task("arithmetic", split="test", seed=0)[:4]
    assert (
        heldout.records("arithmetic", "", 4, seed=0) == first == heldout.records("arithmetic", "", 4, seed=7)
    )
    assert heldout.records("arithmetic", "", 4, seed=[0, 1, 2]) == first
    assert len(heldout.records("arithmetic", "arithmetic", 10**6, seed=0)) == len(
        data.load_task("arithmetic", split="test", seed=0)
    )


def test_a_held_out_question_in_training_is_refused(tmp_path):
    test = data.load_task("arithmetic", split="test", seed=0)[:3]
    train = tmp_path / "train.jsonl"
    rows = [{"question": q, "answer": "1"} for q in ("What is 1 + 1?", test[2]["question"])]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"1 held-out question\(s\) of arithmetic are training questions"):
        heldout.records("arithmetic", "", 3, seed=0, data_path=str(train))
    assert heldout.records("arithmetic", "", 2, seed=0, data_path=str(train)) == test[:2]
    with pytest.raises(ValueError, match="training questions"):  # the caller's training records
        heldout.records("arithmetic", "", 3, seed=0, train=[{"question": test[0]["question"]}])


def test_a_task_without_a_test_split_names_the_flag():
    with pytest.raises(ValueError, match="held-out split of dapo-math-17k.*--eval-dataset"):
        heldout.records("arithmetic", "dapo-math-17k", 4, seed=0)
