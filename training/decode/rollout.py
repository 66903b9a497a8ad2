"""Rollouts: n sampled responses per prompt, each prompt read once (paper App. C.3's sampling).

`generate(model, tokenizer, prompts, n, sampling)` returns n responses per prompt, batched with a KV cache,
grouped: prompt i -> rows i*n .. i*n+n-1. `sampling` is one `Sampling` record: the response budget and the
App. C.3 knobs (temperature T = 0.99, top-p = 1.0, top-k = 100: grpo.Config's), built once from the run's
config (`Sampling.of(cfg)`), or `Sampling(max_new_tokens, greedy=True)` for argmax. grpo.py's rollout phase,
eval.py and learn.py's evaluations all sample through it.

How (share_prefix=True, the default):
  1. `shared_prefix`: the token prefix that all the call's prompts share (the few-shot exemplars) is
     prefilled once, into a cache of batch 1.
  2. `prefill_rows`: each chunk of rows prefills its distinct prompts' own suffixes once on top of it, laid
     out [prefix | pads | suffix] (pads masked, positions counted over real tokens), then copies each
     prompt's cache to its n rows. Neither prefill keeps more than one position's logits (logits_to_keep):
     at a 1K prompt of Qwen3's 151,936-token vocabulary the unread ones would be 0.3 GB a prompt, in bf16.
  3. `decode`: transformers' sampling loop (GenerationMixin._sample) with HF's own warpers, except that a row
     that has emitted EOS leaves the forward batch. New keys and values go into spare room (`ReservedLayer`).
     On CUDA, training/decode/engine.py decodes instead: a static cache, CUDA graphs, sampling without a host
     sync; a caller that keeps one engine.Engine for its run (generate(..., engine=...)) keeps its graphs.
Prompts become ids by `prompt_ids`: one BOS, also where a chat template wrote it (a Llama 3 template,
tokenized again with the tokenizer's special tokens, gives two); flowtracer_trl.py tokenizes with it too.

Departures from the paper's setup (numbered; load.py departure 1 covers vLLM against HF):
  1. Shared-prefix rollouts. HF generate on G copies of a prompt prefills each copy, its KV cache grows by
     concatenation (a full copy per decode step), and every row runs the forward until the last row of the
     batch stops. Here each prompt and the shared prefix are read once, the cache is preallocated, and a
     finished row stops costing a forward. The same arithmetic on the same tokens: greedy responses equal
     plain HF generate's (tested), and the sampler draws for the whole chunk from HF's warpers as HF does, so
     a seed gives HF's samples. share_prefix=False (grpo.py --no-share-prefix) is plain HF generate on the
     repeated rows: the reference the tests compare against, and a fallback.

The batch the update reads (where the question, the response and the answer are, in tokens): data.py's
build_batch.

Test: python -m pytest -q tests/decode
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from tqdm import tqdm
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from training.decode.engine import OPTIONS as ENGINE_OPTIONS
from training.decode.engine import Engine
from training.decode.engine import wanted as engine_wanted


class Generations(NamedTuple):
    prompt_ids: list  # list[list[int]], one per row, without padding; row j holds prompt j // n
    response_ids: list  # list[list[int]], generated tokens without padding, ending in EOS if one was emitted
    texts: list  # list[str], response_ids decoded with skip_special_tokens=True
    truncated: list  # list[bool], True where no EOS came within max_new_tokens


def eos_ids(model, tokenizer):
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids]) | {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


MIN_TEMPERATURE = 1e-5  # below, sampling is argmax but for logit gaps < 1e-3 (weighed e^-100), and far below
# logits / T overflows fp32 (T = 1e-300: inf, then NaN): greedy=True is argmax


class Sampling(NamedTuple):
    """How a rollout samples each response: App. C.3's knobs, built once from the run's config (`of`)."""

    max_new_tokens: int  # the response budget in tokens
    temperature: float = 1.0  # logits / T before the draw (>= MIN_TEMPERATURE; 1: as they are)
    top_p: float = 1.0  # nucleus: the smallest set of tokens of this mass (1: all)
    top_k: int = 0  # only the k most likely tokens (0: all)
    greedy: bool = False  # argmax instead of a draw (held-out evaluation): temperature, top_p, top_k unread

    @classmethod
    def of(cls, cfg):
        """The run's sampling: grpo.Config's max_new_tokens, temperature, top_p, top_k (App. C.3)."""
        return cls(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)

    @property
    def warp(self):
        """The decode engine's warp (engine.Engine.reserve): (temperature, top_k, top_p), or None: greedy."""
        return None if self.greedy else (self.temperature, self.top_k, self.top_p)


def prompt_ids(tokenizer, prompts):
    """list[list[int]]: each prompt's token ids with one BOS. The tokenizer's special tokens are added only
    when the text does not already begin with its BOS (a chat template that writes it, as Llama 3's: TRL
    tokenizes chat prompts with add_special_tokens=False); a tokenizer without a BOS adds them as usual."""
    bos = tokenizer.bos_token
    return [tokenizer(p, add_special_tokens=not (bos and p.startswith(bos))).input_ids for p in prompts]


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts,
    n,
    sampling,
    chunk_size=16,
    share_prefix=True,
    engine=None,
    done=None,
    **extra,
):
    """n responses per prompt; rows grouped (prompt i -> rows i*n .. i*n+n-1), each sampled as `sampling` says
    (a Sampling: its max_new_tokens, temperature, top_p, top_k, or greedy). Uses torch's global RNG.

    share_prefix (default, departure 1): each prompt is read once, not n times. The token prefix that all the
    prompts share (the few-shot exemplars) is prefilled once per call; each chunk of rows prefills its
    prompts' own suffixes once on top of it and copies each prompt's KV cache to its rows; `decode` then
    samples every row of the chunk from there. share_prefix=False: HF generate on the n-times-repeated,
    left-padded rows (the reference the shared path is tested against, and a fallback: also a model with
    sliding-window layers, prefix_problem).
    `extra` goes to HF generate and turns sharing off (e.g. cache_implementation="static").
    On CUDA the shared path decodes with engine.Engine instead of `decode` (static cache, CUDA graphs,
    `decode` again for the chunk and the calls after it once the engine has stopped: Engine.stop;
    sampling without a host sync; engine.py departure 1: HF's distribution, not HF's samples for a seed);
    `extra` may then hold the engine's options (engine.OPTIONS: min_new_tokens, which it honours as HF
    generate does, also from the model's generation_config; graphs, which takes the engine path on any
    device, graphs=False on the CPU; check_every; fused=False: the model step, the engine's step before its
    fused one, the tests' reference). engine: an engine.Engine(model, ...) that the caller
    keeps for its run and passes to every call: its buffers and graphs are reused while the calls fit.
    prompts: texts, tokenized by `prompt_ids` (one BOS), or their token-id lists (grpo.py tokenizes its
    prompts once, at setup). The model decodes in eval mode, then gets its mode back. With more rows than one
    chunk a progress bar counts the rows generated and their rate (tqdm, stderr, gone when the call returns).
    done: a Generations that the call appends each chunk's rows to as they finish, and returns; rows already
    in it are not generated again (a call that raised, out of memory, goes on from its last whole chunk:
    training/memory/backoff.py calls again with fewer rows a chunk). None: a new one.
    Refused with a ValueError: an empty prompt, or one without tokens; a Sampling that samples (not greedy)
    at a temperature below MIN_TEMPERATURE (logits / T would overflow), top_k < 0 or top_p outside [0, 1]."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings (or of token-id lists)")
    new = sampling.max_new_tokens
    if n < 1 or new < 1 or chunk_size < 1:
        raise ValueError(f"need n, max_new_tokens, chunk_size >= 1, got {n}, {new}, {chunk_size}")
    if not sampling.greedy and not (
        sampling.temperature >= MIN_TEMPERATURE and sampling.top_k >= 0 and 0 <= sampling.top_p <= 1
    ):
        raise ValueError(
            f"sampling needs temperature >= {MIN_TEMPERATURE}, top_k >= 0, 0 <= top_p <= 1; got "
            f"{sampling.temperature}, {sampling.top_k}, {sampling.top_p}; use greedy=True for argmax"
        )
    if engine is not None and (extra or not share_prefix):
        raise ValueError(
            "engine= decodes the shared-prefix path with the engine's own options; got "
            f"share_prefix={share_prefix}, options {sorted(extra)}"
        )
    ids = prompt_ids(tokenizer, prompts) if isinstance(prompts[0], str) else [list(p) for p in prompts]
    empty = next((j for j, (p, q) in enumerate(zip(prompts, ids)) if not p or not q), None)
    if empty is not None:
        raise ValueError(f"prompt {empty} ({prompts[empty]!r}) is empty or has no tokens")
    eos, pad = eos_ids(model, tokenizer), tokenizer.pad_token_id
    sample = (
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if sampling.greedy
        else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
        )
    )
    kw = dict(max_new_tokens=new, eos_token_id=eos, pad_token_id=pad, use_cache=True, **sample)
    warpers = None  # greedy: argmax
    if not sampling.greedy:  # HF's sampling warpers, in HF's order, each only where it acts (top_k 0: off)
        warpers = LogitsProcessorList()
        if sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
    asked = model.device.type == "cuda" or set(extra) & ENGINE_OPTIONS  # CPU: no call into engine.py
    eng = engine or (
        Engine(model, **extra) if share_prefix and asked and engine_wanted(model, extra) else None
    )
    eng = None if eng is not None and eng.off else eng  # a stopped engine: decode below
    if eng is not None:
        eng.reserve(
            min(chunk_size, len(ids) * n),
            max(map(len, ids)) - 1 + new,
            new,
            eos,
            pad,
            sampling.warp,
        )
    share = share_prefix and (not extra or eng is not None) and prefix_problem(model) is None
    out = done if done is not None else Generations([], [], [], [])  # the rows so far: appended to
    modes = [m.training for m in model.modules()]
    model.eval()  # no dropout, no checkpointing (it would drop the cache)
    try:
        room = 0 if eng is not None else new + 1  # decode's spare cache positions
        prefix = shared_prefix(model, ids, room) if share else None
        bar = tqdm(
            total=len(ids) * n,
            initial=len(out.texts),
            desc="rollout",
            unit="row",
            leave=False,
            disable=len(ids) * n <= chunk_size,
        )  # one chunk: no bar
        for c in range(len(out.texts), len(prompts) * n, chunk_size):  # the rows not yet in `done`
            rows = range(c, min(c + chunk_size, len(prompts) * n))  # row r holds prompt r // n
            if prefix is None:  # HF generate, the same ids
                inp, mask = left_pad([ids[r // n] for r in rows], pad, model.device)  # (B, T)
                cache = None
                seq = model.generate(input_ids=inp, attention_mask=mask, **kw, **extra)[:, mask.shape[1] :]
            elif eng is not None:  # each prompt once, K/V to its rows
                uniq = list(dict.fromkeys(r // n for r in rows))
                inp, mask, cache = prefill_rows(model, prefix, [ids[j] for j in uniq], pad)
                which = torch.tensor([uniq.index(r // n) for r in rows], device=inp.device)  # row -> prompt
                seq = eng.decode(inp, mask, cache, which)
                if seq is None:  # the engine stopped (Engine.stop)
                    cache.batch_select_indices(which)  # each row: its prompt's K, V
                    seq = decode(model, inp[which], mask[which], cache, new, eos, pad, warpers)
            else:
                inp, mask, cache = prefill_rows(model, prefix, [ids[r // n] for r in rows], pad)
                seq = decode(model, inp, mask, cache, new, eos, pad, warpers)
            for r, gen in zip(rows, seq.tolist()):
                stop = next((t + 1 for t, tok in enumerate(gen) if tok in eos), None)  # cut after 1st EOS
                resp = gen[:stop]  # stop None: no EOS, all max_new_tokens tokens (no padding in such a row)
                out.prompt_ids.append(ids[r // n])
                out.response_ids.append(resp)
                out.texts.append(tokenizer.decode(resp, skip_special_tokens=True))
                out.truncated.append(stop is None)
            del seq, cache  # this chunk's KV cache is gone before the next chunk's prefill
            bar.update(len(rows))
        bar.close()
    finally:
        for m, mode in zip(model.modules(), modes):  # each module's mode, as it came
            m.training = mode
    return out


def prefix_problem(model):
    """Why the rollouts of `model` (or of a model of this config) cannot read each prompt once (departure 1),
    or None: its sliding-window layers (Gemma-2, GPT-OSS; those transformers' cache gives a sliding layer). A
    row of prefill_rows is laid out [shared prefix | pads | suffix], and transformers' window counts
    columns, pads included: it would reach fewer prefix tokens than the update's rows ([pads | prompt |
    response]) read, so the rollouts would sample another distribution than the one trained. generate
    decodes such a model with HF generate; run.setup says so in one line."""
    if not any(DynamicCache(config=getattr(model, "config", model)).is_sliding):  # an empty cache: no tensor
        return None
    return "its sliding-window layers would count the pads between the shared prefix and a prompt's rest"


def left_pad(rows, pad, device):
    """(input_ids, attention_mask), both (B, T): the rows' token ids left-padded with pad, as HF generate
    takes them (what a left-padding tokenizer makes of the same ids)."""
    T = max(map(len, rows))
    inp = torch.tensor([[pad] * (T - len(r)) + list(r) for r in rows], device=device)  # (B, T)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], device=device)  # (B, T)
    return inp, mask


def decode(model, inp, mask, cache, max_new_tokens, eos, pad, warpers):
    """(B, max_new_tokens) generated ids, pad after each row's EOS: HF's sampling loop (its _sample) from a
    cache that holds all but each row's last prompt token, except that a row that has emitted EOS
    leaves the forward batch (its cache rows are dropped). The sampler still draws once for the whole chunk,
    a finished row being certain to draw pad, as in HF, so the rows still writing get HF's random numbers:
    a seed gives HF's samples. warpers None: greedy (argmax)."""
    B, dev = inp.shape[0], inp.device
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=dev)  # (B, N)
    live = torch.arange(B, device=dev)  # (b,) the rows still writing
    x, pos = inp[:, -1:], mask.sum(-1, keepdim=True) - 1  # (b, 1) last prompt token, position
    t0, ends = cache.get_seq_length(), torch.tensor(eos, device=dev)  # ends: the EOS ids
    for t in range(max_new_tokens):
        logits = (
            model(
                input_ids=x,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                cache_position=torch.arange(t0 + t, t0 + t + 1, device=dev),
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )  # (b, V) as HF: fp32 copy
        if warpers is None:
            y = logits.argmax(-1)  # (b,)
        else:
            probs = torch.zeros(B, logits.shape[-1], device=dev)  # (B, V) the whole chunk, as HF
            probs[:, pad] = 1.0  # finished rows: pad
            probs[live] = torch.softmax(warpers(x, logits), dim=-1)
            y = torch.multinomial(probs, num_samples=1).squeeze(1)[live]  # (b,)
        out[live, t] = y
        going = ~torch.isin(y, ends)  # (b,) no EOS yet
        if not going.all():  # rows that finished leave
            if not going.any():
                break
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, y, mask, pos = live[keep], y[keep], mask[keep], pos[keep]
        x, pos = y[:, None], pos + 1  # (b, 1)
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=-1)  # (b, T + t + 1)
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
        x = torch.tensor([ids[0][:L]], device=model.device)  # (1, L)
        model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)  # the cache, not logits
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
            self.buf = [
                s.new_empty((*s.shape[:-2], t + n + self.room, s.shape[-1]))
                for s in (key_states, value_states)
            ] + [None]
            if t:
                self.buf[0][..., :t, :], self.buf[1][..., :t, :] = self.keys, self.values
        self.buf[0][..., t : t + n, :], self.buf[1][..., t : t + n, :] = key_states, value_states
        self.keys, self.values = (
            self.buf[0][..., : t + n, :],
            self.buf[1][..., : t + n, :],
        )  # (B, H, t + n, d)
        self.buf[2] = self.keys  # the view handed out; other keys: re-batched
        return self.keys, self.values

    def batch_select_indices(self, indices):
        """Rows leaving (indices ascending, a subset: decode's finished rows) move up in place, so dropping
        rows never allocates a second cache: one indexed copy of the filled positions of the rows that move
        (the spare room holds nothing yet), for keys and for values (a transient the size of those rows'
        filled part, one layer at a time). Any other selection (prefill_rows' copy of each prompt to its
        rows) is DynamicLayer's, which makes new tensors that the next update re-seats."""
        keep = indices.tolist()
        if (
            self.buf is None
            or self.keys is not self.buf[2]
            or keep != sorted(set(keep))
            or keep[-1] >= self.keys.shape[0]
        ):
            return super().batch_select_indices(indices)
        t, b = self.get_seq_length(), len(keep)
        f = next((j for j, i in enumerate(keep) if i != j), b)  # rows f.. move up over rows that left
        for s in self.buf[:2] if f < b else []:
            s[f:b, :, :t] = s[indices[f:], :, :t]  # (b - f, H, t, d): the gather, then one copy
        self.buf = [self.buf[0][:b], self.buf[1][:b], None]
        self.keys, self.values = self.buf[0][..., :t, :], self.buf[1][..., :t, :]  # (b, H, t, d)
        self.buf[2] = self.keys


def prefill_rows(model, prefix, row_ids, pad):
    """(input_ids, attention_mask, cache) for a chunk of rows, each distinct prompt prefilled once on top of
    the shared prefix. A row is laid out [shared prefix (L) | pads | its own suffix]: the pads are masked and
    positions count unmasked tokens, so every token sits where it would unpadded. The cache holds all but each
    row's last prompt token, copied to each row of the prompt."""
    L, cache = prefix[0], copy.deepcopy(prefix[1])
    uniq = list(dict.fromkeys(map(tuple, row_ids)))  # distinct prompts, first-seen order
    S = max(map(len, uniq)) - L  # widest suffix, with its last token
    gap = [S - len(p) + L for p in uniq]  # pads between prefix and suffix
    mask = torch.tensor([[1] * L + [0] * g + [1] * (S - g) for g in gap], device=model.device)  # (k, L + S)
    inp = torch.tensor(
        [list(p[:L]) + [pad] * g + list(p[L:]) for g, p in zip(gap, uniq)], device=model.device
    )  # (k, L + S)
    cache.batch_select_indices(torch.zeros(len(uniq), dtype=torch.long, device=model.device))
    if S > 1:  # each suffix but its last token
        pos = mask.cumsum(-1) - 1  # (k, L + S)
        model(
            input_ids=inp[:, L:-1],
            attention_mask=mask[:, :-1],
            position_ids=pos[:, L:-1].clamp_min(0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )  # (k, 1, V), not (k, S - 1, V)
    which = torch.tensor([uniq.index(tuple(p)) for p in row_ids], device=model.device)  # row -> its prompt
    cache.batch_select_indices(which)  # each row: a copy of its prompt's
    return inp[which], mask[which], cache
