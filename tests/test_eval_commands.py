"""Tests for eval.py's subcommands through its main: bad input exits 2, bench on a checkpoint directory, and
every subcommand run end to end on the random tiny model."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import ONE_QUESTION_BENCH, task_data_missing

import eval as ev
import grpo
from evaluation import harness, highflow, probes
from evaluation.figures import peak_ema
from training.model.load import load_model

ROOT = Path(__file__).resolve().parents[1]
RESPONSES = [  # hand-written responses for the tiny model (it never writes a \boxed{} answer by itself)
    {
        "question": "What is 3 + 4?",
        "answer": 7,
        "response": "Step 1. 3 + 4 = 7.\nThe final answer is \\boxed{7}.",
    },
    {
        "question": "What is 6 * 2?",
        "answer": "12",
        "response": "We multiply: 6 * 2 = 12. So the answer is \\boxed{12}.",
    },
    {
        "question": "What is 9 - 5?",
        "answer": 4,
        "response": "Subtract 5 from 9 to get 3. The answer is \\boxed{3}.",
    },
    {"question": "What is 1 + 1?", "answer": 2, "response": "One plus one is two, I think."},  # no answer
]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen3", device="cpu")


# ----------------------------------------------------------------------------- bad input (in process)
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--model", "./no/such/checkpoint"],
        ["bench", "--model", "tiny-qwen3", "--device", "cpu", "--benchmarks", "gsm9k"],
        ["intervene", "--no-such-flag"],
        ["nonsense"],
        ["plot", "--metrics", "/no/such/metrics.jsonl", "--out", "/tmp/never"],
        ["answer-forms", "--forms", "haiku"],
        ["answer-forms", "--percents", "0"],
    ],
)
def test_bad_input_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ev.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bench_runs_on_a_checkpoint_directory(tiny, tmp_path):
    if why := task_data_missing("gsm8k"):  # a clone without ../shared and without the hub
        pytest.skip(why)
    model, tok = tiny
    model.save_pretrained(tmp_path / "run" / "ckpt")  # a grpo run directory holds ckpt/
    tok.save_pretrained(tmp_path / "run" / "ckpt")
    assert harness.resolve_model(str(tmp_path / "run")) == str(tmp_path / "run" / "ckpt")
    ev.main(["bench", "--model", str(tmp_path / "run"), *ONE_QUESTION_BENCH, "--out", str(tmp_path / "o")])
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["benchmarks"]["gsm8k"]["n_problems"] == 1


def test_no_answers_anywhere_is_an_empty_result(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({**r, "response": "no answer here"}) + "\n" for r in RESPONSES))
    with pytest.raises(SystemExit) as e:
        ev.main(
            [
                "intervene",
                "--model",
                "tiny-qwen3",
                "--device",
                "cpu",
                "--responses",
                str(path),
                "--out",
                str(tmp_path / "o"),
            ]
        )
    assert e.value.code == 1 and "empty result set" in capsys.readouterr().err
    s = json.loads((tmp_path / "o" / "intervene.json").read_text())["summary"]
    assert (s["n_responses"], s["n_no_answer"], s["n"]) == (4, 4, 0)  # counted, not skipped in silence
    assert s["all"]["n"] == 4 and s["all"]["original_accuracy"] == 0.0  # the paper's rule: all incorrect


# ----------------------------------------------------------------------------- every subcommand, end to end
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Every subcommand's run on the tiny model, `python eval.py <name> ...` as eval.py's main in this
    process (a subprocess each cost more to start than to run; eval.py from the shell: test_help.py,
    test_eval_cli.py), run when its test first asks. Returns run(name) -> the run's output directory; a
    run that exits non-zero or raises fails its test."""
    d = tmp_path_factory.mktemp("smoke")
    resp, metrics = d / "responses.jsonl", d / "run" / "metrics.jsonl"
    resp.write_text("".join(json.dumps(r) + "\n" for r in RESPONSES))
    metrics.parent.mkdir()
    metrics.write_text(
        "".join(
            json.dumps({"step": i + 1, "acc": a, "reward/mean": a}) + "\n"
            for i, a in enumerate([0.1, 0.4, 0.2])
        )
    )
    tiny = ["--model", "tiny-qwen3", "--device", "cpu", "--threads", "1"]
    argv = {
        "bench": [
            "bench",
            *tiny,
            "--benchmarks",
            "gsm8k",
            "countdown",
            "--n-problems",
            "2",
            "--n",
            "2",
            "--max-new-tokens",
            "6",
        ],
        "intervene": ["intervene", *tiny, "--responses", str(resp), "--max-new-tokens", "80"],
        "recall": [
            "recall",
            *tiny,
            "--responses",
            str(resp),
            "--max-new-tokens",
            "60",
            "--max-positions",
            "6",
            "--signals",
            "flow",
            "entropy",
            "random",
        ],
        "plot": [
            "plot",
            *tiny,
            "--responses",
            str(resp),
            "--metrics",
            str(metrics),
            "--figures",
            "heatmap",
            "inout",
            "tokens",
            "curves",
        ],
        "answer-forms": ["answer-forms", *tiny, "--responses", str(resp)],
    }
    if task_data_missing("gsm8k"):  # test_bench_end_to_end skips: never run
        del argv["bench"]
    threads, cwd = torch.get_num_threads(), os.getcwd()

    def run(name):
        if not (d / name).exists():
            os.chdir(ROOT)  # where the subprocesses ran
            try:
                ev.main([*argv[name], "--out", str(d / name)])
            except SystemExit as e:
                assert e.code in (0, None), f"eval.py {name}: exit {e.code}"
            finally:
                os.chdir(cwd)
                torch.set_num_threads(threads)  # --threads 1
        return d / name

    return run


def test_bench_end_to_end(smoke):
    if why := task_data_missing("gsm8k"):  # a clone without ../shared and without the hub
        pytest.skip(why)
    out = smoke("bench")
    res = json.loads((out / "bench.json").read_text())["benchmarks"]
    for b in ("gsm8k", "countdown"):
        r = res[b]
        assert {"pass@1", "pass@2", "greedy"} <= set(r) and r["n_problems"] == 2
        # garbage: counted
        assert r["no_answer_samples"] == 4 and r["no_answer_greedy"] == 2 and r["pass@1"] == 0.0
    assert len((out / "bench_rows.jsonl").read_text().splitlines()) == 4
    assert "| gsm8k | 2 | 2 |" in (out / "bench.md").read_text()


def test_intervene_end_to_end(smoke):
    out = smoke("intervene")
    s = json.loads((out / "intervene.json").read_text())["summary"]
    assert (s["n_responses"], s["n_no_answer"], s["n"]) == (4, 1, 3)
    rows = [json.loads(x) for x in (out / "intervene_rows.jsonl").read_text().splitlines()]
    for r in (r for r in rows if not r["no_answer"]):
        assert r["none"]["selected"] == [] and r["n_selected"] == math.ceil(0.2 * r["t0"])
        assert all(
            len(r[c]["selected"]) == r["n_selected"] and max(r[c]["selected"]) < r["t0"]
            for c in ("high", "low", "random")
        )
    # the random model cannot re-derive an answer: every regeneration loses it, and both correct ones flip
    assert all(s[c]["answer_change"] == 1.0 and s[c]["correct_to_wrong"] == 2 for c in probes.CONDITIONS)
    # the paper's denominator: all 4, the no-answer one incorrect and unchanged (no answer before or after)
    a = s["all"]
    assert (a["n"], s["n_empty"]) == (4, 0) and all(a[c]["answer_change"] == 0.75 for c in probes.CONDITIONS)
    no = next(r for r in rows if r["no_answer"])
    assert no["t0"] < len(RESPONSES[3]["response"]) and no["n_selected"] == math.ceil(0.2 * no["t0"])
    md = (out / "intervene.md").read_text()
    assert "High-flow (Top 20%)" in md and "failed extraction counted as incorrect" in md


def test_recall_end_to_end(smoke):
    out = smoke("recall")
    s = json.loads((out / "recall.json").read_text())["summary"]
    assert s["n_responses"] == 2 and s["n_positions"] == 12 and s["ks"] == list(range(10, 101, 10))
    assert (s["n_pool"], s["pool_correct"], s["pool_no_answer"]) == (4, 2, 1)  # wrong and no-answer: reported
    assert set(s["recall"]) == {"flow", "entropy", "random"} and s["n_causal"] > 0
    assert all(len(v) == 10 and v[-1] == 1.0 and v == sorted(v) for v in s["recall"].values())
    assert (out / "recall.png").stat().st_size > 0


def test_answer_forms_end_to_end(smoke):
    out = smoke("answer-forms")
    s = json.loads((out / "answer-forms.json").read_text())["summary"]
    assert (s["n_responses"], s["n_no_answer"], s["n"]) == (4, 1, 3)
    assert s["percents"] == [20, 40, 60, 80, 100]
    assert set(s["overlap"]) == {"full-line", "with-explanation", "multiple-choice"}
    assert all(v[-1] == 1.0 and all(0 <= x <= 1 for x in v) for v in s["overlap"].values())  # top-100%: all
    rows = [json.loads(x) for x in (out / "answer-forms_rows.jsonl").read_text().splitlines()]
    r = next(r for r in rows if not r["no_answer"])
    assert r["answers"]["answer-only"].startswith("7}") and r["answers"]["multiple-choice"].startswith("B}")
    assert r["answers"]["full-line"].startswith("The final answer is 7.}")
    assert "| full-line |" in (out / "answer-forms.md").read_text()
    f = s["formats"]  # RESPONSES: 3 boxed (2 right), 1 without an answer
    assert (f["boxed"]["n"], f["boxed"]["accuracy"]) == (3, 2 / 3)
    assert (f["fallback"]["n"], f["fallback"]["accuracy"]) == (1, 0)
    assert (
        f["boxed"]["overlap"] == s["overlap"]
        and f["tags"]["n"] == 0
        and "| fallback | 1 |" in (out / "answer-forms.md").read_text()
    )


def test_answer_format_and_its_table_by_hand():
    assert [
        highflow.answer_format(t)
        for t in (
            "so \\boxed{12}.",
            "<answer>7</answer>",
            "\\boxed{(B)}",
            "<answer> c </answer>",
            "no answer",
            "\\boxed{}",
        )
    ] == ["boxed", "tags", "choice", "choice", "fallback", "fallback"]
    out = [
        dict(no_answer=False, k0=4, reward=1.0, format="boxed", overlap={"full-line": [1.0, 0.5]}),
        dict(no_answer=False, k0=6, reward=0.0, format="boxed", overlap={"full-line": [0.0, 1.0]}),
        dict(no_answer=False, k0=2, reward=1.0, format="tags", overlap={"full-line": [1.0, 1.0]}),
        dict(no_answer=True, reward=0.0, format="fallback"),
    ]
    s = highflow.summarize(out, ["full-line"], [20, 40])
    assert s["formats"]["boxed"] == dict(n=2, accuracy=0.5, overlap={"full-line": [0.5, 0.75]})
    assert s["formats"]["tags"] == dict(n=1, accuracy=1.0, overlap={"full-line": [1.0, 1.0]})
    assert s["formats"]["choice"]["n"] == 0 and s["formats"]["fallback"]["accuracy"] == 0.0
    assert s["overlap"] == {"full-line": [2 / 3, 2.5 / 3]}
    assert highflow.format_rows(s) == [
        ["boxed", 2, 0.5, "full-line", 0.5, 0.75],
        ["tags", 1, 1.0, "full-line", 1.0, 1.0],
        ["choice", 0, None, "-", None, None],
        ["fallback", 1, 0.0, "-", None, None],
    ]


def test_plot_end_to_end(smoke):
    out = smoke("plot")
    for f in ("heatmap.png", "heatmap.html", "inout.png", "inout.html", "tokens.png", "curves.png"):
        assert (out / f).stat().st_size > 0, f
    res = json.loads((out / "plot.json").read_text())
    assert res["n_no_answer"] == 1 and res["tokens"]["high"] and res["tokens"]["low"]
    io = res["inout"]  # Theorem 3.1: a response token passes on all the flow it receives
    assert io["inflow_total"] > 0 and io["inflow_total"] == pytest.approx(io["outflow_total"], rel=1e-6)
    assert res["curves"]["final_peak_ema"]["run/acc"] == pytest.approx(peak_ema([0.1, 0.4, 0.2])[-1])
    assert "<span" in (out / "heatmap.html").read_text()


def test_recall_scores_oar_against_the_chosen_outcomes(tmp_path, device):
    """--oar-outcomes (OAR Fig. 5b): AS-Mean by default (one row, "oar-p"); several give one row per outcome,
    each the oar-p signal of that outcome on the same responses. On each device, in fp32 on both sides
    (eval.py defaults to bf16 on CUDA, where the same signal from a fp32 model differs in 46 of 47 values):
    the same model, code and kernels, so the values agree to 1e-6, a few roundings of scores below 1."""
    from training.credit import scoring

    assert ev.parse(["recall"]).oar_outcomes == ["as-mean"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RESPONSES))
    ev.main(
        [
            "recall",
            "--model",
            "tiny-qwen3",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--responses",
            str(path),
            "--max-new-tokens",
            "40",
            "--max-positions",
            "2",
            "--signals",
            "oar-p",
            "random",
            "--oar-outcomes",
            "as-mean",
            "lt-logits",
            "--out",
            str(tmp_path / "o"),
            "--device",
            device.type,
            "--dtype",
            "float32",
        ]
    )
    s = json.loads((tmp_path / "o" / "recall.json").read_text())["summary"]
    assert set(s["recall"]) == {"oar-p:as-mean", "oar-p:lt-logits", "random"}
    out = [json.loads(x) for x in (tmp_path / "o" / "recall_rows.jsonl").read_text().splitlines()]
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    rows = [
        r
        for r in probes.load_responses(path, tok, harness.auto_style("tiny-qwen3", "math", "auto"))
        if r["reward"] == 1.0
    ]
    batch = probes.regions(tok, rows)
    for o in ("as-mean", "lt-logits"):
        cfg = grpo.Config(layers="middle", seed=0, oar_outcome=o)
        sc = scoring.SIGNALS["oar-p"](model, batch, cfg)[:, batch.prompt_width :]  # (B, R)
        for b, row in enumerate(out):
            assert row["scores"][f"oar-p:{o}"] == pytest.approx(sc[b, : row["end"]].tolist(), abs=1e-6)
    assert out[0]["scores"]["oar-p:as-mean"] != out[0]["scores"]["oar-p:lt-logits"]
