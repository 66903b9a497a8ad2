"""Every file under benchmarks/ keeps working: each runs here in its quickest form (a tiny model, one round,
one step, a few tokens) as a subprocess of its real command line, and the test asserts that it finished and
that what it measures was real work, read from its own output (rows trained, tokens generated, completions
graded), never its figures. A benchmark that needs CUDA runs its refusal line on the CPU.

Select them: python -m pytest -q -m benchmark      (or -k benchmark; the slowest is marked slow)
A new file under benchmarks/ without a smoke test here fails test_every_benchmark_has_a_smoke_test.
"""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_figures  # noqa: E402
import gpu_report  # noqa: E402

TINY = ["--model", "tiny-qwen3"]
SMOKED = set()
pytestmark = pytest.mark.benchmark


def smoke(name):
    """Registers the decorated test as benchmarks/`name`'s smoke test."""
    SMOKED.add(name)
    return lambda test: test


def bench(name, *argv, timeout=600):
    """benchmarks/`name` run as a user runs it (one thread, no hub); its CompletedProcess."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{name}", *map(str, argv)],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=timeout,
        env=subprocess_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
    )


def read_by_goals(part, figures):
    """Whether gpu_report.py's goals read `part`'s figures: each of its goals says met or short."""
    verdicts = gpu_figures.goals([{"part": part, "figures": figures}])
    said = [v for g, (_, _, v) in zip(gpu_figures.GOALS, verdicts, strict=True) if g.part == part]
    return bool(said) and set(said) <= {"met", "short"}


def finished(p):
    assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@smoke("credit_overhead.py")
def test_credit_overhead_benchmark(tmp_path):
    """One signal, one round, one step of grpo.py with the toy reward: the step generated tokens and trained
    every row (grpo.py's own metrics, as the benchmark read them)."""
    out = finished(
        bench(
            "credit_overhead.py",
            "--every-row-trained",
            "--signals",
            "flow",
            "--rounds",
            1,
            "--steps",
            1,
            "--warmup",
            0,
            "--json",
            tmp_path / "o.json",
            *TINY,
            "--device",
            "cpu",
            "--max-new-tokens",
            4,
            "--prompts-per-step",
            1,
            "--group-size",
            2,
        )
    )
    (m,) = json.loads((tmp_path / "o.json").read_text())["rows"]["flow"]
    assert m["rows/trained"] == 2 and m["gen/tokens"] > 0, m
    assert "round 1: flow" in out


@smoke("flow_speed.py")
def test_flow_speed_benchmark():
    """The vectorised flow and the loop reference, both at T = 16 (the loop run at T itself, not scaled)."""
    out = finished(bench("flow_speed.py", "--sizes", 16))
    assert re.search(r"^\s+16\s+\S+\s+\S+\s+16\s+\S+x$", out, re.M), out


@smoke("generate_speed.py")
def test_generate_speed_benchmark(tmp_path):
    """The GPU table's decoders at the tiny shape on the CPU (the engine eagerly, HF dynamic, HF static):
    each generated tokens in the timed round, and the greedy rows were compared (8 rows); gpu_report.py
    reads its JSON."""
    finished(
        bench(
            "generate_speed.py",
            "--device",
            "cpu",
            "--engine",
            *TINY,
            "--shape",
            "tiny",
            "--rounds",
            1,
            "--json",
            tmp_path / "g.json",
        )
    )
    res = json.loads((tmp_path / "g.json").read_text())
    assert set(res["tokens"]) == {"engine", "HF dynamic", "HF static"}, res["tokens"]
    assert all(t[0] > 0 for t in res["tokens"].values()) and res["rows"] == 8
    assert set(res["equal"]["float32"]) == set(res["tokens"])
    shutil.copy(tmp_path / "g.json", tmp_path / "static.json")
    f = gpu_figures.decoder_figures("static")(tmp_path, "")
    assert set(f["engine_x"]) == {"HF dynamic", "HF static"} and f["rows"] == 8 and read_by_goals("static", f)


@smoke("decode_ops.py")
def test_decode_ops_benchmark():
    """One decode step of the tiny Qwen3 at 4 rows, both steps counted: the fused step dispatches fewer
    operators than the model's own, and 3 matmuls a layer fewer (Q, K, V and gate, up merged), the layer
    count read from the benchmark's own table."""
    out = finished(bench("decode_ops.py", "--models", "tiny-qwen3", "--rows", 4))
    rows = {
        m.group(1): [int(m.group(i)) for i in (2, 3, 4)]
        for m in re.finditer(r"^tiny-qwen3\s+(model|fused)\s+(\d+)\s+(\d+)\s+\d+\s+(\d+)", out, re.M)
    }
    (layers, ops, mm), (_, fused_ops, fused_mm) = rows["model"], rows["fused"]
    assert fused_ops < ops and fused_mm == mm - 3 * layers, out


@smoke("decode_speed.py")
def test_decode_speed_benchmark(tmp_path):
    """The decoders' table on the CPU at the tiny shape (the engine eagerly, HF dynamic, HF static): each
    generated tokens in the timed round and its greedy rows were compared (8 rows)."""
    finished(
        bench(
            "decode_speed.py",
            "--device",
            "cpu",
            *TINY,
            "--shape",
            "tiny",
            "--rounds",
            1,
            "--json",
            tmp_path / "d.json",
        )
    )
    res = json.loads((tmp_path / "d.json").read_text())
    assert set(res["tokens"]) == {"engine", "HF dynamic", "HF static"} and res["rows"] == 8
    assert all(t[0] > 0 for t in res["tokens"].values()) and res["bound_tok_s"] > 0


@smoke("attention_memory.py")
def test_attention_memory_benchmark(tmp_path):
    """One forward of 48 tokens three ways on the CPU: each peak measured, the capture's extra below
    eager's (one (b, T, T) map against every layer's)."""
    finished(
        bench("attention_memory.py", *TINY, "--device", "cpu", "--tokens", 48, "--json", tmp_path / "a.json")
    )
    (a,) = json.loads((tmp_path / "a.json").read_text())["results"]
    assert a["tokens"] == 48 and all(a["peak"][k] > 0 for k in ("plain", "capture", "eager"))
    assert 0 < a["extra"]["capture"] < a["extra"]["eager"]


@smoke("engine_release.py")
def test_engine_release_benchmark(tmp_path):
    """The CPU's eager engine released and made again: its K, V buffers counted, the short call timed
    resident and right after the release, with no graph (eager)."""
    out = finished(
        bench(
            "engine_release.py",
            *TINY,
            "--device",
            "cpu",
            "--max-new-tokens",
            4,
            "--prompt-tokens",
            8,
            "--prompts-per-step",
            1,
            "--group-size",
            2,
            "--gen-chunk",
            2,
            "--json",
            tmp_path / "e.json",
        )
    )
    e = json.loads((tmp_path / "e.json").read_text())["result"]
    assert "engine release" in out and e["eager"] and e["call_s"] > 0 and e["released_s"] > 0
    assert e["bytes"] > 0


@smoke("gpu_headline.py")
def test_gpu_headline_benchmark(tmp_path):
    """Its CPU form at one small budget, one round: every row generated to the budget and every phase of a
    real step measured (tests/benchmarks/test_gpu_headline.py checks the numbers themselves); gpu_report.py
    reads its JSON."""
    finished(
        bench(
            "gpu_headline.py",
            *TINY,
            "--device",
            "cpu",
            "--max-new-tokens",
            4,
            "--prompt-tokens",
            8,
            "--prompts-per-step",
            1,
            "--group-size",
            2,
            "--micro-batch",
            2,
            "--gen-chunk",
            2,
            "--rounds",
            1,
            "--json",
            tmp_path / "h.json",
        )
    )
    (r,) = json.loads((tmp_path / "h.json").read_text())["results"]
    assert r["rows"] == 2 and r["generation"]["tokens"] == 2 * 4
    assert set(r["memory"]) == {"generation", "update forward", "credit", "backward", "optimizer step"}
    shutil.copy(tmp_path / "h.json", tmp_path / "headline.json")
    f = gpu_figures.step_figures("headline")(tmp_path, "")
    assert f["rows"] == 2 and set(f["memory"]) == set(r["memory"]) and f["step_s"] > 0
    assert read_by_goals("headline", f)


@smoke("lora_speed.py")
def test_lora_speed_benchmark():
    """Both arms' update and generation, two rounds (the first is warm-up): every row trained."""
    out = finished(
        bench(
            "lora_speed.py",
            "--rounds",
            2,
            "--",
            *TINY,
            "--device",
            "cpu",
            "--max-new-tokens",
            4,
            "--prompts-per-step",
            1,
            "--group-size",
            4,
        )
    )
    trained, rows = map(int, re.search(r"(\d+) of (\d+) rows trained", out).groups())
    assert trained == rows == 4 and re.search(r"^lora-8 / full: update", out, re.M), out


@smoke("peer_trl.py")
@pytest.mark.slow
def test_peer_trl_benchmark(tmp_path):
    """The four configurations (grpo.py none and flow, TRL stock and with FlowTracer), one round, one step
    each, with the toy reward: every run trained all its rows and generated tokens. TRL's stock arm takes
    whatever flowtracer_trl.main passes its trainer."""
    for m in ("trl", "datasets"):
        pytest.importorskip(m, reason=f"peer_trl.py needs {m}: pip install -r requirements.txt")
    out = finished(
        bench(
            "peer_trl.py",
            "--every-row-trained",
            "--rounds",
            1,
            "--steps",
            1,
            "--warmup",
            0,
            "--prompts",
            1,
            "--tokens",
            4,
            *TINY,
            "--json",
            tmp_path / "p.json",
        )
    )
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert set(rows) == {"grpo:none", "grpo:flow", "trl:stock", "trl:flow"}
    for label, ((_, tokens, _, trained),) in rows.items():
        assert trained == 4 and tokens > 0, (label, rows[label])
    assert re.search(r"load \d+\.\d-\d+\.\d", out), out


@smoke("reward_speed.py")
def test_reward_speed_benchmark():
    """20 completions graded by each reward (the offline copies, or the arithmetic task without them)."""
    out = finished(bench("reward_speed.py", "--n", 20, "--budget", 600))
    for name in ("math", "countdown", "choice"):
        assert re.search(rf"^{name}\s*: 20 completions in", out, re.M), out


@smoke("gpu_figures.py")
def test_gpu_figures_benchmark(tmp_path):
    """A report's goals judged again from its report.jsonl: the device line, then one line per goal, the
    suite's read from its figures (met: 0 failed); a file that is no report is one error line, exit 2."""
    suite = {"all": {"passed": 3}, "cuda": {"passed": 1}}
    lines = [
        {"part": "device", "status": "ok", "device": "a card", "date": "2026-11-28"},
        {"part": "suite", "status": "ok", "figures": suite, "log": "suite.log"},
    ]
    report = tmp_path / "report.jsonl"
    report.write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = bench("gpu_figures.py", report)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0] == "a card, 2026-11-28" and len(out) == 2 + len(gpu_figures.GOALS), p.stdout
    assert any("the suite on CUDA with 0 failed" in s and s.endswith("met") for s in out), p.stdout
    assert sum(s.endswith("not run (--parts)") for s in out) == len(gpu_figures.GOALS) - 1, p.stdout
    report.write_text("{}\n")
    p = bench("gpu_figures.py", report)
    assert p.returncode == 2 and "not a report of gpu_report.py" in p.stderr and "Traceback" not in p.stderr


@smoke("gpu_report.py")
def test_gpu_report_benchmark(tmp_path):
    """Without CUDA: one line saying it needs CUDA, exit 2. With CUDA: --budget 1 cuts every part, each with
    its JSON line (the report itself runs for an hour)."""
    p = bench("gpu_report.py", "--out", tmp_path / "r", "--budget", 1)
    if not torch.cuda.is_available():
        assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
        assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "needs CUDA" in p.stderr, p.stderr
        return
    finished(p)
    lines = [json.loads(s) for s in (tmp_path / "r" / "report.jsonl").read_text().splitlines()]
    head, parts = lines[0], lines[1:]
    assert head["part"] == "device" and [x["status"] for x in parts] == ["cut"] * len(gpu_report.PARTS)


def test_every_benchmark_has_a_smoke_test():
    assert SMOKED == {p.name for p in (ROOT / "benchmarks").glob("*.py")}
