"""evaluation/memtrace.py: the tracker counts each storage once (views are free) and frees it, the allocator
trace is replayed to its peak (a hand-made trace, and on a GPU a real step's backward), and a memory snapshot
is read back from its JSON summary, never unpickled."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_STEP

import grpo
from evaluation import memtrace


# ----------------------------------------------------------------------------- the tracker, the trace
def test_tracker_counts_views_once_and_frees():
    with memtrace.track_peak() as tr:
        tr.phase("a")
        x = torch.zeros(1000)  # 4000 bytes
        y = x[10:]  # a view: nothing new
        z = x * 2  # 4000 more
        assert tr.now == 8000
        del x, z
        assert tr.now == 4000  # the view keeps x's storage alive
        del y
    assert tr.now == 0 and tr.peak["a"] == 8000


def event(action, addr, size, *names, py=None):
    """One allocator trace entry as torch.cuda.memory._snapshot() writes it (frames innermost first)."""
    frames = ([{"filename": py[0], "line": py[1], "name": py[2]}] if py else []) + [
        {"filename": "??", "line": 0, "name": n} for n in names
    ]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_held_at_peak_replays_the_allocators_count():
    """A hand-made trace: 1000 bytes at the start, 200 of them freed in the window; the count peaks at
    1550, when B, C and D (750 bytes) are the window's live blocks, grouped by where they were made."""
    node = "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"
    snap = {
        "base_allocated": 1000,
        "device_traces": [
            [
                event("alloc", 1, 100, py=("/x/modeling_qwen3.py", 80, "forward")),  # A  1100
                event("alloc", 2, 300, "at::native::mm_out(at::Tensor const&)", node),  # B  1400
                event("free_requested", 1, 100),  #    1300
                event("free_completed", 1, 100),  #    (no change)
                event("segment_alloc", 99, 2**21),  #    (reserved)
                event("alloc", 3, 50, "at::native::mm_out(at::Tensor const&)", node),  # C  1350
                event("free_requested", 7, 200),  # X  1150 (older)
                event("alloc", 4, 400, py=("/x/policy.py", 183, "piece")),  # D  1550 peak
                event("free_requested", 4, 400),  #    1150
                event("alloc", 5, 300, py=("/x/policy.py", 183, "piece")),
            ]
        ],
    }  # E  1450
    peak, before, rows = memtrace.held_at_peak(snap)
    assert (peak, before) == (1550, 800)
    assert rows == [(400, 1, "- | - | policy.py:183 piece"), (350, 2, "MmBackward0 | at::native::mm_out | -")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's history needs a CUDA device")
def test_snapshot_of_the_backward_replays_to_the_allocators_peak(tmp_path):
    """On a GPU: the recorded window of a real tiny step, replayed, peaks where the allocator's own count
    did, and holds blocks made by autograd nodes (the backward's own)."""
    cfg = grpo.parse_args(SMALL_STEP)
    path = tmp_path / "backward.pickle"
    measured = memtrace.measure(cfg, 32, grpo.update, "cuda", snapshot=str(path))
    s = json.loads(Path(str(path) + ".json").read_text())  # save_snapshot's summary, every site
    assert path.is_file() and s["peak"] == s["window_peak"] <= measured["backward"]
    assert 0 < s["before"] <= s["base_allocated"]
    assert any("Backward" in site.split(" | ")[0] for _, _, site in s["rows"])  # the backward's own blocks
    assert memtrace.report_held(str(path), measured["backward"]).count("\n") == 1 + min(12, len(s["rows"]))


# ----------------------------------------------------------------------------- memory snapshots
class Evil:
    """A pickle that creates a file when it is loaded: what a crafted snapshot could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_snapshot_is_read_back_from_its_json_summary_never_unpickled(tmp_path):
    frames = [{"filename": "/x/policy.py", "line": 183, "name": "piece"}]
    snap = {
        "base_allocated": 10**9,
        "window_peak": 15 * 10**8,
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 4 * 10**8, "frames": frames},  # 1.4 GB
                {"action": "alloc", "addr": 2, "size": 10**8, "frames": []},  # 1.5 GB: the peak
                {"action": "free_requested", "addr": 2, "size": 10**8, "frames": []},
            ]
        ],
    }
    path = tmp_path / "snap" / "backward.pickle"
    memtrace.save_snapshot(snap, str(path))
    assert path.read_bytes() == pickle.dumps(snap)  # the pickle is memory_viz's
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps(Evil(marker)))  # swapped for a crafted one
    out = memtrace.report_held(str(path), 12 * 10**8).splitlines()
    assert not marker.exists()  # nothing was unpickled
    assert "peak 1.50 GB" in out[0] and "estimated 1.20" in out[0] and "1.00 GB of it from before" in out[0]
    assert [x.split()[:2] for x in out[2:]] == [["0.400", "1"], ["0.100", "1"]]
    assert out[2].endswith("- | - | policy.py:183 piece")
    Path(str(path) + ".json").unlink()
    with pytest.raises(ValueError, match=r"backward\.pickle\.json"):
        memtrace.report_held(str(path), 1200)
    src = (ROOT / "evaluation" / "memtrace.py").read_text() + (ROOT / "eval.py").read_text()
    assert "pickle.load" not in src
