"""The one-GPU decode engine: rollout.generate's shared-prefix rollouts at the speed of the GPU.

rollout.generate decodes with Engine on CUDA (shared prefix, no HF-only option: `wanted`); the CPU keeps
rollout.decode, and rollout.generate(..., graphs=False) runs the engine there, eagerly (the tests). Each
prompt is still read once (rollout.shared_prefix, then rollout.prefill_rows on the chunk's distinct prompts);
Engine.decode copies its keys and values to its G rows in static buffers, and decodes on four ideas. Why
(measured on one H100, docs/gpu.md): a step of rollout.decode kept the GPU busy a tenth of its time; the
decode was bound by the host (kernel launches, cuDNN plans, a host sync a step), then, graphed, by its
~1,900 small kernels, not by the GPU's memory, whose ceiling is reading the weights and the rows' KV cache
once a step.

  1. A static KV cache (training/decode/static_step.py): buffers of fixed shape written in place, the
     prompt's keys copied left-compacted (row r's fill slots 0 .. n_r - 1, a token's position is its slot),
     each row writing its next key at its own slot n_r: no padding mask, no key buckets, and a graph can
     hold the step.
  2. One fused step (training/decode/fused_step.py): the decoder's forward written out over a decode-only
     view of the weights (training/decode/decode_weights.py: Q, K, V merged, gate and up merged, LoRA's
     adapters as low-rank pairs; filled again at every `reserve`, so after every optimizer step), its own GQA
     attention over each row's filled length (FlexAttention where compiled, else SDPA over a length mask),
     and on CUDA compiled whole (torch.compile, fullgraph=True). A model it cannot read (decode_weights.
     supported: not Llama-like) decodes with the model's own forward over the same buffers (the model
     step), said in one line.
  3. Graph replay. On CUDA the whole step (forward, sampling, bookkeeping) is captured once per warp at the
     reserved rows as a torch.cuda.CUDAGraph (warmed up on a side stream first, which compiles it) and
     replayed: one launch a step. A chunk of fewer rows runs in the same graph, its other rows idle.
  4. Sampling without a sync (static_step.sample): top-k on the 16-bit logits, the draw on the GPU, EOS read
     by the host every `check_every` steps (16), not every step.

An Engine lives for a run: grpo.py's is made at setup (training/memory/preflight.py) and reserved once for the
run's widest prompt + max_new_tokens, so no prompt met mid-run grows it; a caller that passes one to every
rollout.generate call (engine=...) keeps its buffers, weights and graphs while the calls fit them (`reserve`);
one that needs more rows, positions or new tokens, or other EOS ids or pad, grows them (one line). Sampling
does not: each warp (greedy, or temperature / top-k / top-p) has its own graph over the same buffers, so
held-out evaluation's greedy decode shares the rollouts' engine, and preflight's trial decodes both warps, so
the run's rollouts capture nothing. `captures` counts the graphs captured (eagerly: those the step would).
Fallbacks (the run goes on; one line each, docs/gpu.md has their cost and what each one means): a model the
fused step cannot read: the model step; flex unavailable on CUDA: SDPA over the length mask; a failed compile
(in the warm-up): the step uncompiled; a failed capture: graphs off (eager steps); a failed eager warm-up:
the engine stops (rollout.decode decodes); a replay's fault, read at the call's one sync: graphs off and the
call decoded again eagerly. An out-of-memory error (cudagraph.out_of_memory) in a warm-up, a capture or the
guarded call is none of these: nothing is turned off, the error goes on to the caller, and grpo.py's back-off
(training/memory/backoff.py) halves gen_chunk, `resize`s the engine (its buffers made again at the new width)
and decodes the rows left.

Memory: the static buffers are the KV cache that training/memory/terms.py's `generation` counts for a chunk
(T = P + R), beside the prompts' prefill cache, and the decode copy of the weights, terms.decode_copy;
tests/decode/test_engine_runtime.py holds the engine's peak to them. The run's engine holds its reservation
(the widest prompt + R) through the update too (phases.py counts its buffers and copy in every phase on CUDA),
unless the plan releases it for the update (`release`: every buffer, copy and graph freed; the next call's
`reserve` makes them again and its first decode captures the graph again).
`benchmarks/decode_speed.py` prints it beside HF generate; `benchmarks/decode_ops.py` counts one step's
operators.

Departures from rollout.decode / HF generate (numbered):
  1. Same distribution, other samples. The draw is an exponential race over HF's warped distribution
     (temperature, then top-k, then top-p, HF's order and cut rule), so a seed no longer gives HF's samples;
     tests/decode/test_engine.py checks the distribution by a chi-square test instead. Greedy rows equal HF's
     (fp32, tested): the same arithmetic in another order (merged matmuls), reading masked keys as zeros.
  2. Top-k keeps exactly k tokens; HF keeps every token tied with the k-th logit.
  3. A finished row keeps its place (writing pad) until the chunk ends, attending one key (m_r = 1); rows of
     the graph beyond the chunk's are idle rows. Eagerly (the CPU) the step runs at the chunk's rows.
  4. A warp's graph is captured the first time it decodes (preflight's trial, for the run's two), and kept for
     the engine's life (above).
  5. Autocast does not enter the fused step: it computes in the weights' dtype (decode_weights.py departure
     1). The model step runs under the caller's autocast, which casts fp32 weights every replay (autocast's
     weight cache is off in a capture); bf16 weights, as the kahan scheme loads them on CUDA, need no cast.

Run: python benchmarks/decode_speed.py --model qwen3-4b-random --rounds 2   # beside HF generate, a GPU
     python benchmarks/generate_speed.py --engine --model tiny-qwen3 --shape tiny --rounds 1   # CPU, eager
     python -m pytest -q tests/decode/   # the engine, its step, its fallbacks; the rollouts
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch.nn.attention import sdpa_kernel
from transformers.cache_utils import Cache

from training.decode import cudagraph, decode_weights, fused_step
from training.decode.static_step import ALIGN, FAST, SlotLayer, attention_kernels, sample

OPTIONS = frozenset({"min_new_tokens", "graphs", "check_every", "fused"})  # options rollout.generate passes


def supports(model):
    """Whether the engine can decode this model: full attention in every layer (no sliding window)."""
    types = getattr(model.config, "layer_types", None)
    if types:
        return set(types) == {"full_attention"}
    return getattr(model.config, "sliding_window", None) is None


def wanted(model, extra):
    """rollout.generate's choice for its shared-prefix path: the engine on CUDA unless `extra` holds an
    HF-only option; anywhere when `extra` names `graphs` (graphs=False: the CPU tests' way in)."""
    return set(extra) <= OPTIONS and supports(model) and (model.device.type == "cuda" or "graphs" in extra)


class Stopped(Exception):
    """Engine.run's signal that the engine has stopped (Engine.stop said why); decode returns None."""


def step_kind(model, fused, attention):
    """(the fused step's attention, fused_step.ATTENTIONS', or None: the model step; its fallback line or
    None). fused False: the model step (today's reference, asked for). attention None: flex where the step
    is compiled (CUDA), sdpa eagerly (the CPU)."""
    if not fused:
        return None, None
    why = decode_weights.supported(model)
    if why:
        return (
            None,
            f"engine: the fused decode step cannot read this model ({why}); it decodes with the model's "
            "forward",
        )
    cuda = model.device.type == "cuda"
    if attention is None and cuda and (no := fused_step.flex_problem()):
        return "sdpa", f"engine: FlexAttention cannot run ({no}); decode attention is SDPA over a length mask"
    return attention or ("flex" if cuda else "sdpa"), None


class Engine:
    """A run's decoder: static buffers, the decode step over them (fused, or the model's own forward), and on
    CUDA its graphs, kept across calls while they fit (`reserve` sizes it for a call; rollout.generate calls
    it). min_new_tokens None: the model's generation_config's (as HF generate); graphs None: on a CUDA model;
    check_every: steps between the host's reads of EOS (>= 1); fused: the fused step where it can read the
    model (False: the model step); attention: the fused step's (fused_step.ATTENTIONS; None: flex where
    compiled, else sdpa); compile_step: torch.compile the fused step (None: where graphs are captured)."""

    def __init__(
        self,
        model,
        min_new_tokens=None,
        graphs=None,
        check_every=16,
        fused=True,
        attention=None,
        compile_step=None,
    ):
        if not (isinstance(check_every, int) and check_every >= 1):
            raise ValueError(f"check_every must be an integer >= 1, got {check_every!r}")
        if not supports(model):
            raise ValueError("the engine decodes full attention only; this model has sliding-window layers")
        if attention not in (None, *fused_step.ATTENTIONS):
            raise ValueError(f"attention must be one of {fused_step.ATTENTIONS}, got {attention!r}")
        low = model.generation_config.min_new_tokens if min_new_tokens is None else min_new_tokens
        self.model, self.check_every, self.min_new = model, check_every, low or 0
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if self.graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        self.attention, line = step_kind(model, fused, attention)  # None: the model step
        if line:
            print(line, flush=True)
        fusing = self.attention is not None
        self.compile = fusing and (self.graphs if compile_step is None else compile_step)
        self.rows = self.S = self.width = self.new = self.captures = 0
        self.settings, self.kernels, self.keys, self.values, self.warp = None, None, None, None, None
        self.n, self.w = None, None  # the state buffers (make), the decode weights; None: not reserved
        self.graph, self.caches, self.pool, self.side, self.compiled = {}, {}, None, None, None
        self.off = None  # why the engine stopped (its step failed in a warm-up), else None

    def reserve(self, rows, width, new, eos, pad, warp):
        """Room for `rows` rows of `width` positions (prompt and new tokens), `new` tokens a call, decoded
        with these EOS ids and pad, and this call's warp (rollout.Sampling.warp: (temperature, top_k, top_p),
        or None: greedy); the decode copy of the weights filled again from the model (it may have stepped).
        Kept while the call fits and eos, pad are the same; else new buffers, at least as large, the graphs
        dropped and one line. The warp is not a reason to rebuild: each warp has its own graph over the same
        buffers (greedy evaluation beside sampled rollouts). grpo.py reserves its widest call at setup."""
        S = ALIGN * math.ceil(width / ALIGN)  # cache positions
        settings = (tuple(eos), pad)
        self.new, self.warp = new, warp
        if rows <= self.rows and S <= self.S and new <= self.width and settings == self.settings:
            if self.n is None:  # released for the update: made again
                return self.make()
            if self.w is not None:
                decode_weights.refresh(self.w, self.model)
            return self
        if self.rows:  # reserved before (grpo.py: at setup): a call it did not foresee
            print(
                f"engine: a call of {rows} rows x {S} positions x {new} new tokens (EOS, pad "
                f"{settings}) is past the {self.rows} x {self.S} x {self.width} reserved: new buffers, "
                f"graphs captured again"
            )
        rows, S, self.width = max(rows, self.rows), max(S, self.S), max(new, self.width)
        self.rows, self.S, self.settings, self.pad = rows, S, settings, pad
        return self.make()

    def make(self):
        """The reservation's state buffers, and for the fused step its weights and K, V buffers (the model
        step's K, V come with the first decode, in its prefill's dtypes: allocate)."""
        dev, V, rows, (eos, pad) = self.model.device, self.model.config.vocab_size, self.rows, self.settings
        self.graph, self.caches, self.pool = {}, {}, None  # graphs of the old buffers: gone
        self.keys = self.values = None  # (L, rows, Hkv, S, d); the old ones freed first
        self.ends = torch.tensor(eos, device=dev)  # (e,) the EOS ids
        self.ban = torch.zeros(V, dtype=torch.bool, device=dev)  # (V,) EOS, banned before min_new
        self.ban[self.ends] = True
        self.x = torch.full((rows,), pad, dtype=torch.long, device=dev)  # (rows,) the token to read next
        self.n = torch.zeros(rows, dtype=torch.long, device=dev)  # (rows,) its slot = position = keys filled
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)  # (rows,) EOS emitted (or idle)
        self.out = torch.full((rows, self.width), pad, dtype=torch.long, device=dev)  # (rows, N) tokens
        self.t = torch.zeros(1, dtype=torch.long, device=dev)  # the step, = column of out
        if self.attention is not None:
            w = self.w
            self.w = decode_weights.make(self.model) if w is None else decode_weights.refresh(w, self.model)
            self.allocate(None)
        return self

    def release(self):
        """Every buffer, the decode copy and every graph dropped, the sizes kept, the memory given back (on
        CUDA to the driver: empty_cache) for the update where budget.plan says "released"
        (training/memory/backoff.py calls it); the next `reserve` makes them again and the next decode of
        each warp captures its graph again."""
        self.x = self.n = self.done = self.out = self.t = self.ends = self.ban = None
        self.keys = self.values = self.w = None
        self.graph, self.caches, self.pool = {}, {}, None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        return self

    def resize(self, rows):
        """The buffers made again for `rows` rows (fewer after an out-of-memory error:
        training/memory/backoff.py), the old ones freed first; positions, new tokens, EOS and pad kept;
        graphs captured as calls come."""
        self.release()
        self.rows = rows
        return self.make()

    def state(self):
        return [self.x, self.n, self.done, self.out, self.t]

    def allocate(self, cache):
        """The K, V buffers, zero (a masked key still enters SDPA as 0 * value: no NaN garbage): the fused
        step's in its weights' dtype; the model step's in the dtypes its prefill wrote (`cache`: autocast may
        make keys and values differ), else the model's."""
        mc = self.model.config
        hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        shape = (mc.num_hidden_layers, self.rows, mc.num_key_value_heads, self.S, hd)
        first = cache.layers[0] if cache is not None and cache.layers else None
        dtypes = (
            [self.w.layers[0].qkv.ws[0].dtype] * 2
            if self.w is not None
            else [
                getattr(getattr(first, name, None), "dtype", self.model.dtype) for name in ("keys", "values")
            ]
        )
        self.keys = self.values = None  # the old ones freed first
        self.keys, self.values = (torch.zeros(shape, device=self.model.device, dtype=dt) for dt in dtypes)
        self.graph, self.caches, self.pool = {}, {}, None  # graphs of the old buffers: gone

    def cache(self, b):
        """transformers' Cache over rows :b of the buffers, for the model step (views: one Cache a width)."""
        if b not in self.caches:
            self.caches[b] = Cache(
                layers=[
                    SlotLayer(self.keys[i, :b], self.values[i, :b], self.n[:b]) for i in range(len(self.keys))
                ]
            )
        return self.caches[b]

    def scope(self):
        """The fused step outside any autocast (departure 5). The model step: attention on the kernels
        `attention_kernels` allows (not cuDNN: its plans are built for training's long sequences), and the
        caller's autocast without its weight cache, which a graph capture must not keep (departure 5)."""
        dev, stack = self.model.device.type, contextlib.ExitStack()
        if self.attention is not None:
            stack.enter_context(torch.autocast(dev, enabled=False))
            return stack
        if dev == "cuda":
            stack.enter_context(sdpa_kernel(self.kernels or FAST, set_priority=True))
        stack.enter_context(
            torch.autocast(
                dev,
                dtype=torch.get_autocast_dtype(dev),
                cache_enabled=False,
                enabled=torch.is_autocast_enabled(dev),
            )
        )
        return stack

    def step(self, b):
        """One decode step of rows :b. Tensor work only, no host sync: a graph captures it. Reads x at slot
        n (its position), writes its K, V there, samples y, then x = y, and n and t advance by one."""
        n, done = self.n[:b], self.done[:b]  # (b,) views: written in place
        if self.attention is not None:  # the fused step
            m = torch.where(done, 1, n + 1)  # (b,) keys each row attends (departure 3)
            K, V = (x if b == self.rows else x[:, :b] for x in (self.keys, self.values))  # (L, b, Hkv, S, d)
            logits = fused_step.logits(self.w, self.x[:b], n, m, K, V, self.attention)  # (b, V) w's dtype
        else:  # the model's own forward over the same buffers, keys :n + 1 shown
            shown = (torch.arange(self.S, device=n.device) <= n[:, None])[:, None, None]  # (b, 1, 1, S)
            logits = self.model(
                input_ids=self.x[:b, None],
                attention_mask=shown,
                position_ids=n[:, None],
                past_key_values=self.cache(b),
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]  # (b, V)
        if self.min_new:  # HF's min_new_tokens: no EOS yet
            logits = logits.masked_fill(self.ban & (self.t < self.min_new), float("-inf"))
        y = logits.argmax(-1) if self.warp is None else sample(logits, *self.warp)  # (b,)
        y = torch.where(done, self.pad, y)  # finished rows write pad
        self.out[:b].index_copy_(1, self.t, y[:, None])  # (b, N) column t
        done.logical_or_((y[:, None] == self.ends).any(-1))
        self.x[:b] = y
        n += 1
        self.t += 1

    def stepper(self):
        """The step as it runs: compiled whole where asked (torch.compile, fullgraph=True: one graph, or an
        error), else as written."""
        if not self.compile:
            return self.step
        if self.compiled is None:
            self.compiled = torch.compile(self.step, fullgraph=True, dynamic=False)
        return self.compiled

    def run(self, b):
        """The step, eager or as the replay of its graph, captured the first time this warp comes
        (`captures` counts them on either path). A compile that fails in the warm-up: the step
        uncompiled (warm_up). A capture that raises: graphs off, this step eager (its warm-up ran; the
        capture is what failed). A warm-up that raises eagerly: the step itself fails, so running it again
        would repeat the failing call: the engine stops (Stopped; rollout.generate decodes)."""
        key = self.warp  # greedy and sampling: two graphs
        if key not in self.graph:
            self.captures += 1
            self.graph[key] = None
            saved = [x.clone() for x in self.state()] if self.graphs else []
            if self.graphs:
                try:
                    self.side = self.side or torch.cuda.Stream()
                    self.warm_up(b)
                except Exception as e:  # noqa: BLE001 (the run goes on)
                    if self.forget(key, e):
                        raise
                    raise self.stop(e) from e
                try:  # cudagraph.py records it
                    self.graph[key] = cudagraph.capture(
                        functools.partial(self.stepper(), b), self.side, self.pool
                    )
                    self.pool = self.graph[key].pool()
                except Exception as e:  # noqa: BLE001 (the run goes on)
                    if self.forget(key, e):
                        raise
                    self.fall_back("capture", e)
            for x, v in zip(self.state(), saved):  # undo the warm-up (its K, V column
                x.copy_(v)  # is rewritten before it is read)
        if self.graph[key] is None or not self.graphs:
            return self.stepper()(b)
        self.graph[key].replay()  # a fault: decode's guard reads it

    def warm_up(self, b):
        """The step once on the side stream before its capture (cudagraph.warm_up), which compiles it where
        asked: a compiled step that fails runs uncompiled from here on (on SDPA: flex's eager path
        materialises its scores), said in one line, and is warmed up again; out of memory, or a failure of
        the step as written, is raised (run's)."""
        try:
            cudagraph.warm_up(functools.partial(self.stepper(), b), self.side)
        except Exception as e:  # noqa: BLE001 (raised unless the compile is what failed)
            if not self.compile or cudagraph.out_of_memory(e):
                raise
            self.compile, self.compiled, self.attention = False, None, "sdpa"  # flex uncompiled: slow
            print(
                f"engine: torch.compile of the decode step failed ({cudagraph.error_line(e)}); it runs "
                f"uncompiled from here on, its attention SDPA over a length mask",
                flush=True,
            )
            cudagraph.warm_up(functools.partial(self.step, b), self.side)

    def forget(self, key, error):
        """True for an out-of-memory error (cudagraph.out_of_memory) in a warm-up or capture: no graph fault,
        nothing turned off; the key is forgotten and the caller raises it on, to the back-off
        (training/memory/backoff.py)."""
        if cudagraph.out_of_memory(error):
            del self.graph[key]
            self.captures -= 1
        return cudagraph.out_of_memory(error)

    def fall_back(self, what, error):
        """Graphs off for the engine's life, said in one line (it cannot come twice: graphs are off)."""
        self.graphs, self.graph, self.pool = False, dict.fromkeys(self.graph), None
        print(
            f"engine: CUDA graph {what} failed ({cudagraph.error_line(error)}); the decode step runs eagerly "
            f"from here on",
            flush=True,
        )

    def stop(self, error):
        """The engine off for its life (`off`), said in one line: its step failed eagerly, in a warm-up."""
        self.off = cudagraph.error_line(error)
        self.graphs, self.graph, self.pool = False, dict.fromkeys(self.graph), None
        self.keys = self.values = self.w = None  # rollout.decode needs the memory
        self.caches = {}
        print(
            f"engine: the decode step failed in its warm-up ({self.off}); rollouts decode with "
            f"rollout.decode, without the engine, from here on",
            flush=True,
        )
        return Stopped(self.off)

    @torch.no_grad()
    def decode(self, inp, mask, cache, which):
        """(g, new) tokens of a chunk, pad after each row's EOS, or None once the engine has stopped (`off`:
        the caller decodes the chunk itself). inp, mask (k, W): the chunk's k distinct prompts laid out by
        rollout.prefill_rows, cache their K, V (all but the last prompt token), which (g,) each row's prompt.
        With graphs, the whole call is the guarded region: a replay's fault surfaces at a host read, so the
        call ends with one sync inside it (once a call, not a step); a fault turns the graphs off and the
        call is decoded again eagerly from its inputs (the prefill's cache is only read). A fault that
        leaves the CUDA context unusable (an illegal address) fails the eager call too, and is raised."""
        if self.off:
            return None
        if not self.graphs:
            return self.steps(inp, mask, cache, which)
        try:
            res = self.steps(inp, mask, cache, which)
            torch.cuda.current_stream().synchronize()  # a replay's fault: here, guarded
            return res
        except Stopped:
            return None
        except Exception as e:  # noqa: BLE001 (the run goes on)
            if not self.graphs or cudagraph.out_of_memory(e):  # an eager step's own error; out of memory:
                raise  # the back-off's (training/memory/backoff.py)
            self.fall_back("replay", e)
        return self.steps(inp, mask, cache, which)

    def steps(self, inp, mask, cache, which):
        """decode's work: the prompts' K, V to their rows, left-compacted, then steps until every row is
        done. Graphed or compiled, the step runs at the reserved rows (one graph), else at the chunk's g."""
        g, W, N = len(which), inp.shape[1], self.new
        first = cache.layers[0].keys if W > 1 else None  # (k, Hkv, W - 1, d) the prefill's
        if self.keys is None or (self.w is None and first is not None and first.dtype != self.keys.dtype):
            self.allocate(cache)
        real = mask[which, : W - 1].bool()  # (g, W - 1) the cached prompt tokens: [prefix | pads | suffix]
        order = torch.argsort((~real).to(torch.uint8), dim=-1, stable=True)  # (g, W - 1) real columns first
        for i, layer in enumerate(
            cache.layers if W > 1 else []
        ):  # row j's slot s: its prompt's column order[j, s]
            for buf, src in ((self.keys, layer.keys), (self.values, layer.values)):
                buf[i, :g, :, : W - 1] = src[which[:, None], :, order].transpose(1, 2)  # (g, Hkv, W - 1, d)
        self.x.fill_(self.pad)
        self.x[:g] = inp[which, -1]  # each row's last prompt token
        self.n.zero_()
        self.n[:g] = real.sum(-1)  # its slot: the prompt tokens before it, = its position
        self.done.fill_(True)
        self.done[:g] = False
        self.out.fill_(self.pad)
        self.t.zero_()
        b = self.rows if self.graphs or self.compile else g
        if self.kernels is None and self.attention is None and inp.device.type == "cuda":  # once per engine
            self.kernels = attention_kernels(self.model.config, self.keys, b, self.S)
        with self.scope():
            for t in range(N):
                self.run(b)
                if (t + 1) % self.check_every and t + 1 < N:
                    continue
                if bool(self.done[:g].all()):  # host sync: every check_every steps
                    break
        return self.out[:g, :N].clone()  # (g, N)
