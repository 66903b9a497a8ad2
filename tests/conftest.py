"""Shared pytest setup: one torch thread, and paths to the offline benchmark copies."""
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("FLOWTRACER_DATA") or ROOT.parent / "shared" / "data")   # as data.py

# Tiny models are dominated by per-op overhead: one thread avoids oversubscribing a 2-core machine
# (measured ~100x slower generate with 2 threads while another process was busy). Subprocesses inherit it.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def shared_data():
    """The offline benchmark JSONL copies (../shared/data); skip where they are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"offline benchmark copies not found at {SHARED_DATA} (set FLOWTRACER_DATA)")
    return SHARED_DATA


def task_data_missing(task, split="test"):
    """Why `task`'s split cannot be read here, or None: no offline copy under $FLOWTRACER_DATA (or
    ../shared/data) and no hub (HF_HUB_OFFLINE, or huggingface.co unreachable in 3 s; datasets: 25 s)."""
    import data
    t = data.TASKS[task]
    local = [SHARED_DATA / t.local / f"{split}{ext}" for ext in (".jsonl", ".parquet")]
    if t.generate or any(p.is_file() for p in local):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return f"{task}: no offline copy under {SHARED_DATA} (set FLOWTRACER_DATA) and HF_HUB_OFFLINE is set"
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        return f"{task}: no offline copy under {SHARED_DATA} (set FLOWTRACER_DATA) and no hub ({e})"
    return None
