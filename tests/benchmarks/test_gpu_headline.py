"""benchmarks/gpu_headline.py: the one-GPU headline runs end to end on the CPU (tiny-qwen3, small shapes),
every number it reports is real, and the bandwidth bound matches a hand count."""

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_speed  # noqa: E402
import gpu_headline  # noqa: E402

SMALL = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--max-new-tokens",
    "8",
    "24",
    "--prompt-tokens",
    "12",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--micro-batch",
    "2",
    "--gen-chunk",
    "4",
    "--rounds",
    "2",
]


def real(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_headline_runs_on_the_cpu_and_reports_real_numbers(tmp_path, in_process):
    out = tmp_path / "headline.json"
    p = in_process(gpu_headline.main, *SMALL, "--json", out)  # `python benchmarks/gpu_headline.py ...`
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    assert [r["max_new_tokens"] for r in res] == [8, 24]
    for r in res:
        for ph, m in r["memory"].items():
            assert real(m["estimate"]) and real(m["allocated"]) and m["reserved"] is None  # no pool on CPU
            assert m["ratio"] == m["estimate"] / m["allocated"] and 0.5 < m["ratio"] < 2, (ph, m)
        o = r["overhead"]
        assert all(real(o[k]) for k in ("generate_s", "update_none_s", "update_flow_s"))
        step_none = o["generate_s"] + o["update_none_s"]
        assert o["fraction"] == (o["update_flow_s"] - o["update_none_s"]) / step_none
        g = r["generation"]
        assert g["tokens"] == 4 * r["max_new_tokens"]  # every row ran to the budget
        assert real(g["tok_s"]) and real(g["bound_tok_s"]) and g["of_bound"] == g["tok_s"] / g["bound_tok_s"]
        e = r["rereserve"]  # the CPU's eager engine, made again
        assert r["engine"] == "-" and e["eager"] and e["graphs"] is None and e["captures"] >= 1
        assert real(e["reserve_s"]) and real(e["call_s"]) and real(e["released_s"])
        assert e["bytes"] == 2 * 4 * 4 * 2 * 64 * 16 * 4  # K, V: 4 layers, 4 rows, 2 heads, 64 x 16, fp32
    assert "attention" not in res[0]  # the maps: at the largest budget only
    a = res[1]["attention"]
    assert a["tokens"] == 12 + 24 and all(real(a["peak"][k]) for k in ("plain", "capture", "eager"))
    assert 0 < a["extra"]["capture"] < a["extra"]["eager"]  # one (b, T, T) map vs every layer's
    assert a["extra"]["capture"] >= a["capture_maps_bytes"]
    assert "out of memory" not in p.stdout and p.stdout.count("estimate/allocated") == 2


def test_bad_flags_are_one_line(capsys):
    for flags, msg in (
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--group-size", "1"], "--group-size must be >= 2"),
        (["--bandwidth", "nan"], "--bandwidth must be a positive"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--nope"], "error:"),
    ):
        with pytest.raises(SystemExit) as e:
            gpu_headline.main([*SMALL, *flags])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and err.startswith("gpu_headline.py: error:") and msg in err, err


def test_bandwidth_bound_by_hand():
    """1 layer, 1 KV head of dim 1, fp32 (8 bytes of K and V per token), 40 bytes of weights; 2 rows in one
    chunk, prompt 3, 2 new tokens: steps read 40 + 2*8*3 and 40 + 2*8*4 bytes, 192 in all, for 4 tokens."""
    model = SimpleNamespace(
        config=SimpleNamespace(head_dim=1, num_hidden_layers=1, num_key_value_heads=1),
        device=torch.device("cpu"),
        dtype=torch.float32,
        parameters=lambda: [torch.zeros(10)],
    )
    cfg = SimpleNamespace(max_new_tokens=2, prompts_per_step=1, group_size=2, gen_chunk=2)
    assert decode_speed.bandwidth_bound(model, cfg, 3, bandwidth=192.0) == 4.0


def test_quick_measures_the_overhead_alone_at_full_width(tmp_path, in_process):
    """--quick: short rollouts padded to R, the update timed with and without flow; no memory step, no
    generation speed, no maps. The help names the time of both modes."""
    out = tmp_path / "quick.json"
    p = in_process(gpu_headline.main, *SMALL, "--quick", "--quick-tokens", "3", "--json", out)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["args"]["prompts_per_step"] == 2 and [r["max_new_tokens"] for r in res["results"]] == [8, 24]
    for r in res["results"]:
        assert not {"memory", "generation", "attention"} & r.keys(), r.keys()
        o = r["overhead"]
        assert o["response_tokens"] == r["max_new_tokens"]  # the update reads R tokens a row
        assert real(o["update_none_s"]) and real(o["update_flow_s"]) and o["fraction"] is None
        assert o["of_update"] == (o["update_flow_s"] - o["update_none_s"]) / o["update_none_s"]
    assert p.stdout.count("% of the update") == 2 and "estimate/allocated" not in p.stdout
    h = in_process(gpu_headline.main, "--help").stdout
    assert "--quick" in h and "2 hours" in h and "10 minutes" in h
