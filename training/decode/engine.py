"""The one-GPU decode engine: rollout.generate's shared-prefix rollouts at the speed of the GPU.

rollout.generate decodes with Engine on CUDA (shared prefix, no HF-only option: `wanted`); the CPU keeps
rollout.decode, and rollout.generate(..., graphs=False) runs the engine there, eagerly (the tests). Each
prompt is still read once (rollout.shared_prefix, then rollout.prefill_rows on the chunk's distinct prompts);
Engine.decode copies its keys and values to its G rows in static buffers, and decodes on three ideas. Why
(measured on one H100, docs/gpu.md): a step of rollout.decode kept the GPU busy a tenth of its time; the
decode was bound by the host (kernel launches, cuDNN plans, a host sync a step), not by the GPU's memory,
whose ceiling is reading the weights and the rows' KV cache once a step.

  1. A static KV cache (training/decode/static_step.py's SlotLayer): buffers of fixed shape written in
     place, so no step builds a new attention plan, and a graph can hold the step.
  2. Graph replay. On CUDA the whole step (forward, sampling, bookkeeping) is captured once per (rows bucket,
     key-length bucket) as a torch.cuda.CUDAGraph (warmed up on a side stream first) and replayed: one launch
     instead of ~1,860 kernel launches a step, each a few microseconds of Python and driver. Decode
     attention runs on flash / memory-efficient SDPA (sdpa_kernel around the step, checked once: the math
     kernel only where neither can run it, and then with one line); cuDNN stays for training's
     long sequences, where its plans are reused. Rows are bucketed by 1, 2, 4, then multiples of 8: when the
     rows still writing fit a smaller bucket, they move to the front and its graph takes over.
  3. Sampling without a sync (static_step.sample): the draw on the GPU, EOS read by the host every
     `check_every` steps (16), not every step.

An Engine lives for a run: grpo.py's is made at setup (training/memory/preflight.py) and reserved once for the
run's widest prompt + max_new_tokens, so no prompt met mid-run grows it; a caller that passes one to every
rollout.generate call (engine=...) keeps its buffers and graphs while the calls fit them (`reserve`); one
that needs more rows, positions or new tokens, or other EOS ids or pad, grows them (one line). Sampling does
not: each warp (greedy, or temperature / top-k / top-p) has its own graphs over the same buffers, so
held-out evaluation's greedy decode shares the rollouts' engine.
`captures` counts the graphs captured (eagerly: those the step would capture; docs/gpu.md: how many).
Fallbacks (the run goes on; one line each, docs/gpu.md has their cost and what each one means): a failed
capture turns the graphs off (eager steps); a failed warm-up stops the engine (rollout.decode decodes); a
replay's fault, read at the call's one sync, turns the graphs off and decodes the call again eagerly.
An out-of-memory error (cudagraph.out_of_memory) in a warm-up, a capture or the guarded call is none of
these: nothing is turned off, the error goes on to the caller, and grpo.py's back-off
(training/memory/backoff.py) halves gen_chunk, `resize`s the engine (its buffers made again at the new width)
and decodes the rows left.

Memory: the static buffers are the KV cache that training/memory/terms.py's `generation` counts for a chunk (T
= P + R), beside the prompts' prefill cache; tests/decode/test_engine_runtime.py holds the engine's peak to
it. The
run's engine holds its reservation (the widest prompt + R) through the update too (memory.py counts its
buffers in every phase on CUDA), unless the plan releases it for the update (`release`: every buffer and graph
freed; the next call's `reserve` makes them again and its steps capture the graphs again).
`benchmarks/generate_speed.py --device cuda` prints it beside HF generate.

Departures from rollout.decode / HF generate (numbered):
  1. Same distribution, other samples. The draw is an exponential race over HF's warped distribution
     (temperature, then top-k, then top-p, HF's order and cut rule), so a seed no longer gives HF's samples;
     tests/decode/test_engine.py checks the distribution by a chi-square test instead. Greedy rows equal HF's
     (fp32, tested): the same forward, reading extra keys that are masked.
  2. Top-k keeps exactly k tokens; HF keeps every token tied with the k-th logit.
  3. A finished row keeps its place (writing pad) until the next check; then it leaves when the rows still
     writing fit a smaller bucket. Rows of the bucket beyond the chunk's are idle rows.
  4. Graphs are captured lazily, the first time a (rows, key length) pair comes (a capture costs one
     warm-up step and one captured step), and kept for the engine's life (above).
  5. Under autocast, a captured step casts fp32 weights every replay (autocast's weight cache is off in a
     capture); bf16 weights, as policy.py's kahan scheme loads them on CUDA, need no cast.

Run: python benchmarks/generate_speed.py --device cuda --model qwen3-4b-random   # beside HF generate, a GPU
     python benchmarks/generate_speed.py --engine --model tiny-qwen3 --shape tiny --rounds 1   # CPU, eager
     python -m pytest -q tests/decode/test_engine.py tests/decode/test_engine_runtime.py
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch.nn.attention import sdpa_kernel
from transformers.cache_utils import Cache

from training.decode import cudagraph
from training.decode.static_step import (
    ALIGN,
    FAST,
    LENGTHS,
    SlotLayer,
    attention_kernels,
    row_buckets,
    sample,
)

OPTIONS = frozenset({"min_new_tokens", "graphs", "check_every"})  # Engine options rollout.generate passes


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


class Engine:
    """A run's decoder: static buffers, the decode step over them, and on CUDA its graphs, kept across calls
    while they fit (`reserve` sizes it for a call; rollout.generate calls it). min_new_tokens None: the
    model's generation_config's (as HF generate); graphs None: on a CUDA model; check_every: steps between
    the host's reads of EOS (>= 1)."""

    def __init__(self, model, min_new_tokens=None, graphs=None, check_every=16):
        if not (isinstance(check_every, int) and check_every >= 1):
            raise ValueError(f"check_every must be an integer >= 1, got {check_every!r}")
        if not supports(model):
            raise ValueError("the engine decodes full attention only; this model has sliding-window layers")
        low = model.generation_config.min_new_tokens if min_new_tokens is None else min_new_tokens
        self.model, self.check_every, self.min_new = model, check_every, low or 0
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if self.graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        self.rows = self.S = self.width = self.new = self.captures = 0
        self.settings, self.kernels, self.keys, self.values, self.warp = None, None, None, None, None
        self.mask = None  # the state buffers (make); None: not reserved, or released
        self.graph, self.caches, self.pool, self.side = {}, {}, None, None
        self.off = None  # why the engine stopped (its step failed in a warm-up), else None

    def reserve(self, rows, width, new, eos, pad, warp):
        """Room for `rows` rows of `width` positions (prompt and new tokens), `new` tokens a call, decoded
        with these EOS ids and pad, and this call's warp (rollout.Sampling.warp: (temperature, top_k, top_p),
        or None: greedy). Kept while the call fits and eos, pad are the same; else new buffers, at least as
        large, the graphs dropped and one line. The warp is not a reason to rebuild: each warp has its own
        graphs over the same buffers (greedy evaluation beside sampled rollouts). grpo.py reserves its widest
        call at setup."""
        S = ALIGN * math.ceil(width / ALIGN)  # cache positions
        settings = (tuple(eos), pad)
        self.new, self.warp = new, warp
        if rows <= self.rows and S <= self.S and new <= self.width and settings == self.settings:
            return self.make() if self.mask is None else self  # released for the update: made again
        if self.rows:  # reserved before (grpo.py: at setup): a call it did not foresee
            print(
                f"engine: a call of {rows} rows x {S} positions x {new} new tokens (EOS, pad "
                f"{settings}) is past the {self.rows} x {self.S} x {self.width} reserved: new buffers, "
                f"graphs captured again"
            )
        rows, S, self.width = max(rows, self.rows), max(S, self.S), max(new, self.width)
        self.rows, self.S, self.settings, self.pad = rows, S, settings, pad
        self.span = ALIGN * max(2, math.ceil(S / LENGTHS / ALIGN))  # key-length bucket, >= 128
        self.buckets = row_buckets(rows)
        return self.make()

    def make(self):
        """The reservation's state buffers; the K, V ones come with the first decode (allocate)."""
        dev, V, rows, S, (eos, pad) = (
            self.model.device,
            self.model.config.vocab_size,
            self.rows,
            self.S,
            self.settings,
        )
        self.ends = torch.tensor(eos, device=dev)  # (e,) the EOS ids
        self.ban = torch.zeros(V, dtype=torch.bool, device=dev)  # (V,) EOS, banned before min_new
        self.ban[self.ends] = True
        self.mask = torch.zeros(rows, 1, 1, S, dtype=torch.bool, device=dev)  # (rows, 1, 1, S) visible
        self.x = torch.full((rows,), pad, dtype=torch.long, device=dev)  # (rows,) the token to read next
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # (rows, 1) its position
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)  # (rows,) EOS emitted (or idle)
        self.out = torch.full((rows, self.width), pad, dtype=torch.long, device=dev)  # (rows, N) tokens
        self.at = torch.zeros(1, dtype=torch.long, device=dev)  # the cache column written next
        self.t = torch.zeros(1, dtype=torch.long, device=dev)  # the step, = column of out
        self.keys = self.values = None  # (L, rows, Hkv, S, d): first chunk
        self.graph, self.caches, self.pool = {}, {}, None
        return self

    def release(self):
        """Every buffer and graph dropped, the sizes kept, the memory given back (on CUDA to the driver:
        empty_cache) for the update where budget.plan says "released" (training/memory/backoff.py calls it);
        the next `reserve` makes the buffers again and the steps capture their graphs again."""
        self.mask = self.x = self.pos = self.done = self.out = self.at = self.t = self.ends = self.ban = None
        self.keys = self.values = None
        self.graph, self.caches, self.pool = {}, {}, None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        return self

    def resize(self, rows):
        """The buffers made again for `rows` rows (fewer after an out-of-memory error:
        training/memory/backoff.py),
        the old ones freed first; positions, new tokens, EOS and pad kept; graphs captured as calls come."""
        self.release()
        self.rows, self.buckets = rows, row_buckets(rows)
        return self.make()

    def state(self):
        return [self.mask, self.x, self.pos, self.done, self.out, self.at, self.t]

    def allocate(self, cache):
        """The K, V buffers, zero (a masked key still enters attention as 0 * value: no NaN garbage), in the
        dtypes the prefill wrote (autocast may make keys and values differ), else the model's."""
        mc, first = self.model.config, cache.layers[0] if cache.layers else None
        hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        shape = (mc.num_hidden_layers, self.rows, mc.num_key_value_heads, self.S, hd)
        self.keys, self.values = (
            torch.zeros(
                shape,
                device=self.model.device,
                dtype=getattr(getattr(first, name, None), "dtype", self.model.dtype),
            )
            for name in ("keys", "values")
        )
        self.graph, self.caches, self.pool = {}, {}, None  # graphs of the old buffers: gone

    def cache(self, b, s):
        """transformers' Cache over rows :b and keys :s of the buffers (views: one Cache per graph)."""
        if (b, s) not in self.caches:
            self.caches[b, s] = Cache(
                layers=[
                    SlotLayer(self.keys[i, :b, :, :s], self.values[i, :b, :, :s], self.at)
                    for i in range(len(self.keys))
                ]
            )
        return self.caches[b, s]

    def scope(self):
        """Decode attention on the kernels `attention_kernels` allows (not cuDNN: idea 2), and the caller's
        autocast without its weight cache, which a graph capture must not keep (departure 5)."""
        dev, stack = self.model.device.type, contextlib.ExitStack()
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

    def step(self, b, s):
        """One decode step of rows :b reading keys :s. Tensor work only, no host sync: a graph captures it.
        Reads x at pos, writes its K, V at `at`, samples y, then x = y, pos, at and t advance by one."""
        m = self.mask[:b]
        m.index_fill_(-1, self.at, True)  # (b, 1, 1, S) column `at` visible
        logits = (
            self.model(
                input_ids=self.x[:b, None],
                attention_mask=m[..., :s],
                position_ids=self.pos[:b],
                past_key_values=self.cache(b, s),
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )  # (b, V) as HF: an fp32 copy
        if self.min_new:  # HF's min_new_tokens: no EOS yet
            logits.masked_fill_(self.ban & (self.t < self.min_new), float("-inf"))
        y = logits.argmax(-1) if self.warp is None else sample(logits, *self.warp)  # (b,)
        y = torch.where(self.done[:b], self.pad, y)  # finished rows write pad
        self.out[:b].index_copy_(1, self.t, y[:, None])  # (b, N) column t
        self.done[:b].logical_or_((y[:, None] == self.ends).any(-1))
        self.x[:b] = y
        self.pos[:b] += 1
        self.at += 1
        self.t += 1

    def run(self, b, s):
        """The step, eager or as the replay of its graph, captured the first time (b, s, warp) comes
        (`captures` counts them on either path). A capture that raises: graphs off, this step eager (its
        warm-up ran; the capture is what failed). A warm-up that raises: the step itself fails, so running
        it eagerly would repeat the failing call: the engine stops (Stopped; rollout.generate decodes)."""
        key = (b, s, self.warp)  # greedy and sampling: two sets
        if key not in self.graph:
            self.captures += 1
            self.graph[key] = None
            saved = [x.clone() for x in self.state()] if self.graphs else []
            if self.graphs:
                step = functools.partial(self.step, b, s)  # cudagraph.py runs it, records it
                try:
                    self.side = self.side or torch.cuda.Stream()
                    cudagraph.warm_up(step, self.side)
                except Exception as e:  # noqa: BLE001 (the run goes on)
                    if self.forget(key, e):
                        raise
                    raise self.stop(e) from e
                try:
                    self.graph[key] = cudagraph.capture(step, self.side, self.pool)
                    self.pool = self.graph[key].pool()
                except Exception as e:  # noqa: BLE001 (the run goes on)
                    if self.forget(key, e):
                        raise
                    self.fall_back("capture", e)
            for x, v in zip(self.state(), saved):  # undo the warm-up (its K, V column
                x.copy_(v)  # is rewritten before it is read)
        if self.graph[key] is None or not self.graphs:
            return self.step(b, s)
        self.graph[key].replay()  # a fault: decode's guard reads it

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
        self.keys = self.values = None  # rollout.decode needs the memory
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
        """decode's work: the prompts' K, V to their rows, then steps until every row is done."""
        g, W, N = len(which), inp.shape[1], self.new
        first = cache.layers[0].keys if W > 1 else None  # (k, Hkv, W - 1, d) the prefill's
        if self.keys is None or (first is not None and first.dtype != self.keys.dtype):
            self.allocate(cache)
        for i, layer in enumerate(cache.layers if W > 1 else []):  # (g, Hkv, W - 1, d) per layer
            self.keys[i, :g, :, : W - 1] = layer.keys[which]
            self.values[i, :g, :, : W - 1] = layer.values[which]
        self.mask.zero_()
        self.mask[:g, 0, 0, :W] = mask[which].bool()
        self.x.fill_(self.pad)
        self.x[:g] = inp[which, -1]  # each row's last prompt token
        self.pos.zero_()
        self.pos[:g] = mask[which].sum(-1, keepdim=True) - 1  # positions count real tokens
        self.done.fill_(True)
        self.done[:g] = False
        self.out.fill_(self.pad)
        self.at.fill_(W - 1)
        self.t.zero_()
        res = torch.full((g, N), self.pad, dtype=torch.long, device=inp.device)  # (g, N)
        rows, b = torch.arange(g, device=inp.device), self.bucket(g)  # rows[j]: the chunk row in slot j
        if self.kernels is None and inp.device.type == "cuda":  # once per engine
            self.kernels = attention_kernels(self.model.config, self.keys, b, min(self.S, self.span))
        with self.scope():
            for t in range(N):
                self.run(b, min(self.S, self.span * math.ceil((W + t) / self.span)))  # keys :W + t needed
                if (t + 1) % self.check_every and t + 1 < N:
                    continue
                res[rows] = self.out[: len(rows), :N]  # host sync: every check_every steps
                live = (~self.done[: len(rows)]).nonzero().squeeze(1)  # (n,) slots still writing
                if len(live) == 0:
                    break
                if self.bucket(len(live)) < b and t + 1 < N:
                    rows, b = rows[live], self.compact(live, W + t)
        return res

    def bucket(self, n):
        return next(b for b in self.buckets if b >= n)

    def compact(self, live, filled):
        """Move the slots still writing (live, ascending) to the front, so that a smaller bucket decodes them:
        one layer at a time, only the rows that move and the positions filled. Returns the new bucket."""
        n, moved = len(live), live.tolist()
        f = next((j for j, i in enumerate(moved) if i != j), n)  # slots f.. move up
        for buf in (self.keys, self.values):
            for i in range(len(buf)) if f < n else []:
                buf[i, f:n, :, :filled] = buf[i, live[f:], :, :filled]  # (n - f, Hkv, filled, d)
        for x in (self.mask, self.x, self.pos, self.done, self.out):
            x[:n] = x[live]
        self.done[n:] = True  # the new bucket's idle slots
        return self.bucket(n)
