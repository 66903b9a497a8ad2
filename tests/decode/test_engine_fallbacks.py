"""training/decode/engine.py's fallbacks, each forced on the CPU with a fake of torch.cuda's streams and
graphs: a capture that fails (the run leaves the side stream, the line names the first error), a warm-up that
fails (the failing step is not run again; rollout.decode takes over), a replay whose fault surfaces only at a
host sync (read inside the guarded call, one sync a call). In each the run goes on, the line comes once,
and the greedy rows equal the eager decoder's."""

import contextlib

import pytest
import torch

from training.decode import engine, rollout
from training.model.load import load_model

FEWSHOT = "Q: 1+1? A: 2. Q: 2+3? A: 5. Q: "
PROMPTS = [FEWSHOT + "4+4? A:", FEWSHOT + "10+7? A:", FEWSHOT + "3+9, then double it? A:", "no shared prefix"]
SYNCED = "operation not permitted when stream is capturing"  # what a host sync inside a capture raises
OOM = "CUDA out of memory. Tried to allocate 20.00 MiB"  # the caching allocator's error


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_stream(self, other):
        pass

    def synchronize(self):
        self.cuda.syncs += 1
        if self.cuda.fault:  # an earlier replay's asynchronous fault
            fault, self.cuda.fault = self.cuda.fault, None
            raise fault


class FakeGraph:
    """A capture runs the step for real (the CPU has nothing to record; the engine undoes it, as it undoes the
    warm-up) and keeps it; replay runs it again, and with mode "replay" leaves a fault for the next sync."""

    def __init__(self, cuda):
        self.cuda, self.call = cuda, None

    def capture_begin(self, pool=None):
        self.cuda.capturing = self

    def capture_end(self):
        self.cuda.capturing = None
        if self.cuda.mode == "capture":
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def pool(self):
        return None

    def replay(self):
        self.call()
        if self.cuda.mode == "replay":
            self.cuda.fault = RuntimeError("CUDA error: an illegal memory access was encountered")
        elif self.cuda.mode == "replay out of memory":
            self.cuda.fault = torch.OutOfMemoryError(OOM)


class FakeCuda:
    """torch.cuda's Stream, stream, current_stream, synchronize and CUDAGraph as the engine calls them, and
    Engine.step wrapped: it records itself into a capture, and fails where `mode` says."""

    def __init__(self, monkeypatch, mode):
        self.mode, self.fault, self.capturing, self.syncs, self.failed = mode, None, None, 0, 0
        self.stack = [FakeStream(self, "default")]
        real = engine.Engine.step

        def step(eng, b):
            if self.capturing is not None:
                self.capturing.call = lambda: real(eng, b)
                if self.mode == "capture":
                    raise RuntimeError(SYNCED)
            elif self.mode == "warm-up" and self.stack[-1].name == "side":
                self.failed += 1
                raise RuntimeError("CUDA error: out of memory")
            elif self.mode == "warm-up out of memory" and self.stack[-1].name == "side":
                self.failed += 1
                raise torch.OutOfMemoryError(OOM)
            return real(eng, b)

        @contextlib.contextmanager
        def stream(s):
            self.stack.append(s)
            try:
                yield s
            finally:
                self.stack.pop()

        monkeypatch.setattr(engine.Engine, "step", step)
        monkeypatch.setattr(torch.cuda, "Stream", lambda: FakeStream(self, "side"))
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: self.stack[-1])
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(self))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen3", device="cpu", dtype=torch.float32)


def rows(model, tok, eng, prompts=PROMPTS):
    return rollout.generate(
        model, tok, prompts, 3, rollout.Sampling(12, greedy=True), chunk_size=5, engine=eng
    ).response_ids


def graphed(model):
    """An engine on the graph path, as on CUDA (its CUDA calls are the fake's)."""
    eng = engine.Engine(model, graphs=False, check_every=4)
    eng.graphs = True
    return eng


def engine_lines(out):
    return [x for x in out.splitlines() if x.startswith("engine:")]


def test_graphs_replay_with_one_sync_a_call(tiny, monkeypatch):
    """The fake's graphs work: the rows are the eager engine's, and the guard's sync comes once per decode
    call (a chunk), not once per step (12 steps a chunk here)."""
    model, tok = tiny
    want = rows(model, tok, engine.Engine(model, graphs=False))
    cuda = FakeCuda(monkeypatch, "ok")
    eng = graphed(model)
    assert rows(model, tok, eng) == want and eng.graphs and any(eng.graph.values())
    assert cuda.syncs == 3 and cuda.stack[-1].name == "default"  # 12 rows in chunks of 5


def test_a_failed_capture_leaves_the_side_stream_and_names_the_first_error(tiny, monkeypatch, capsys):
    """The step synchronises inside the capture, then capture_end raises: the run is back on the default
    stream, the line names the operation's error (not capture_end's), once; the rows are the eager ones and
    the next call runs eagerly too."""
    model, tok = tiny
    want = rows(model, tok, engine.Engine(model, graphs=False))
    capsys.readouterr()
    cuda = FakeCuda(monkeypatch, "capture")
    eng = graphed(model)
    assert rows(model, tok, eng) == want and rows(model, tok, eng) == want
    assert cuda.stack[-1].name == "default" and not eng.graphs and eng.off is None
    assert engine_lines(capsys.readouterr().out) == [
        f"engine: CUDA graph capture failed (RuntimeError: {SYNCED}); the decode step runs eagerly from "
        "here on"
    ]


def test_a_failed_warm_up_is_not_repeated_and_rollout_decode_takes_over(tiny, monkeypatch, capsys):
    """The step fails in its warm-up: it is not run again (the eager step would repeat it); the engine
    stops with one line and rollout.decode decodes this chunk and every call after: greedy rows equal the
    eager decoder's (generate without an engine)."""
    model, tok = tiny
    want = rows(model, tok, None)  # the CPU's rollout.decode
    capsys.readouterr()
    cuda = FakeCuda(monkeypatch, "warm-up")
    eng = graphed(model)
    assert rows(model, tok, eng) == want and rows(model, tok, eng) == want
    assert cuda.failed == 1 and eng.off == "RuntimeError: CUDA error: out of memory"
    assert engine_lines(capsys.readouterr().out) == [
        "engine: the decode step failed in its warm-up (RuntimeError: CUDA error: out of memory); rollouts "
        "decode with rollout.decode, without the engine, from here on"
    ]


def test_a_replay_fault_is_read_inside_the_guard(tiny, monkeypatch, capsys):
    """A replay's fault surfaces only at a sync (asynchronous, as on a GPU): the call's own sync reads it
    inside the guard, the graphs go off with one line and the call is decoded again eagerly: the rows are
    the eager engine's, and the next call is eager."""
    model, tok = tiny
    want = rows(model, tok, engine.Engine(model, graphs=False))
    capsys.readouterr()
    cuda = FakeCuda(monkeypatch, "replay")
    eng = graphed(model)
    assert rows(model, tok, eng) == want and rows(model, tok, eng) == want
    assert not eng.graphs and cuda.fault is None
    assert engine_lines(capsys.readouterr().out) == [
        "engine: CUDA graph replay failed (RuntimeError: CUDA error: an illegal memory access was "
        "encountered); the decode step runs eagerly from here on"
    ]


@pytest.mark.parametrize("mode", ["warm-up out of memory", "replay out of memory"])
def test_out_of_memory_is_no_graph_fault_and_goes_on_to_the_back_off(tiny, monkeypatch, capsys, mode):
    """The allocator's error in a warm-up or surfacing at a replay's sync is not the graphs' fault: no
    engine line, nothing turned off (graphs on, the engine not stopped), the error raised to the caller
    (training/memory/backoff.py makes the rows fewer); the next call, with the memory there, decodes on
    graphs."""
    model, tok = tiny
    want = rows(model, tok, engine.Engine(model, graphs=False))
    capsys.readouterr()
    cuda = FakeCuda(monkeypatch, mode)
    eng = graphed(model)
    with pytest.raises(torch.OutOfMemoryError):
        rows(model, tok, eng)
    assert eng.graphs and eng.off is None and engine_lines(capsys.readouterr().out) == []
    assert all(g is not None for g in eng.graph.values())  # no key left marked eager
    cuda.mode, cuda.fault = "ok", None
    assert rows(model, tok, eng) == want and eng.graphs and any(eng.graph.values())
