"""training/credit/baselines.py: the token classes (structural and semantic tokens, on the byte tokenizer) and
baselines.assign end to end (signal, class and shaping)."""

import pytest
import torch
from conftest import cfg, real_batch

from training.credit import baselines, scoring
from training.model.load import load_model


# ----------------------------------------------------------------------------- token classes
@pytest.mark.parametrize(
    "text,structural",
    [
        ("\n", True),
        (" ", True),
        (".", True),
        (", ", True),
        ("=", True),
        (" +", True),
        ("(", True),
        ("\\", True),
        ("$", True),
        ("}", True),
        ("×", True),
        ("the", False),
        (" x", False),
        ("12", False),
        ("\\frac", False),
        ("\ufffd", False),
        ("a.", False),
    ],
)
def test_is_structural(text, structural):
    assert baselines.is_structural(text) is structural


# ----------------------------------------------------------------------------- on the tiny models, assign
@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


def test_token_class_mask_on_the_byte_tokenizer(tiny):
    _, tok = tiny
    ids = torch.tensor([[ord("."), ord("a"), ord("7"), ord("\n"), tok.eos_token_id, 200]])
    assert baselines.token_class_mask(tok, ids, "structural").tolist() == [
        [True, False, False, True, True, False]
    ]
    assert baselines.token_class_mask(tok, ids, "semantic").tolist() == [
        [False, True, True, False, False, True]
    ]
    assert (
        baselines.token_class_mask(tok, ids, None) is None
        and baselines.token_class_mask(tok, ids, "") is None
    )
    with pytest.raises(ValueError, match="token_class"):
        baselines.token_class_mask(tok, ids, "digits")


def test_assign_runs_signal_class_and_shaping(tiny):
    model, tok = tiny
    b = real_batch(tok)
    adv = torch.ones(b.input_ids.shape[0])
    c = baselines.assign(model, tok, b, adv, cfg(credit="random", shaping="topk", token_class="structural"))
    P = b.prompt_width
    structural = baselines.token_class_mask(tok, b.input_ids, "structural")[:, P:]  # (B, R)
    assert c.weight.shape == c.scores.shape == b.response_mask[:, P:].shape
    boosted = c.weight == 1.5
    assert boosted.any() and (structural[boosted]).all()
    assert (c.weight[~b.response_mask[:, P:]] == 0).all()  # 0 on padding
    with pytest.raises(ValueError, match="oar_sigma"):
        scoring.SIGNALS["oar-g"](model, b, cfg(oar_sigma=0.0))
