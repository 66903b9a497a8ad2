"""evaluation/'s building blocks and the probes (stats.py, regenerate.py, probes.py, recall.py, highflow.py,
harness.py): pass@k, the masked decoder, recall@K and the probes' hand cases. The peak EMA:
tests/evaluation/test_figures.py; eval.py's subcommands, run through its main: tests/test_eval_commands.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eval as ev
from evaluation import harness, highflow, probes, regenerate, stats
from evaluation import recall as recall_probe
from training.decode.rollout import Sampling, eos_ids, generate
from training.model.load import load_model


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
    ref = generate(model, tok, prompts, 1, Sampling(10, greedy=True)).response_ids
    ids = [tok(p).input_ids for p in prompts]
    assert regenerate.continue_prefixes(model, tok, ids, [10] * 3) == ref  # shared prefix "hello there"
    assert (
        regenerate.continue_prefixes(model, tok, ids, [10] * 3, groups=[0, 0, 1]) == ref
    )  # and per-group sharing
    assert regenerate.continue_prefixes(model, tok, ids, [10, 0, 4]) == [ref[0], [], ref[2][:4]]


def test_decode_with_blocked_tokens_equals_reference(tiny):
    model, tok = tiny
    a, b = tok("the cat sat on the mat").input_ids, tok("a dog, a log").input_ids
    blocked = [[1, 4, 7], [0, 2]]
    got = regenerate.continue_prefixes(model, tok, [a, b], [8, 8], blocked, groups=[0, 1])
    eos = eos_ids(model, tok)
    assert got == [
        reference_masked_greedy(model, a, blocked[0], 8, eos),
        reference_masked_greedy(model, b, blocked[1], 8, eos),
    ]
    assert got[0] != regenerate.continue_prefixes(model, tok, [a], [8])[0]  # the mask does change the output


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
            regenerate.continue_prefixes(model, tok, [ids], [4], [blocked])
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
    masked = regenerate.continue_prefixes(model, tok, [a, b], [6, 6], every)
    assert masked[0] == masked[1]  # only the last token (and its position) reaches the output
    unmasked = regenerate.continue_prefixes(model, tok, [a, b], [6, 6])
    assert unmasked[0] != unmasked[1]  # without the mask the content does matter


def test_sampling_uses_common_random_numbers(tiny):
    model, tok = tiny
    p = tok("sampling").input_ids
    same = regenerate.continue_prefixes(model, tok, [p, p, p], [12] * 3, temperature=0.7, seeds=[5, 5, 6])
    assert same[0] == same[1] and same[0] != same[2]
    assert (
        regenerate.continue_prefixes(model, tok, [p], [12], temperature=0.7, seeds=[5])[0] == same[0]
    )  # batch-indep.


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
