"""Tests for eval.py and probes.py: pass@k, the peak EMA, the masked decoder, recall@K, and every subcommand
run end to end on the random tiny model (through eval.py's main)."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import task_data_missing
from hypothesis import given, settings
from hypothesis import strategies as st

import eval as ev
from evaluation import harness, highflow, probes, regenerate, stats
from evaluation import recall as recall_probe
from evaluation.figures import peak_ema
from training.models import load_model
from training.rollout import eos_ids, generate

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


@pytest.fixture(scope="module")
def tiny_eager():
    return load_model("tiny-qwen3", device="cpu", attn_implementation="eager")


# ----------------------------------------------------------------------------- pass@k and the EMA
def test_pass_at_k_hand_cases():
    assert stats.pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert stats.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert stats.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert stats.pass_at_k(5, 2, 4) == 1.0  # fewer than k wrong samples
    assert stats.pass_at_k(4, 0, 2) == 0.0 and stats.pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(ValueError):
        stats.pass_at_k(4, 5, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_binomials(nck):
    n, c, k = nck
    assert stats.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


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


# ----------------------------------------------------------------------------- the masked decoder
def reference_masked_greedy(model, ids, blocked, n, eos):
    """No cache, no padding, positions 0..T-1, a hand-built mask: later tokens never see `blocked`."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            T = len(seq)
            allow = torch.ones(T, T, dtype=torch.bool).tril()
            for j in blocked:
                allow[j + 1 :, j] = False
            mask = torch.zeros(T, T).masked_fill(~allow, torch.finfo(torch.float32).min)[None, None]
            logits = model(
                input_ids=torch.tensor([seq]), attention_mask=mask, position_ids=torch.arange(T)[None]
            ).logits
            seq.append(int(logits[0, -1].argmax()))
            if seq[-1] in eos:
                break
    return seq[len(ids) :]


def test_decode_equals_hf_greedy_generate(tiny):
    model, tok = tiny
    prompts = ["hello there", "hello there, a longer prompt to force padding", "2+2="]
    ref = generate(model, tok, prompts, max_new_tokens=10, greedy=True).response_ids
    ids = [tok(p).input_ids for p in prompts]
    assert regenerate.decode(model, tok, ids, [10] * 3) == ref  # shared prefix "hello there"
    assert regenerate.decode(model, tok, ids, [10] * 3, groups=[0, 0, 1]) == ref  # and per-group sharing
    assert regenerate.decode(model, tok, ids, [10, 0, 4]) == [ref[0], [], ref[2][:4]]


def test_decode_with_blocked_tokens_equals_reference(tiny):
    model, tok = tiny
    a, b = tok("the cat sat on the mat").input_ids, tok("a dog, a log").input_ids
    blocked = [[1, 4, 7], [0, 2]]
    got = regenerate.decode(model, tok, [a, b], [8, 8], blocked, groups=[0, 1])
    eos = eos_ids(model, tok)
    assert got == [
        reference_masked_greedy(model, a, blocked[0], 8, eos),
        reference_masked_greedy(model, b, blocked[1], 8, eos),
    ]
    assert got[0] != regenerate.decode(model, tok, [a], [8])[0]  # the mask does change the output


def test_blocked_positions_get_exactly_zero_attention(tiny_eager):
    """Capture every eager attention call of decode: no later query puts any weight on a blocked key."""
    model, tok = tiny_eager
    ids = tok("masking test: 12 + 30 = 42").input_ids
    S, seen = len(ids), []
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, i, o: seen.append(o[1]))
        for layer in model.model.layers
    ]
    try:
        for blocked in (list(range(S)), [2, 5, 9]):
            seen.clear()
            regenerate.decode(model, tok, [ids], [4], [blocked])
            for w in seen:  # (1, H, q, k): q queries, the last ones
                q, k = w.shape[-2:]
                cols = torch.arange(k - q, k)  # query columns = positions (one row)
                for j in (j for j in blocked if j < k):
                    assert (w[0, :, cols > j, j] == 0).all()
                assert torch.allclose(w.sum(-1), torch.ones(()))  # rows are still distributions
            if blocked == list(range(S)):  # everything hidden: prefix attends itself
                first = next(w for w in seen if w.shape[-2] == S)
                assert torch.equal(first[0, 0], torch.eye(S))
    finally:
        for h in hooks:
            h.remove()


def test_all_blocked_prefix_content_is_invisible(tiny):
    model, tok = tiny
    a, b = tok("xyzw 1234 ends!").input_ids, tok("abcd 9876 ends!").input_ids  # same length, same last token
    every = [list(range(len(a)))] * 2
    masked = regenerate.decode(model, tok, [a, b], [6, 6], every)
    assert masked[0] == masked[1]  # only the last token (and its position) reaches the output
    unmasked = regenerate.decode(model, tok, [a, b], [6, 6])
    assert unmasked[0] != unmasked[1]  # without the mask the content does matter


def test_sampling_uses_common_random_numbers(tiny):
    model, tok = tiny
    p = tok("sampling").input_ids
    same = regenerate.decode(model, tok, [p, p, p], [12] * 3, temperature=0.7, seeds=[5, 5, 6])
    assert same[0] == same[1] and same[0] != same[2]
    assert regenerate.decode(model, tok, [p], [12], temperature=0.7, seeds=[5])[0] == same[0]  # batch-indep.


# ----------------------------------------------------------------------------- selection, answers, recall
def test_select_hand_case():
    import random

    tau = [0.5, 0.1, 0.9, 0.1, 0.3, 0.0, 0.7, 0.2, 0.4, 0.6]
    s = probes.select(tau, 10, 0.2, random.Random(0))
    assert s["high"] == [2, 6] and s["low"] == [1, 5]  # ties (0.1, 0.1): the earlier
    assert s["none"] == [] and len(s["random"]) == 2 and set(s["random"]) <= set(range(10))
    assert probes.select(tau, 3, 0.2, random.Random(0))["high"] == [2]  # ceil(0.6) = 1, within [0, t0)


def test_changed_compares_final_answers_as_math():
    assert not probes.changed("so \\boxed{17}", "thus \\boxed{17.0}")
    assert probes.changed("so \\boxed{17}", "thus \\boxed{37}")
    assert probes.changed("so \\boxed{17}", "no answer") and not probes.changed("none", "none either")


def test_recall_at_k_hand_case():
    out = [
        dict(positions=[0, 1, 2, 3], causal=[1, 3], scores={"s": [0.1, 0.9, 0.5, 0.2], "t": [4, 3, 2, 1]}),
        dict(positions=[0, 1], causal=[0], scores={"s": [1.0, 0.0], "t": [0, 1]}),
    ]
    r = recall_probe.summarize_recall(out, ["s", "t"])
    # K=10%: top ceil(.4)=1 of response 1 = {1} (hit 1), top ceil(.2)=1 of response 2 = {0} (hit 1) -> 2/3
    # K=50%: {1, 2} -> 1 hit; {0} -> 1 hit -> 2/3.  K=60%: ceil(2.4)=3 -> {1, 2, 3} -> 2 hits; ceil(1.2)=2 ->
    # 1 -> 1
    assert r["recall"]["s"][0] == pytest.approx(2 / 3) and r["recall"]["s"][4] == pytest.approx(2 / 3)
    assert r["recall"]["s"][5] == 1.0 and r["recall"]["s"][-1] == 1.0
    # "t" ranks response 1 as 0, 1, 2, 3 and response 2 as 1, 0: K=10% -> hits {0}: 0, {1}: 0 -> 0
    assert r["recall"]["t"][0] == 0.0 and r["n_causal"] == 3 and r["causal_rate"] == pytest.approx(3 / 6)


def test_sentences_and_per_sentence_extremes():
    pieces = ["Step", " 1", ".", " 3", ".", "5", " is", " x", ".\n", "So", " \\boxed", "{", "3", "}", "!"]
    assert highflow.sentences(pieces) == [(0, 3), (3, 9), (9, 15)]  # "3.5" is no sentence end
    tau = [1, 5, 3, 9, 2, 8, 1, 4, 7, 6, 0, 2, 5, 1, 3]
    high, low = highflow.per_sentence(tau, pieces, 0.2)
    # sentence 1 (3 tokens): ceil(.6) = 1 -> high {1}, low {0}
    # sentence 2 (6 tokens): ceil(1.2) = 2 -> {3, 5}, {4, 6};  sentence 3: {9, 12}, {13, 10}
    assert high == [1, 3, 5, 9, 12] and low == [0, 4, 6, 13, 10]
    assert highflow.per_sentence([1, 2], ["a", ".\n"], 0.2) == ([1], [0])
    assert highflow.per_sentence([1], ["a"], 0.2) == ([], [])  # one token: no ranking


def test_rewrite_keeps_the_reasoning_and_replaces_the_answer(tiny):
    _, tok = tiny
    y = tok("so 6 * 7 = 42, thus \\boxed{42} done", add_special_tokens=False).input_ids + [tok.eos_token_id]
    ids, k0 = highflow.rewrite(tok, y, highflow.FORMS["full-line"])
    assert ids[:k0] == y[:k0] and ids[-1] == tok.eos_token_id
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == "so 6 * 7 = 42, thus \\boxed{The final answer is 42.} done"
    )
    assert tok.decode(ids[:k0]).endswith("\\boxed{")
    assert highflow.rewrite(tok, tok("no answer").input_ids, "{a}") is None


def test_intervene_samples_problems_at_random_with_the_seed():
    args = ev.parse(["intervene", "--task", "arithmetic", "--n-problems", "5", "--seed", "3"])
    a, b = (
        harness.records_for(args, "arithmetic", sample=True),
        harness.records_for(args, "arithmetic", sample=True),
    )
    first = harness.records_for(args, "arithmetic")
    assert [r["id"] for r in a] == [r["id"] for r in b] and len(a) == 5 == len(first)
    assert [r["id"] for r in a] != [r["id"] for r in first]  # not the first N
    args.seed = 4
    assert [r["id"] for r in harness.records_for(args, "arithmetic", sample=True)] != [r["id"] for r in a]


# ----------------------------------------------------------------------------- bad input (in process)
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--model", "./no/such/checkpoint"],
        ["bench", "--model", "tiny-qwen3", "--benchmarks", "gsm9k"],
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
    ev.main(
        [
            "bench",
            "--model",
            str(tmp_path / "run"),
            "--benchmarks",
            "gsm8k",
            "--n-problems",
            "1",
            "--n",
            "1",
            "--ks",
            "1",
            "--max-new-tokens",
            "3",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["benchmarks"]["gsm8k"]["n_problems"] == 1


def test_no_answers_anywhere_is_an_empty_result(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({**r, "response": "no answer here"}) + "\n" for r in RESPONSES))
    with pytest.raises(SystemExit) as e:
        ev.main(
            ["intervene", "--model", "tiny-qwen3", "--responses", str(path), "--out", str(tmp_path / "o")]
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
    test_odd_inputs.py), run when its test first asks. Returns run(name) -> the run's output directory; a
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
    tiny = ["--model", "tiny-qwen3", "--threads", "1"]
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
    from training import signals

    assert ev.parse(["recall"]).oar_outcomes == ["as-mean"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RESPONSES))
    ev.main(
        [
            "recall",
            "--model",
            "tiny-qwen3",
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
        cfg = probes.CreditConfig(layers="middle", seed=0, oar_outcome=o)
        sc = signals.SIGNALS["oar-p"](model, batch, cfg)[:, batch.prompt_width :]  # (B, R)
        for b, row in enumerate(out):
            assert row["scores"][f"oar-p:{o}"] == pytest.approx(sc[b, : row["end"]].tolist(), abs=1e-6)
    assert out[0]["scores"]["oar-p:as-mean"] != out[0]["scores"]["oar-p:lt-logits"]
