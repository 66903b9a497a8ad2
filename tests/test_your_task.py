"""Your own task (docs/your-task.md): --reward files, --dataset custom and its fields, --answer-pattern,
--chat-template-kwargs; each bad input one `grpo.py: error:` line with nothing written; a reward that fails
mid-run stops it with the last checkpoint standing; --resume refuses a reward file that changed. A reward
file in TRL's form: tests/test_your_task_trl_rewards.py.

Run: python -m pytest -q tests/test_your_task.py -m "not slow"
"""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN

import data
import grpo
from data import build_batch
from tasks import custom
from tasks.answers import find_answer_span
from training.run import log
from training.usercode import reward_code

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"q": "What is 3 + 4?", "a": 7, "level": 1},
    {"q": "What is 10 - 2?", "a": 8, "level": 2},
    {"q": "What is 6 * 2?", "a": 12, "level": 1},
]
VARIED = (
    "import zlib\n\n\ndef score(completion, record):\n"  # varies in every group: rows train
    "    return zlib.crc32((completion + record['id']).encode()) % 4 / 3\n"
)


def task_files(tmp_path, reward=VARIED, rows=ROWS):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(reward)
    return [
        "--dataset",
        "custom",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--question-field",
        "q",
        "--answer-field",
        "a",
        "--reward",
        f"{tmp_path / 'reward.py'}:score",
    ]


def fails(capsys, argv):
    """The last stderr line of grpo.main(argv), which must exit 2."""
    with pytest.raises(SystemExit) as e:
        grpo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err and err[-1].startswith("grpo.py: error: "), err
    return err[-1]


# ----------------------------------------------------------------------------- the answer region (eq. 2)
@pytest.mark.parametrize(
    "text, pattern, want",
    [
        ("so ANSWER: 12 and ANSWER: 7.", r"ANSWER: (\d+)", "7"),  # the last match, its first group
        ("so ANSWER: 12 and ANSWER: 7.", r"ANSWER: \d+", "ANSWER: 7"),  # no group: the whole match
        ("the total is 41", r"(-?\d+)\D*$", "41"),
        ("no number", r"(-?\d+)\D*$", None),
        ("a: x", r"a:(\s*)", None),  # empty content: no answer
        ("ab", r"a|(b)", "b"),  # the last match's group
        ("ba", r"a|(b)", None),  # the last match left it out
        ("\\boxed{3} then <answer>4</answer>", None, "3"),  # the default rule, unchanged
        ("<answer>4</answer>", "", "4"),
    ],
)
def test_the_answer_region_is_the_last_match_or_its_first_group(text, pattern, want):
    span = find_answer_span(text, pattern)
    assert (None if span is None else text[span[0] : span[1]]) == want


def test_the_notice_shows_the_rule_and_one_reply_cut_short():
    texts = ["\\boxed{3}", "So the total is 41 apples, " * 10, "x"]
    notice = log.answers_notice(2, 2, 3, "", texts)
    assert notice.startswith("step 2: 2 of 3 responses have no answer region")
    assert "the last \\boxed{...}, else <answer>...</answer>" in notice
    assert f"one reply (270 characters): {texts[1][:60]!r} [...] {texts[1][-100:]!r}" in notice  # not \boxed
    mine = log.answers_notice(1, 1, 1, r"ANSWER: (\d+)", ["the answer is 4"])
    assert r"matched against: --answer-pattern 'ANSWER: (\d+)'" in mine and "'the answer is 4'" in mine


def test_help_names_every_default_answer_region(capsys):
    with pytest.raises(SystemExit):
        grpo.parse_args(["--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    rule = help_[help_.index("--answer-pattern") :][:160]
    assert "\\boxed{}" in rule and "<answer>" in rule, rule


def test_build_batch_marks_the_pattern_s_tokens(tok):
    prompt = tok("What is 3 + 4?").input_ids
    resp = tok("I think ANSWER: 12, no, ANSWER: 7 for sure", add_special_tokens=False).input_ids
    boxed, mine = (
        build_batch(tok, [prompt], [resp], answer_pattern=p).answer_mask[0] for p in (None, r"ANSWER: (\d+)")
    )
    P = len(prompt)
    assert not boxed.any()  # no \boxed{}: no sink
    assert tok.decode(torch.tensor(resp)[mine[P:]]).strip() == "7"


# ----------------------------------------------------------------------------- rewards
def test_builtin_rewards_equal_the_task_rewards_on_every_shared_record(shared_data, monkeypatch):
    """data.reward (the one reward path) and the run's reward without --reward give every record of the
    offline data what its task's verifier (math_reward / choice_reward / countdown_reward, called as before:
    (completion, answer)) gives: the boxed ground truth, an empty completion, and (every 20th) a wrong box."""
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    run_reward = reward_code.load(grpo.Config(), None)
    assert run_reward is data.reward
    n = 0
    for name in data.TASKS:
        for split in data.SPLITS[name]:
            local = shared_data / data.TASKS[name].local
            if (
                not any((local / f"{split}{ext}").is_file() for ext in (".jsonl", ".parquet"))
                or data.TASKS[name].generator is not None
            ):
                continue
            for i, r in enumerate(data.load_task(name, split)):
                verify = {
                    "math": data.math_reward,
                    "choice": data.choice_reward,
                    "countdown": data.countdown_reward,
                }[r["task"]]
                wrong = ["\\boxed{\\frac{7919}{104729}}"] * (i % 20 == 0)  # math-verify: ~10 ms a call
                for text in (f"so \\boxed{{{r['answer']}}}", "", *wrong):
                    assert run_reward(text, r) == verify(text, r["answer"]), (r["id"], text)
                n += 1
    assert n > 10000  # gsm8k's 8,792 and the others


def test_weighted_rewards_sum_and_name_the_failing_function():
    terms = [
        reward_code.Term("a.py:f", lambda c, r: len(c), 0.5),
        reward_code.Term("b.py:g", lambda c, r: 1, 2.0),
    ]
    assert reward_code.UserReward(terms)("abcd", {"id": "x"}) == 0.5 * 4 + 2.0
    bad = reward_code.UserReward([reward_code.Term("b.py:g", lambda c, r: math.nan, 1.0)])
    with pytest.raises(reward_code.RewardError, match=r"b\.py:g returned nan on row 'x'"):
        bad("", {"id": "x"})
    record = {"id": "y", "cols": 1}
    reward_code.UserReward([reward_code.Term("c.py:h", lambda c, r: r.clear() or 0, 1.0)])("", record)
    assert record == {"id": "y", "cols": 1}  # the function got a copy


# ----------------------------------------------------------------------------- custom rows and fields
def test_a_custom_record_holds_every_column(tmp_path):
    task_files(tmp_path)
    recs = data.load_task("custom", "train", tmp_path / "train.jsonl", question_field="q", answer_field="a")
    assert recs[1] == {
        "id": "custom/train/1",
        "q": "What is 10 - 2?",
        "a": 8,
        "level": 2,
        "question": "What is 10 - 2?",
        "answer": 8,
        "task": "custom",
    }
    assert data.make_prompt(recs[0], None, data.default_style("tiny-qwen3", "custom")) == "What is 3 + 4?"


def test_fields_name_a_files_columns_not_a_generated_tasks(tmp_path, capsys):
    """A generated task's rows have no columns to pick: the fields leave them as they are (the fields of an
    --eval-data-path file no longer stop a run that trains on arithmetic), and given with nothing but
    generated rows to read, one notice each says they have no effect (the run goes on)."""
    plain = data.load_task("arithmetic", "test", limit=5, seed=1)
    assert (
        data.load_task("arithmetic", "test", limit=5, seed=1, question_field="q", answer_field="a") == plain
    )
    from training.config import flags

    given = {"question_field": "q", "answer_field": "a"}
    lines = flags.unused(grpo.Config(**given), given, "grpo.py")
    assert [line.split(" has no effect: ")[0] for line in lines] == ["--question-field", "--answer-field"]
    assert (
        "arithmetic's rows are generated" in lines[0]
        and "notice: --question-field" in capsys.readouterr().err
    )
    task_files(tmp_path)
    for more in (
        {"data_path": str(tmp_path / "train.jsonl")},
        {"dataset": "gsm8k"},
        {"eval_every": 2, "eval_dataset": "gsm8k"},
    ):
        assert flags.unused(grpo.Config(**given, **more), given, "grpo.py") == [], more


def test_fields_read_a_builtin_task_from_other_columns(tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    want = data.load_task("gsm8k", "test", limit=5)
    src = [json.loads(line) for line in open(shared_data / "gsm8k" / "test.jsonl")][:5]
    f = tmp_path / "renamed.jsonl"
    f.write_text("".join(json.dumps({"Q": r["question"], "worked": r["answer"]}) + "\n" for r in src))
    got = data.load_task("gsm8k", "test", f, question_field="Q", answer_field="worked")
    assert [(r["question"], r["answer"]) for r in got] == [(r["question"], r["answer"]) for r in want]


# ----------------------------------------------------------------------------- bad inputs: one line, exit 2
BAD = {
    "no file": (lambda t: ["--reward", f"{t / 'nope.py'}:score"], "no such file"),
    "no function": (lambda t: ["--reward", f"{t / 'reward.py'}:scorer"], "no function 'scorer'"),
    "raises": (
        lambda t: (t / "reward.py").write_text("def score(c, r):\n    return r['missing']\n") and [],
        "raised KeyError",
    ),
    "a string": (
        lambda t: (t / "reward.py").write_text("def score(c, r):\n    return '1'\n") and [],
        "returned '1'",
    ),
    "pattern": (lambda t: ["--answer-pattern", "(ANSWER"], "--answer-pattern '(ANSWER' does not compile"),
    "field": (
        lambda t: ["--question-field", "question2"],
        "no column 'question2' (--question-field); the row's columns: q, a, level",
    ),
    "json": (lambda t: ["--chat-template-kwargs", "{enable_thinking: false}"], "--chat-template-kwargs"),
    "weights": (lambda t: ["--reward-weights", "1,2"], "--reward-weights gives 2 weight(s)"),
    "eval": (lambda t: ["--eval-every", "1"], "--eval-data-path"),
    "no reward": (lambda t: ["--reward", ""], "--dataset custom needs"),
    "import": (lambda t: (t / "reward.py").write_text("import not_a_module\n") and [], "ModuleNotFoundError"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    argv = task_files(tmp_path)
    extra, words = BAD[case]
    line = fails(capsys, [*TINY_RUN, *argv, *extra(tmp_path), "--out-dir", str(tmp_path / "run")])
    assert words in line, line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- a run
def test_a_custom_run_trains_with_the_pattern_and_warns_once_without(tmp_path, capsys):
    """tiny-qwen3 never writes \\boxed{}: without --answer-pattern every response lacks the answer region
    and the run says so once in two steps, with the default rule and the step's first reply, cut short; with
    a pattern that every response meets, no warning and no flow fallback, and the user's function computed
    every reward (it records its calls)."""
    log = tmp_path / "calls.txt"
    argv = task_files(
        tmp_path,
        VARIED.replace(
            "def score(completion, record):\n",
            (f"def score(completion, record):\n    open({str(log)!r}, 'a').write(record['id'] + '\\n')\n"),
        ),
    )
    grpo.main(
        [*TINY_RUN, *argv, "--steps", "2", "--rollouts-every", "1", "--out-dir", str(tmp_path / "plain")]
    )
    out = capsys.readouterr().out
    assert out.count("have no answer region") == 1 and "--answer-pattern" in out
    first = json.loads(open(tmp_path / "plain" / "rollouts" / "step_00001.jsonl").readline())["response"]
    assert "step 1: 8 of 8 responses have no answer region" in out and "<answer>...</answer>" in out
    shown = repr(first) if len(first) <= 165 else f"{first[:60]!r} [...] {first[-100:]!r}"
    assert f"one reply ({len(first)} characters): {shown}" in out  # the model's own words
    assert len(log.read_text().split()) == 1 + 2 * 8  # the setup check, then each row
    grpo.main(
        [
            *TINY_RUN,
            *argv,
            "--steps",
            "1",
            "--answer-pattern",
            r"(\S+)\s*$",
            "--out-dir",
            str(tmp_path / "mine"),
        ]
    )
    assert "have no answer region" not in capsys.readouterr().out
    m = json.loads((tmp_path / "mine" / "metrics.jsonl").read_text())
    assert m["rows/trained"] > 0 and m["credit/fallback"] == 0 and m["answers/missing"] == 0
    cfg = json.loads((tmp_path / "mine" / "ckpt" / "run_config.json").read_text())
    assert cfg["reward"] == f"{tmp_path / 'reward.py'}:score" and cfg["answer_pattern"] == r"(\S+)\s*$"
    assert json.loads(cfg["reward_files"])[0]["path"] == str((tmp_path / "reward.py").resolve())


@pytest.mark.parametrize("failure", ["raise", "nan"])
def test_a_reward_that_fails_mid_run_stops_it_and_the_checkpoint_stands(tmp_path, capsys, failure):
    bad = "raise ZeroDivisionError('boom')" if failure == "raise" else "return float('nan')"
    argv = task_files(
        tmp_path,
        "CALLS = []\n\n\ndef score(completion, record):\n    CALLS.append(1)\n"
        f"    if len(CALLS) > 9:\n        {bad}\n    return len(CALLS) % 2\n",
    )
    line = fails(
        capsys, [*TINY_RUN, *argv, "--steps", "3", "--save-every", "1", "--out-dir", str(tmp_path / "r")]
    )
    assert "reward.py:score" in line and "on row 'custom/train/" in line and "checkpoint stands" in line
    assert ("ZeroDivisionError" if failure == "raise" else "returned nan") in line
    assert (tmp_path / "r" / "ckpt" / "COMPLETE").read_text().strip() == "1"
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 1


def test_resume_refuses_an_edited_reward_file_unless_given_again(tmp_path, capsys):
    argv = task_files(tmp_path)
    out = tmp_path / "run"
    grpo.main([*TINY_RUN, *argv, "--steps", "1", "--out-dir", str(out)])
    first = json.loads((out / "ckpt" / "run_config.json").read_text())["reward_files"]
    (tmp_path / "reward.py").write_text(VARIED.replace("% 4 / 3", "% 3 / 2"))
    line = fails(capsys, ["--resume", str(out), "--steps", "2"])
    assert f"{(tmp_path / 'reward.py').resolve()} changed" in line and "--reward" in line
    grpo.main(["--resume", str(out), "--steps", "2", "--reward", f"{tmp_path / 'reward.py'}:score"])
    saved = json.loads((out / "ckpt" / "run_config.json").read_text())
    assert saved["reward_files"] != first and (out / "ckpt" / "COMPLETE").read_text().strip() == "2"
    cfg = grpo.parse_args(
        ["--config", str(out / "ckpt" / "run_config.json"), "--out-dir", str(tmp_path / "b")]
    )
    assert cfg.reward == saved["reward"] and cfg.reward_files == saved["reward_files"]
    (tmp_path / "reward.py").rename(tmp_path / "moved.py")
    assert "gone" in fails(capsys, ["--resume", str(out), "--steps", "3"])


# ----------------------------------------------------------------------------- chat template kwargs
def test_chat_template_kwargs_reach_the_template_and_the_run_config(tok, tmp_path):
    template = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    try:
        rec = {"question": "Why?", "task": "custom"}
        assert data.make_prompt(rec, tok, "question") == "<user>Why?"
        assert data.make_prompt(rec, tok, "question", {"enable_thinking": False}) == "<user>Why?<no-think>"
    finally:
        tok.chat_template = template
    cfg = grpo.parse_args([*TINY_RUN, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert reward_code.template_kwargs(cfg) == {"enable_thinking": False}


def test_with_fields_refuses_countdown_and_names_the_columns():
    with pytest.raises(custom.ColumnError, match="nums and target"):
        custom.with_fields({"nums": [1], "target": 1}, "countdown", "q")
    with pytest.raises(custom.ColumnError, match=r"no column 'x' \(--answer-field\); the row's columns: p"):
        custom.with_fields({"p": 1, "s": 2}, "math500", "", "x")


def test_the_trl_plug_in_takes_the_same_task_flags(capsys):
    import flowtracer_trl
    from training.config import trl_setup

    args, _, _ = flowtracer_trl.parse_args(
        [
            "--dataset",
            "custom",
            "--data-path",
            "rows.jsonl",
            "--reward",
            "r.py:exact",
            "--answer-pattern",
            r"A: (\d+)",
        ]
    )
    assert (args.dataset, args.reward, args.answer_pattern) == ("custom", "r.py:exact", r"A: (\d+)")
    for bad, words in ((["--answer-pattern", "("], "does not compile"), (["--dataset", "custom"], "needs")):
        with pytest.raises(SystemExit):
            flowtracer_trl.parse_args(bad)
        assert words in capsys.readouterr().err.strip().splitlines()[-1]

    def exact(completion, record):
        return float(completion == record["answer"])

    fn = trl_setup.trl_reward(reward_code.Term("r.py:exact", exact, 3.0))  # TRL weighs: reward_weights
    assert fn.__name__ == "exact"
    assert fn(None, ["7", "8"], [json.dumps({"id": "a", "answer": "7"})] * 2) == [1.0, 0.0]
