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
    missing = [
        f"{md.relative_to(ROOT)}: {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}"
        for md in DOCS
        for p in sorted(named_paths(md))
        if not p.exists() and not p.is_relative_to(ROOT / "runs")
    ]
    assert missing == []


def test_named_paths_reads_links_and_backticks(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("see [a](docs/a.md#top), `training/policy.py`, `grpo.py`, `--flag`, [w](https://x.org)")
    assert named_paths(md) == {
        (tmp_path / "docs/a.md").resolve(),
        (ROOT / "training/policy.py").resolve(),
        (ROOT / "grpo.py").resolve(),
    }


def test_readme_is_short_and_opens_with_the_three_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert [x.split("#")[0].split()[:2] for x in block] == [
        ["pip", "install"],
        ["python", "grpo.py"],
        ["python", "-m"],
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[2].split("#")[0].strip() in ci.splitlines(), "CI runs the README's test command"


def test_requirements_ask_only_for_extras_their_packages_provide():
    """pip warned "math-verify 0.9.0 does not provide the extra 'antlr4_13_2'": it spells its extras
    antlr4-13-2, and a fresh venv's pip (23.2) compares them as written. Every extra asked for is one the
    installed distribution declares (Provides-Extra), spelled as it declares it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    reqs = [
        Requirement(line.split("#")[0])
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    missing = [
        f"{r.name}[{x}]"
        for r in reqs
        for x in sorted(r.extras)
        if x not in (metadata.distribution(r.name).metadata.get_all("Provides-Extra") or [])
    ]
    assert missing == []
    assert "math-verify" in {r.name for r in reqs}


def test_learn_writes_under_runs_and_the_committed_grid_names_its_directory():
    """`eval.py learn` writes into runs/learn/ (git ignores runs/), not into the tracked results/learn/; the
    commands and the report of the committed grid name --out-dir results/learn."""
    from evaluation import learn

    assert Path(learn.LearnConfig.out_dir).parts[0] == "runs" and "runs/" in (ROOT / ".gitignore").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "results" / "README.md").read_text(), re.S)
    committed = [b.replace("\\\n", " ") for b in blocks if "eval.py learn" in b][0]  # the CPU grid's
    assert "--out-dir results/learn " in committed
    report = (ROOT / "results" / "learn" / "learn.md").read_text().splitlines()
    assert "--out-dir `results/learn`" in report[0]
