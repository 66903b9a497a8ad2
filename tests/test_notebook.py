"""notebooks/*.ipynb run top to bottom, as nbmake runs them: each notebook through nbclient (the executor
nbmake is built on) in its own folder, with the python3 kernel and at most 600 s a cell (nbmake's
--nbmake-timeout=600, which pytest.ini passed before). Without nbclient or a python3 kernel (ipykernel)
the test skips with the reason, so a machine without the notebook tools still runs the suite (the GPU
machine); `pip install -r requirements.txt` brings both (nbmake, ipykernel), and then
`python -m pytest -q -n auto` (the README's command, .ci/run's) runs the notebook. With nbmake installed,
`python -m pytest --nbmake
notebooks` still works as before.

Run: python -m pytest -q tests/test_notebook.py          # a few minutes on 2 cores
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds a cell may take (nbmake's --nbmake-timeout, pytest.ini's)
INSTALL = "pip install -r requirements.txt (nbmake brings nbclient, and ipykernel the python3 kernel)"


def kernel_problem():
    """Why the notebooks cannot run here (one sentence), or None."""
    import importlib.util

    for module in ("nbclient", "nbformat", "jupyter_client", "ipykernel"):
        if importlib.util.find_spec(module) is None:
            return f"the notebook executor needs {module}: {INSTALL}"
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        return f"no python3 Jupyter kernel is installed: {INSTALL}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_notebook_runs_top_to_bottom(path):
    if why := kernel_problem():
        pytest.skip(why)
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # a failing cell raises CellExecutionError with its traceback
    ran = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert ran and all(c.get("execution_count") for c in ran)  # every code cell ran
