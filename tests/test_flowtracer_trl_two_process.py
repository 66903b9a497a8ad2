"""flowtracer_trl.py on TRL 1.16 in 2 processes (skipped without trl: pip install -r requirements.txt): a
real 2-process `accelerate launch` run (gloo) of the tiny random Qwen3 where one rank has only A = 0 enters
the same collectives on both ranks and applies a single process's gamma, on both passes, and three mutated
gammas fail that check. The driver's stand-ins and the reference gamma come from
tests/test_flowtracer_trl.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ABSENT = "TRL's plug-in needs {}: pip install -r requirements.txt"
Dataset = pytest.importorskip("datasets", reason=ABSENT.format("datasets")).Dataset
trl = pytest.importorskip("trl", reason=ABSENT.format("trl"))

from test_flowtracer_trl import assert_loss_read, reference_gamma  # noqa: E402

import grpo  # noqa: E402
from training.model.load import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- 2 processes
# The real command line under `accelerate launch`, run once with five scenarios in the same two processes,
# with two test stand-ins: the toy reward (data.reward; 0 for every row of rank 1, so that rank has only
# A = 0) and the \boxed{} answer appended to each completion. Each rank writes, per scenario, the
# collectives it entered (the credit's unwrap, summon_full_params, gather, and baselines.assign, whose forward
# is collective under FSDP), TRL's own A and the advantages its loss read (spy). Scenarios three to five
# mutate the gamma baselines.assign returns on rank 0.
DRIVER = """import contextlib, json, os, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
import data, flowtracer_trl as ft, test_flowtracer_trl
from training.credit import baselines
RANK, OUT = int(os.environ["RANK"]), {out!r}
data.reward = lambda txt, rec: 0.0 if RANK == 1 else test_flowtracer_trl.toy_reward(None, [txt])[0]
MUTATIONS = {{"shift": lambda g: g.roll(1, -1), "swap": lambda g: g.flip(0), "ones": torch.ones_like}}
entered, mutation = [], [None]
rec = test_flowtracer_trl.spy(setattr)
real_assign, real_unwrap = baselines.assign, ft.unwrap_model_for_generation


def assign(*a, **k):
    entered.append("assign")
    c = real_assign(*a, **k)
    return c._replace(weight=MUTATIONS[mutation[0]](c.weight)) if mutation[0] and RANK == 0 else c


@contextlib.contextmanager
def logged(name, context, *a, **k):
    entered.append(name)
    with context(*a, **k) as x:
        yield x


class Probe(ft.FlowTracerGRPOTrainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        test_flowtracer_trl.answer_everything(self)
        summon, gather = self._dist.summon_full_params, self.accelerator.gather
        self._dist.summon_full_params = lambda *a, **k: logged("summon", summon, *a, **k)
        self.accelerator.gather = lambda x: entered.append("gather") or gather(x)


baselines.assign, ft.FlowTracerGRPOTrainer = assign, Probe
ft.unwrap_model_for_generation = lambda *a, **k: logged("unwrap", real_unwrap, *a, **k)
for name, flags, mutation[0] in [("separate", ["--credit-pass", "separate"], None), ("fused", [], None),
                                 *[(m, ["--credit-pass", "separate"], m) for m in MUTATIONS]]:
    trainer = ft.main(sys.argv[1:] + flags + ["--output-dir", OUT + "/" + name])
    with open(OUT + f"/{{name}}-{{RANK}}.json", "w") as f:
        json.dump({{"fused": trainer.fused, "entered": entered, **rec}}, f)
    entered.clear(), rec["A"].clear(), rec["loss"].clear()
if torch.distributed.is_initialized():            # gloo's threads end before the interpreter does: a process
    torch.distributed.destroy_process_group()     # left to exit with them running may abort at teardown
"""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One `accelerate launch` of 2 CPU processes (gloo) running the five scenarios; a hang fails."""
    tmp = tmp_path_factory.mktemp("two")
    driver = tmp / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(tmp)))
    problems = tmp / "train.jsonl"  # 4 problems: not 10,000 prompts tokenized per scenario
    problems.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4)
        )
    )
    launch = [
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",  # torchrun, 2 ranks
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    flags = [
        "--use-cpu",
        "--bf16",
        "false",
        "--model",
        "tiny-qwen3",
        "--max-steps",
        "1",
        "--num-generations",
        "4",  # gloo
        "--per-device-train-batch-size",
        "4",
        "--max-completion-length",
        "8",
        "--learning-rate",
        "1e-3",
        "--warmup-steps",
        "0",
        "--save-strategy",
        "no",
        "--seed",
        "1",
        "--data-path",
        str(problems),
    ]
    try:
        p = subprocess.run(
            [sys.executable, *launch, str(driver), *flags],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 2-process run hung (killed after {e.timeout} s)")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return tmp


def check_two_process(out, name, cfg):
    """Both ranks entered the same collectives in the same order (and the credit's own); rank 1 had only
    A = 0, rank 0 some A != 0; every row TRL's loss read is A * a single process's gamma (A = 0: zero)."""
    ranks = [json.loads((out / f"{name}-{r}.json").read_text()) for r in (0, 1)]
    fused = ranks[0]["fused"]
    assert fused == ranks[1]["fused"] == (name == "fused")
    # the fused pass's baselines.assign reads the captured maps and runs no forward: not a collective there
    collectives = [[e for e in r["entered"] if not (fused and e == "assign")] for r in ranks]
    assert collectives[0] == collectives[1]
    assert {"gather", "assign", "unwrap", "summon"} <= set(collectives[0]) or fused
    assert not any(ranks[1]["A"].values()) and any(ranks[0]["A"].values())
    for r in ranks:
        assert set(r["loss"]) == set(r["A"]) and len(r["A"]) == 4
        keys = [k for k, a in r["A"].items() if a]  # the rank's credited rows, in order
        gamma = reference_gamma(keys, [r["A"][k] for k in keys], cfg) if keys else []
        assert_loss_read(r, keys, gamma)
        assert all(not any(r["loss"][k]) for k, a in r["A"].items() if not a)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["separate", "fused"])
def test_two_processes_one_rank_without_advantage_match_a_single_process(two_processes, name):
    check_two_process(two_processes, name, grpo.Config())
    metrics = [json.loads(line) for line in open(two_processes / name / "metrics.jsonl")]
    assert [m["credit/boosted_frac"] > 0 for m in metrics if "loss" in m] == [True]  # rank 0's tokens
    trained = load_model(str(two_processes / name), device="cpu", dtype=torch.float32)[0].state_dict()
    init = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)[0].state_dict()
    assert any(not torch.equal(trained[k], init[k]) for k in init)  # the parameters changed


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["shift", "swap", "ones"])
def test_the_two_process_check_catches_a_mutated_gamma(two_processes, mutation):
    """gamma one column off, rows swapped, or credit dropped on one rank: the run is fine, the check fails."""
    assert (two_processes / mutation / "metrics.jsonl").exists()
    with pytest.raises(AssertionError):
        check_two_process(two_processes, mutation, grpo.Config())
