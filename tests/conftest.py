"""Shared pytest setup: one torch thread, and paths to the offline benchmark copies."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("FLOWTRACER_DATA", ROOT.parent / "shared" / "data"))

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
