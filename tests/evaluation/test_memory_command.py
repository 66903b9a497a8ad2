"""`eval.py memory` (evaluation/memory.py): the estimate's table for grpo.py's flags, a GPU's step planned
from any machine (--gpu-gb), the plan and its layout under LoRA on a 24 GB card, the T4 plan under --precision
fp16, the disk a checkpoint needs, and the LoRA runs grpo.py refuses refused alike."""

import pytest
from conftest import ROOT

import eval as ev
import grpo
from evaluation import memory
from training.memory import budget, phases, shapes


def test_eval_memory_command(in_process):
    import eval as ev

    run = lambda *a: in_process(ev.main, "memory", *a)  # noqa: E731  `python eval.py memory a`, in-process
    p = run("--model", "qwen3-4b-random")
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("peak") and "GB" in last and float(last.split()[1]) <= 70
    p = run("--model", "qwen3-4b-random", "--micro-batch", "-1")  # 0: sized
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("grpo.py: error: --micro-batch")
    p = run("--model", "tiny-qwen3", "--snapshot", "x.pickle")  # no --measure, no GPU here
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--snapshot" in p.stderr
    assert not (ROOT / "x.pickle").exists()


def test_eval_memory_plans_with_gpu_gb_on_any_machine(monkeypatch, capsys):
    """eval.py memory takes grpo.py's flags to plan a GPU's step from any machine: --gpu-gb takes effect."""
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--gpu-gb", "24"], for_gpu=True)  # eval.py memory's
    assert cfg.gpu_gb == 24 and capsys.readouterr().err == ""
    grpo.parse_args(["--model", "tiny-qwen3", "--gpu-gb", "24", "--device", "cpu"])  # a run on the CPU
    assert "--gpu-gb has no effect" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--lora-targets", "no_such_proj"],
            "--lora-targets no_such_proj: no module of a qwen3 model is called",
        ),
        (["--lora-rank", str(2**40)], f"--lora-rank {2**40} is more than any adapted layer's rank"),
    ],
)
def test_eval_memory_estimates_no_lora_run_grpo_py_refuses(capsys, argv, words):
    """It estimated a run without adapters (a target that names nothing) or of 4.5e10 GB (a rank past every
    layer's). A target outside the decoder layers (lm_head) is a module: estimated, not refused."""
    with pytest.raises(SystemExit) as e:
        ev.main(["memory", "--model", "tiny-qwen3", "--lora-rank", "4", *argv])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and line.startswith("eval.py: error: ") and words in line, line
    ev.main(["memory", "--model", "tiny-qwen3", "--lora-rank", "4", "--lora-targets", "lm_head"])


def test_eval_memory_prints_the_table_of_the_plan_and_its_layout():
    """`eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24`: the table is the plan's
    (gen_chunk 32, micro_batch 8), the engine resident, and the line says what releasing it would free (its
    cache and its copies of the weights)."""
    cfg = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--gpu-gb", "24"])
    out = memory.report(cfg, 256).splitlines()
    planned = type(cfg)(**{**vars(cfg), "gen_chunk": 32, "micro_batch": 8})
    mc = phases.model_config(cfg.model)
    kept, freed = (phases.estimate(planned, mc, "cuda", 256, release=r)["backward"] for r in (False, True))
    cache, copy = kept["KV cache"], kept["weights"] - freed["weights"]  # its K, V; its copied weights
    assert out[0].startswith("precision: bf16")  # the card's precision, then the table
    assert "gen_chunk 32, micro_batch 8, logprob_chunk 128, the plan for 24 GB (GB)" in out[1]
    assert out[3].split()[0] == "generation" and float(out[3].split()[5]) == round(
        phases.estimate(planned, mc, "cuda", 256)["generation"]["KV cache"] / budget.GB, 2
    )
    line = next(x for x in out if x.startswith("engine:"))
    assert line.startswith("engine: resident through the update")
    assert f"{(cache + copy) / budget.GB:.2f} GB less" in line and copy > 0
    assert any("grpo.py picks gen_chunk 32, micro_batch 8, the engine resident" in x for x in out)


def test_eval_memory_prints_the_t4_plan_under_14_5_gb(capsys):
    """`eval.py memory --model qwen3-4b-random --precision fp16 --gpu-gb 16 --lora-rank 16`: the plan for a
    16 GB T4 (15.8e9 bytes exposed) has its peak, the margin included, at most 14.5 GB; --capability 7.5
    without --precision picks fp16 itself and prints the same plan."""
    import re

    import eval as ev

    lines = {}
    for extra in (["--precision", "fp16"], ["--capability", "7.5"]):
        ev.main(["memory", "--model", "qwen3-4b-random", *extra, "--gpu-gb", "16", "--lora-rank", "16"])
        out = capsys.readouterr().out
        assert out.splitlines()[0].startswith("precision: fp16")
        plan = re.search(
            r"picks gen_chunk (\d+), micro_batch (\d+), the engine \w+, for --gpu-gb 16 \([^;]*; "
            r"([\d.]+) GB at its peak with the margin",
            out,
        )
        assert plan and float(plan.group(3)) <= 14.5, out
        lines[extra[0]] = plan.groups()
    assert lines["--precision"] == lines["--capability"]
    with pytest.raises(SystemExit) as e:
        ev.main(["memory", "--model", "qwen3-4b-random", "--capability", "75"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("eval.py: error: --capability must be")


def test_eval_memory_names_the_disk_a_checkpoint_needs(capsys):
    import eval as ev

    ev.main(["memory", "--model", "qwen3-4b-random"])
    out = capsys.readouterr().out.splitlines()
    n = shapes.param_counts(phases.model_config("qwen3-4b-random"))[0]
    disk = [x for x in out if x.startswith("disk:")]
    assert len(disk) == 1 and f"{n * 8 / 1e9:.2f} GB" in disk[0] and out[-1].startswith("peak"), disk
