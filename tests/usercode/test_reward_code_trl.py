"""Your own task with TRL's reward functions (docs/your-task.md): a reward file as TRL's documentation
writes one scores as the per-row form does and trains unchanged through grpo.py and the TRL plug-in; None,
errors and TRL's other shapes of a reward function are taken as TRL takes them.

Run: python -m pytest -q tests/usercode/test_reward_code_trl.py -m "not slow"
"""

import json
import math

import pytest
import torch
from conftest import TINY_RUN

import data
import grpo
from training.usercode import reward_code

# ----------------------------------------------------------------------------- TRL's reward functions
# A reward file as TRL's documentation writes one: batched, a dataset column as a keyword (solution), the
# completions conversational when a chat template renders the prompt; it imports its neighbour.
TRL_FILE = """import re

from helpers import last_number


def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if last_number(c) == str(s) else 0.0 for c, s in zip(contents, solution)]


def format_reward(completions, **kwargs):
    return [1.0 if re.match(r"^\\S", completion[0]["content"]) else 0.0 for completion in completions]
"""
ROW_FILE = """import re

from helpers import last_number


def accuracy(completion, record):
    return 1.0 if last_number(completion) == str(record["solution"]) else 0.0


def format_ok(completion, record):
    return 1.0 if re.match(r"^\\S", completion) else 0.0
"""
HELPERS = (
    "import re\n\n\ndef last_number(text):\n    n = re.findall(r'-?\\d+', text)\n"
    "    return n[-1] if n else None\n"
)
SOLVED = [
    {"q": "What is 3 + 4?", "solution": 7},
    {"q": "What is 10 - 2?", "solution": 8},
    {"q": "What is 6 * 2?", "solution": 12},
]


def trl_task(tmp_path):
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "trl_rewards.py").write_text(TRL_FILE)
    (tmp_path / "row_rewards.py").write_text(ROW_FILE)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SOLVED))
    data_flags = [
        "--dataset",
        "custom",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--question-field",
        "q",
    ]
    trl = f"{tmp_path / 'trl_rewards.py'}:accuracy_reward,{tmp_path / 'trl_rewards.py'}:format_reward"
    row = f"{tmp_path / 'row_rewards.py'}:accuracy,{tmp_path / 'row_rewards.py'}:format_ok"
    return data_flags, trl, row


def test_trl_form_rewards_equal_the_per_row_form_on_the_same_completions(tmp_path, tok):
    """One batch call of each TRL-form function, with prompts, completions, completion_ids and the columns
    as keyword lists, gives what the per-row functions give row by row; conversational exactly when the chat
    template renders the prompt (tiny-qwen3 has one: question style), plain strings otherwise."""
    data_flags, trl, row = trl_task(tmp_path)
    recs = data.load_task("custom", "train", tmp_path / "train.jsonl", question_field="q")
    seen = {}

    def spy(prompts, completions, completion_ids, solution, level=None, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution)
        return [None] * len(completions)

    texts = ["so 7", "  8", "it is 12", "no", "x 8", "9"]
    rows = [recs[i % 3] for i in range(6)]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    for style, chat in (("question", True), ("plain", False)):
        prompt = reward_code.trl_prompt(tok, style)
        if chat:  # TRL's documented functions read completion[0]["content"]
            mine = reward_code.load(grpo.Config(reward=trl, dataset="custom"), recs[0], prompt)
            per_row = reward_code.load(grpo.Config(reward=row, dataset="custom"), recs[0], prompt)
            got = data.batch_reward(mine, texts, rows, ids)
            assert got == data.batch_reward(per_row, texts, rows, ids) == [2.0, 1.0, 2.0, 1.0, 2.0, 1.0]
        reward_code.UserReward([reward_code.Term("s.py:spy", spy, 1.0)], prompt).table(texts, rows, ids)
        assert seen["solution"] == [7, 8, 12, 7, 8, 12] and seen["ids"] == ids
        if chat:
            assert seen["prompts"][1] == [{"role": "user", "content": "What is 10 - 2?"}]
            assert seen["completions"][2] == [{"role": "assistant", "content": "it is 12"}]
        else:
            assert isinstance(seen["prompts"][1], str) and seen["completions"][2] == "it is 12"


def test_none_is_trl_s_not_scored_and_a_row_no_function_scores_gets_no_advantage(capsys):
    """A TRL-form None adds nothing to the weighted sum; a completion that every function leaves unscored
    is NaN, one warning line names it, and its advantage is 0 while its group's others are scored among
    themselves (TRL's nanmean / nanstd)."""
    some = reward_code.Term(
        "a.py:some", lambda completions, **k: [1.0 if c else None for c in completions], 2.0
    )
    always = reward_code.Term("b.py:always", lambda completions, **k: [None, 0.5, None, None], 1.0)
    got = reward_code.UserReward([some, always]).batch(["x", "", "y", ""], [{"id": str(i)} for i in range(4)])
    assert got[:3] == [2.0, 0.5, 2.0] and math.isnan(got[3])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 of 4" in err and "row '3'" in err and "advantage 0" in err
    adv, zero = grpo.compute_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0, *[float("nan")] * 4]), 4)
    assert adv[1] == 0 and adv[4:].eq(0).all() and zero.tolist() == [False, True]
    scored = torch.tensor([1.0, 0.0, 1.0])
    assert torch.allclose(adv[[0, 2, 3]], ((scored - scored.mean()) / (scored.std(unbiased=False) + 1e-6)))


@pytest.mark.parametrize(
    "fn, words",
    [
        (lambda completions, **k: 0.5, "returned 0.5 for 1 completion(s)"),
        (lambda completions, **k: [1.0, 2.0], "returned 2 value(s) for 1 completion(s)"),
        (lambda completions, **k: ["1"], "returned '1' for row 'custom/train/0' in its list"),
        (lambda completion, record: [1.0], "returned [1.0] on row 'custom/train/0': the per-row form"),
    ],
)
def test_an_error_names_the_form_it_expected_and_what_came_back(fn, words):
    rec = {"id": "custom/train/0", "question": "q"}
    with pytest.raises(reward_code.RewardError) as e:
        reward_code.UserReward([reward_code.Term("r.py:f", fn, 1.0)]).batch([""], [rec], [[]])
    assert words in str(e.value), str(e.value)
    assert ("TRL's form" if "completions" in str(fn.__code__.co_varnames) else "takes `completions`") in str(
        e.value
    )


def test_a_trl_reward_file_trains_unchanged_through_grpo_py_as_the_per_row_one(tmp_path, capsys):
    """The same seed, the same tiny model: the TRL-form file and its per-row twin give the same rewards on
    every step's completions, so the two runs are the same run (metrics, rollouts)."""
    data_flags, trl, row = trl_task(tmp_path)
    runs = {}
    for name, spec in (("trl", trl), ("row", row)):
        grpo.main(
            [
                *TINY_RUN,
                "--max-new-tokens",
                "16",
                *data_flags,
                "--reward",
                spec,
                "--steps",
                "2",
                "--rollouts-every",
                "1",
                "--out-dir",
                str(tmp_path / name),
            ]
        )
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        roll = [
            json.loads(x)
            for x in (tmp_path / name / "rollouts" / "step_00002.jsonl").read_text().splitlines()
        ]
        runs[name + "/rollouts"] = [(r["response"], r["reward"]) for r in roll]
    assert [m["reward/mean"] for m in runs["trl"]] == [m["reward/mean"] for m in runs["row"]]
    assert runs["trl/rollouts"] == runs["row/rollouts"]
    assert any(r > 0 for _, r in runs["trl/rollouts"])  # format_reward scores some


def test_a_trl_reward_file_trains_unchanged_through_the_trl_plug_in(tmp_path, capsys):
    """flowtracer_trl.py --reward with the TRL-form file and with its per-row twin: TRL logs the same reward
    for the same completions (same seed)."""
    pytest.importorskip("trl")
    import flowtracer_trl

    data_flags, trl, row = trl_task(tmp_path)
    got = {}
    for name, spec in (("trl", trl), ("row", row)):
        trainer = flowtracer_trl.main(
            [
                "--model",
                "tiny-qwen3",
                "--use-cpu",
                "--bf16",
                "false",
                *data_flags,
                "--reward",
                spec,
                "--max-steps",
                "1",
                "--num-generations",
                "4",
                "--per-device-train-batch-size",
                "8",
                "--max-completion-length",
                "8",
                "--warmup-steps",
                "0",
                "--output-dir",
                str(tmp_path / f"trl-{name}"),
            ]
        )
        got[name] = [(h["reward"], h["reward_std"]) for h in trainer.state.log_history if "reward" in h]
    assert got["trl"] == got["row"] and got["trl"][0][0] > 0


def test_trl_s_other_shapes_of_a_reward_function_are_taken_as_trl_takes_them():
    """TRL awaits an async reward function, iterates what comes back (a generator, an array) and passes its
    keywords alone to a `**kwargs` function; the columns TRL keeps out (prompt, completion) stay out, and
    its own keywords (trainer_state, ...: flowtracer_trl.py) win over a column of the same name."""
    import asyncio  # noqa: F401  (async def below)

    import numpy as np

    recs = [{"id": "a", "prompt": "p", "completions": "c", "trainer_state": 0, "n": 1}, {"id": "b", "n": 2}]
    seen = {}

    async def a(completions, n, **kw):
        return [float(x) for x in n]

    def gen(completions, **kw):
        return (len(c) for c in completions)

    def arr(completions, **kw):
        return np.array([0.5, 0.25])

    def keywords(**kw):
        seen.update(kw)
        return [None, 1.0]

    for fn, want in ((a, [1.0, 2.0]), (gen, [2.0, 3.0]), (arr, [0.5, 0.25])):
        one = reward_code.UserReward([reward_code.Term("r.py:f", fn, 1.0)])
        assert one.batch(["xy", "xyz"], recs) == want

    async def row(completion, record):
        return len(completion)

    assert reward_code.UserReward([reward_code.Term("r.py:g", row, 1.0)])("abc", recs[0]) == 3.0
    got = reward_code.UserReward([reward_code.Term("r.py:k", keywords, 1.0)]).table(
        ["x", "y"], recs, trainer_state="S"
    )
    assert got == [[None, 1.0]] and seen["trainer_state"] == "S" and seen["n"] == [1, 2]
    assert not {"prompt", "completion"} & set(seen) and seen["completions"] == ["x", "y"]
    assert seen["id"] == ["a", "b"] and seen["prompts"] == ["", ""]  # no question: plain text
    seen.clear()
    reward_code.UserReward([reward_code.Term("r.py:k", keywords, 1.0)], keys=["id", "n", "extra", "n"]).table(
        ["x", "y"], [recs[1], recs[1]]
    )  # the dataset's columns, each once
    assert seen["extra"] == [None, None] and seen["n"] == [2, 2] and "trainer_state" not in seen


def test_the_held_out_evaluation_scores_with_either_form_alike():
    """heldout.right scores a held-out batch with the run's reward in one call (data.batch_reward): TRL's
    and the per-row form agree; an unscored (NaN) response is not right."""
    from training.run import heldout

    recs = [
        {"id": "h0", "question": "q", "answer": 7, "task": "custom"},
        {"id": "h1", "question": "q", "answer": 8, "task": "custom"},
    ]
    texts = ["7", "so 7", "9", "8"]
    row = reward_code.UserReward(
        [reward_code.Term("r.py:row", lambda c, r: float(c.endswith(str(r["answer"]))), 1.0)]
    )
    trl = reward_code.UserReward(
        [
            reward_code.Term(
                "r.py:trl",
                lambda completions, answer, **k: [
                    float(c.endswith(str(a))) if c != "9" else None for c, a in zip(completions, answer)
                ],
                1.0,
            )
        ]
    )
    assert (
        heldout.right(recs, texts, 2, row, [[1]] * 4)
        == heldout.right(recs, texts, 2, trl, [[1]] * 4)
        == ([2, 1], [2, 1])
    )
