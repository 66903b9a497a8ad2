"""benchmarks/gpu_report.py on the CPU: its parts run in the table's order, each under its own time limit (a
part that hangs is killed at its limit, with the processes it started, and the next part runs), each leaving
its log and its JSON line as it ends; --budget cuts the parts that do not fit, whole; without CUDA it is one
line. The real parts need CUDA: their figures are read from what the benchmarks write (tests/
benchmarks/test_benchmarks.py feeds the CPU runs' JSON to the same readers)."""

import json
import os
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_figures  # noqa: E402
import gpu_report  # noqa: E402
from gpu_report import Part  # noqa: E402

PY = sys.executable


def code(src):
    return lambda out, tmp: [PY, "-c", textwrap.dedent(src).replace("OUT", str(out))]


def nothing(out, log):
    return None


HANG = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open("OUT/child.pid", "w").write(str(child.pid))
    print("hanging", flush=True)
    import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf to SIGTERM: SIGKILL takes it
    time.sleep(60)
"""
TESTS = """
import pytest
def test_passes(): pass
def test_fails(): assert False
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on(device):
    if device == "cuda": pytest.skip("no CUDA")
"""


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone
        return f.read().split(") ")[1][0] != "Z"


def test_parts_run_in_order_under_their_limits_and_a_hang_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_report, "GRACE_S", 1)
    monkeypatch.setattr(gpu_report, "SUITE_S", 60)
    monkeypatch.setattr(gpu_report, "SUITE_MIN_S", 5)
    (tmp_path / "test_fake.py").write_text(TESTS)
    suite = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_fake.py")]
    out = tmp_path / "report"
    parts = [
        Part(
            "first",
            30,
            code("print('preflight: head-mean kernel ran on cuda in 1.5 s')"),
            gpu_figures.preflight_figures,
        ),
        Part("hangs", 1, code(HANG), nothing),
        Part("fails", 30, code("import sys; print('boom'); sys.exit(3)"), nothing),
        Part("too-long", 10_000, code("print('never')"), nothing),
        Part(
            "suite",
            None,
            lambda out, tmp: [*suite, f"--junitxml={out / 'suite.xml'}"],
            gpu_figures.suite_figures,
        ),
    ]
    t0 = time.monotonic()
    recs = gpu_report.run(parts, out, budget=300)
    took = time.monotonic() - t0
    lines = [json.loads(s) for s in (out / "report.jsonl").read_text().splitlines()]
    assert [r["part"] for r in lines] == [p.name for p in parts] and lines == json.loads(json.dumps(recs))
    assert [r["status"] for r in lines] == ["ok", "killed", "failed", "cut", "failed"]
    first, hang, fails, cut, ran = lines
    assert first["figures"] == {
        "lines": ["preflight: head-mean kernel ran on cuda in 1.5 s"],
        "preflight_s": 1.5,
    }
    assert hang["limit_s"] == 1 and 1 <= hang["seconds"] < 1 + 1 + 5  # its limit, then GRACE_S to SIGKILL
    assert "hanging" in (out / "hangs.log").read_text() and hang["tail"][-1] == "hanging"
    assert not alive(int((out / "child.pid").read_text()))  # its process group went with it
    assert fails["rc"] == 3 and "boom" in fails["tail"]
    assert cut["why"].startswith("cut: no time left") and not (out / "too-long.log").exists()
    assert 5 <= ran["limit_s"] <= 60  # the suite: the time left, at most SUITE_S
    assert ran["figures"] == {"all": {"passed": 2, "failed": 1, "skipped": 1}, "cuda": {"skipped": 1}}
    assert took < 60


def test_budget_cuts_whole_parts_and_the_suite_takes_what_is_left(tmp_path, monkeypatch):
    """Nothing is shrunk: a part whose limit exceeds the time left is cut, the ones after it still run
    when theirs fit; under SUITE_MIN_S left, the suite is cut too."""
    monkeypatch.setattr(gpu_report, "SUITE_MIN_S", 50)
    parts = [
        Part("a", 3, code("import time; time.sleep(2)"), nothing),
        Part("b", 20, code("print('b')"), nothing),
        Part("c", 5, code("print('c')"), nothing),
        Part("suite", None, code("print('suite')"), nothing),
    ]
    recs = gpu_report.run(parts, tmp_path, budget=12)
    assert [r["status"] for r in recs] == ["ok", "cut", "ok", "cut"]
    assert "needs 20 s" in recs[1]["why"] and "needs 50 s" in recs[3]["why"]
    recs = gpu_report.run(parts[:2], tmp_path / "x", budget=12, given={"b": 4})  # --limit b=4 fits
    assert [r["status"] for r in recs] == ["ok", "ok"] and recs[1]["limit_s"] == 4


def test_main_refuses_without_cuda_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_report.main(["--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert (
        e.value.code == 2
        and len(err.splitlines()) == 1
        and err.startswith("gpu_report.py: error: needs CUDA")
    )
    assert not (tmp_path / "r").exists()
    for bad in (["--limit", "nosuch=3"], ["--limit", "suite=-1"], ["--budget", "0"], ["--parts", "x"]):
        with pytest.raises(SystemExit) as e:
            gpu_report.main(bad)
        assert e.value.code == 2 and "gpu_report.py: error:" in capsys.readouterr().err


def test_main_writes_the_device_line_then_each_part_and_the_goals(monkeypatch, capsys, tmp_path):
    """With CUDA faked and the table replaced: the header line, each part's line, the goals (a part not run
    says so), exit 1 when a part failed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_report, "device_line", lambda: "Fake GPU 24.0 GB, torch x")
    monkeypatch.setattr(
        gpu_report,
        "PARTS",
        [
            Part("headline", 30, code("import sys; sys.exit(1)"), nothing),
            Part("suite", None, code("print(1)"), nothing),
        ],
    )
    with pytest.raises(SystemExit) as e:
        gpu_report.main(["--out", str(tmp_path), "--parts", "headline", "--budget", "100"])
    text = capsys.readouterr().out
    lines = [json.loads(s) for s in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert e.value.code == 1 and [r["part"] for r in lines] == ["device", "headline"]
    assert lines[0]["device"] == "Fake GPU 24.0 GB, torch x" and lines[0]["budget_s"] == 100
    verdicts = {g: v for g, _, v in gpu_figures.goals(lines[1:])}
    assert verdicts["the 1K step of 128 rows <= 45 s"] == "failed: no figure (its log: headline.log)"
    assert verdicts["the suite on CUDA with 0 failed"] == "not run (--parts)"
    assert "the LoRA step under 24 GB" in text and "not run (--parts)" in text


def test_every_real_part_runs_a_command_line_its_program_accepts(tmp_path, monkeypatch, capsys):
    """The table's commands, parsed by their own programs in this process: grpo.py's flags by grpo.parse_args
    (with --device cpu); the benchmarks' stop at their CUDA check (after every flag is parsed: an unknown one
    would be "unrecognized arguments"); pytest's suite names the tests folder."""
    import generate_speed
    import gpu_headline

    import eval as evaluate
    import grpo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mains = {
        "benchmarks/gpu_headline.py": gpu_headline.main,
        "benchmarks/generate_speed.py": generate_speed.main,
        "eval.py": evaluate.main,  # eval.py memory: grpo.py's --device cuda, checked as it parses
    }
    seen = set()
    for part in gpu_report.PARTS:
        argv = part.command(tmp_path, tmp_path)
        assert argv[0] == sys.executable, part.name
        if argv[1] == "grpo.py":
            on_cpu = ["cpu" if a == "cuda" else a for a in argv[2:]]  # grpo.py checks the device as it parses
            cfg = grpo.parse_args(on_cpu)
            assert cfg.model == "qwen3-4b-random" and not cfg.save_optimizer
            assert argv[argv.index("--device") + 1] == "cuda"
        elif argv[1] in mains:
            with pytest.raises(SystemExit) as e:
                mains[argv[1]](argv[2:])
            err = capsys.readouterr().err
            assert e.value.code == 2 and "--device cuda: no GPU is visible" in err, (part.name, err)
        else:
            assert argv[1:4] == ["-m", "pytest", "-q"] and "tests" in argv, part.name
        seen.add(part.name)
    assert seen == set(gpu_report.LIMITS)


@pytest.mark.parametrize("run", sorted(p.name for p in (ROOT / "results").glob("gpu-*/run-*")))
def test_the_kept_gpu_reports_are_read_as_they_were_written(run):
    """The GPU reports kept under results/ (docs/gpu.md quotes them) are read by today's readers as they were
    when they ran: each finished part's figures, read again from its log and JSON, equal those in its line of
    report.jsonl, and gpu_figures.py judges every goal of a part that ran."""
    folder = next((ROOT / "results").glob(f"gpu-*/{run}"))
    lines = [json.loads(s) for s in (folder / "report.jsonl").read_text().splitlines()]
    assert lines[0]["part"] == "device" and "GB" in lines[0]["device"]
    parts, ok = {p.name: p for p in gpu_report.PARTS}, [r for r in lines[1:] if r["status"] == "ok"]
    assert ok, f"{run}: no part finished"
    for rec in ok:
        again = parts[rec["part"]].figures(folder, (folder / rec["log"]).read_text(errors="replace"))
        assert json.loads(json.dumps(again)) == rec["figures"], rec["part"]
    finished = {r["part"] for r in ok}
    judged = [
        v for g, (_, _, v) in zip(gpu_figures.GOALS, gpu_figures.goals(lines[1:])) if g.part in finished
    ]
    assert judged and all(v in ("met", "short") for v in judged), judged
