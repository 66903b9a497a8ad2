"""The README and the docs it links to name only files that exist, and the README stays short."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]
TOP = ("tasks/", "training/", "evaluation/", "benchmarks/", "notebooks/", "tests/", "docs/", "results/")


def named_paths(md: Path) -> set:
    """Relative links ](x) and backticked repo paths (`training/policy.py`, `grpo.py`) of a markdown file,
    resolved against the repo root (backticks) or the file's folder (links)."""
    text, out = md.read_text(), set()
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not link.startswith(("http://", "https://")):
            out.add((md.parent / link).resolve())
    for tok in re.findall(r"`([A-Za-z0-9_./-]+)`", text):
        if tok.startswith(TOP) or re.fullmatch(r"[a-z_]+\.py", tok):
            out.add((ROOT / tok.split(":")[0]).resolve())
    return out


def test_every_named_file_exists():
    missing = [f"{md.relative_to(ROOT)}: {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}"
               for md in DOCS for p in sorted(named_paths(md)) if not p.exists()
               and not p.is_relative_to(ROOT / "runs")]
    assert missing == []


def test_named_paths_reads_links_and_backticks(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("see [a](docs/a.md#top), `training/policy.py`, `grpo.py`, `--flag`, [w](https://x.org)")
    assert named_paths(md) == {(tmp_path / "docs/a.md").resolve(), (ROOT / "training/policy.py").resolve(),
                               (ROOT / "grpo.py").resolve()}


def test_readme_is_short_and_opens_with_the_three_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert [x.split("#")[0].split()[:2] for x in block] == [["pip", "install"], ["python", "grpo.py"],
                                                           ["python", "-m"]]
