"""The docs' tables that a command makes are that command's output, so they cannot drift: each block

    <!-- output of: python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24 -->
    ```text
    ...
    ```

in README.md, docs/*.md and results/README.md is compared with what the command prints now (in this process,
as on a machine without a GPU: the estimate's card is AMPERE's unless --capability says otherwise). The
commands are estimates that run in seconds (`eval.py memory`, no --measure); a measurement is quoted with its
date instead. A changed estimate or report regenerates every block:

    python tests/test_doc_outputs.py          # rewrites each block with its command's output now
"""

import contextlib
import io
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]
BLOCK = re.compile(r"<!-- output of: (python eval\.py memory [^>]*?) -->\n```text\n(.*?)```\n", re.S)


def blocks():
    """[(file, command, the output the file holds)] of every block in the docs."""
    return [(md, m[1], m[2]) for md in DOCS for m in BLOCK.finditer(md.read_text())]


def output(command) -> str:
    """What `command` (python eval.py memory ...) prints, run in this process with no GPU visible."""
    sys.path.insert(0, str(ROOT))
    import eval as ev

    buf = io.StringIO()
    with mock.patch.object(torch.cuda, "is_available", lambda: False), contextlib.redirect_stdout(buf):
        ev.main(command.split()[2:])
    return buf.getvalue()


def test_the_docs_hold_the_commands_blocks():
    """At least the 24 GB LoRA plan (docs/gpu.md) and the 80 GB 1K one (results/README.md) are blocks."""
    found = {(md.name, c) for md, c, _ in blocks()}
    assert ("gpu.md", "python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24") in found
    assert ("README.md", "python eval.py memory --model qwen3-4b-random") in found


@pytest.mark.parametrize("md, command, held", blocks(), ids=lambda x: getattr(x, "name", str(x)[22:60]))
def test_each_block_is_its_commands_output_now(md, command, held):
    assert held == output(command), f"{md.relative_to(ROOT)}: run python tests/test_doc_outputs.py"


def main():
    for md in DOCS:
        text = md.read_text()
        new = BLOCK.sub(lambda m: f"<!-- output of: {m[1]} -->\n```text\n{output(m[1])}```\n", text)
        if new != text:
            md.write_text(new)
            print(f"rewrote {md.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
