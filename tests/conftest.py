"""Shared pytest fixtures: paths to the offline benchmark copies and the embedded model."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("FLOWTRACER_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture
def shared_data():
    """The offline benchmark JSONL copies (../shared/data); skip where they are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"offline benchmark copies not found at {SHARED_DATA} (set FLOWTRACER_DATA)")
    return SHARED_DATA
