"""training/decode/rollout.py's generate on plain batches of the tiny models: greedy rows against a manual
loop with padding and chunks, the EOS cut and its flag, seeded sampling in groups (top-k 1 is greedy), and bad
input refused. Shared-prefix rollouts against HF generate: tests/decode/test_rollout.py."""

import pytest
import torch
from conftest import greedy_loop

import grpo
from training.decode import rollout
from training.decode.rollout import Sampling, generate
from training.model.load import load_model

PROMPTS = ["hello there", "2+2=", "a somewhat longer prompt, to force left padding"]


RUN = Sampling.of(grpo.Config())  # grpo.py's rollouts: App. C.3's temperature, top-p, top-k


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


# ----------------------------------------------------------------------------- generate
def test_greedy_equals_manual_loop_with_padding_and_chunks(tiny):
    model, tok = tiny
    eos = set(rollout.eos_ids(model, tok))
    # 6 rows, chunks 4 + 2
    g = generate(model, tok, PROMPTS, 2, Sampling(12, greedy=True), chunk_size=4)
    assert len(g.response_ids) == 6
    for j in range(6):
        ref = greedy_loop(model, tok, PROMPTS[j // 2], 12, eos)  # alone: no padding, no cache
        assert g.response_ids[j] == ref
        assert g.prompt_ids[j] == tok(PROMPTS[j // 2]).input_ids
        assert g.truncated[j] == (ref[-1] not in eos)
        assert g.texts[j] == tok.decode(ref, skip_special_tokens=True)


def test_eos_cut_and_flag(tiny):
    model, tok = tiny
    free = generate(model, tok, PROMPTS[:2], 1, Sampling(10, greedy=True))
    stop = free.response_ids[0][3]  # declare the 4th greedy token of row 0 an EOS
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [stop]
    try:
        g = generate(model, tok, PROMPTS[:2], 1, Sampling(10, greedy=True))
    finally:
        model.generation_config.eos_token_id = old
    for j in range(2):
        resp = free.response_ids[j]
        cut = resp.index(stop) + 1 if stop in resp else None
        assert g.response_ids[j] == resp[:cut]  # includes the EOS, nothing after it
        assert g.truncated[j] == (cut is None and resp[-1] != tok.eos_token_id)
    assert g.response_ids[0][-1] == stop and not g.truncated[0]


def test_sampling_seeded_grouped_and_topk1_is_greedy(tiny):
    model, tok = tiny
    run = RUN._replace(max_new_tokens=8)
    torch.manual_seed(0)
    a = generate(model, tok, PROMPTS[:2], 3, run)
    torch.manual_seed(0)
    b = generate(model, tok, PROMPTS[:2], 3, run)
    assert a == b
    torch.manual_seed(1)
    c = generate(model, tok, PROMPTS[:2], 3, run)
    assert a.response_ids != c.response_ids
    assert [p for p in a.prompt_ids] == [tok(PROMPTS[i // 3]).input_ids for i in range(6)]
    assert len(set(map(tuple, a.response_ids[:3]))) > 1  # samples within a group differ
    for r, t in zip(a.response_ids, a.truncated):
        assert 1 <= len(r) <= 8 and (len(r) == 8 if t else r[-1] in rollout.eos_ids(model, tok))
    greedy = generate(model, tok, PROMPTS[:2], 1, Sampling(8, greedy=True))
    top1 = generate(model, tok, PROMPTS[:2], 1, run._replace(top_k=1))
    assert top1.response_ids == greedy.response_ids


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompts=[]),
        dict(prompts="one string"),
        dict(n=0),
        dict(sampling=RUN._replace(max_new_tokens=0)),
        dict(sampling=RUN._replace(temperature=0.0)),
        dict(chunk_size=0),
    ],
)
def test_generate_bad_input(kwargs):
    model, tok = load_model("tiny-llama", device="cpu")
    args = dict(prompts=["x"], n=1, sampling=RUN) | kwargs
    with pytest.raises(ValueError):
        generate(model, tok, **args)
