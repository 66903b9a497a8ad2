"""A run's directory and its files: a moved run resumes where it is, a run that would do nothing says so, the
last K checkpoints are kept, a --config file replays a run; and flowtracer.Capture refuses what it cannot do
right (a second forward, a mask of another shape, no layer) while gradient checkpointing's replay still
works."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import grpo
from flowtracer import Capture, select_layers
from training import policy
from training.credit.attention import use_capture_attention
from training.model.load import load_model
from training.run import checkpoint as ckpt_io
from training.run import directory, log

SMOKE = [
    "--model",
    "tiny-qwen3",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
    "--micro-batch",
    "2",
]


@pytest.fixture
def run(in_process):
    """`python grpo.py args` as grpo.main(args) in this process (conftest.in_process): returncode, stderr."""
    return lambda *args: in_process(grpo.main, *args)


def steps_in(d):
    return [json.loads(line)["step"] for line in open(Path(d) / "metrics.jsonl")]


# ----------------------------------------------------------------------------- the run directory
def test_a_moved_run_resumes_in_its_new_directory(tmp_path, run):
    a, b = tmp_path / "a", tmp_path / "b"
    first = run(*SMOKE, "--steps", "2", "--out-dir", str(a))
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.move(a, b)
    second = run("--resume", str(b), "--steps", "3")
    assert second.returncode == 0, second.stderr[-2000:]
    assert not a.exists()  # nothing re-created where the run began
    assert steps_in(b) == [1, 2, 3]
    assert (b / "ckpt" / ckpt_io.MARK).read_text() == "3"
    assert json.loads((b / "ckpt" / ckpt_io.RUN_CONFIG).read_text())["out_dir"] == str(b)


def test_resume_refuses_another_out_dir(tmp_path, run):
    done = run(*SMOKE, "--steps", "1", "--out-dir", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = run("--resume", str(tmp_path / "a"), "--steps", "2", "--out-dir", str(tmp_path / "c"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1].startswith(
        "grpo.py: error: --resume continues the run in its own"
    )
    assert "Traceback" not in out.stderr and not (tmp_path / "c").exists()


def test_a_resume_with_nothing_to_run_says_so(tmp_path, run):
    done = run(*SMOKE, "--steps", "2", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    for steps in ("2", "1"):
        out = run("--resume", str(tmp_path), "--steps", steps)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1] == (
            f"grpo.py: error: --resume {tmp_path}: the run is at step 2 already and --steps is {steps}: "
            f"nothing to run (give --steps more than 2)"
        )
    assert steps_in(tmp_path) == [1, 2]


def test_keep_checkpoints_keeps_the_last_k(tmp_path, run):
    out = run(
        *SMOKE, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "3", "--out-dir", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
    assert kept == ["ckpt", "ckpt-00002", "ckpt-00003"]
    assert [(tmp_path / d / ckpt_io.MARK).read_text() for d in kept] == ["4", "2", "3"]
    default = run(*SMOKE, "--steps", "2", "--save-every", "1", "--out-dir", str(tmp_path / "one"))
    assert default.returncode == 0, default.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "one").iterdir() if p.name.startswith("ckpt")) == ["ckpt"]


def test_curves_are_drawn_at_every_save(tmp_path, monkeypatch):
    """curves.png is redrawn as the run goes (at every checkpoint), not only when it ends."""
    drawn = []
    real = log.plot_curves
    monkeypatch.setattr(log, "plot_curves", lambda *a: (drawn.append(len(steps_in(tmp_path))), real(*a))[1])
    grpo.train(grpo.parse_args([*SMOKE, "--steps", "3", "--save-every", "1", "--out-dir", str(tmp_path)]))
    assert drawn == [1, 2, 3] and (tmp_path / "curves.png").is_file()


def test_a_config_file_replays_a_run_and_flags_win(tmp_path, run):
    cfg = grpo.parse_args([*SMOKE, "--lr", "3e-4", "--seed", "7", "--out-dir", str(tmp_path / "a")])
    directory.write_atomic(
        tmp_path / "run_config.json", json.dumps(cfg.__dict__)
    )  # as a checkpoint writes it
    again = grpo.parse_args(["--config", str(tmp_path / "run_config.json")])
    assert {**again.__dict__, "config": ""} == cfg.__dict__
    over = grpo.parse_args(["--config", str(tmp_path / "run_config.json"), "--lr", "1e-5"])
    assert over.lr == 1e-5 and over.seed == 7
    (tmp_path / "run.yaml").write_text("model: tiny-qwen3\nlr: 2.0e-4\nmicro-batch: 3\n")
    y = grpo.parse_args(["--config", str(tmp_path / "run.yaml")])
    assert (y.model, y.lr, y.micro_batch) == ("tiny-qwen3", 2e-4, 3)
    (tmp_path / "bad.yaml").write_text("model: tiny-qwen3\nlearning_rate: 1e-5\n")
    out = run("--config", str(tmp_path / "bad.yaml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo.py: error:") and "bad.yaml" in last and "learning_rate" in last


# ----------------------------------------------------------------------------- Capture refuses
@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-qwen3", dtype=torch.float32)
    use_capture_attention(model)
    return model, tok


def forward(model, ids, cap):
    mask = torch.ones_like(ids)
    return model(input_ids=ids, attention_mask=mask, flow_capture=cap, use_cache=False)


def test_a_capture_takes_one_forward(tiny):
    model, _ = tiny
    layers = select_layers("middle", model.config.num_hidden_layers)
    ids = torch.tensor([[5, 6, 7, 8]])
    cap = Capture(layers)
    forward(model, ids, cap)
    with pytest.raises(RuntimeError, match="make a new Capture for each forward"):
        forward(model, ids, cap)  # the same shape: refused, not ignored
    cap = Capture(layers)
    forward(model, ids, cap)
    with pytest.raises(RuntimeError, match="make a new Capture for each forward"):
        forward(model, torch.tensor([[5, 6, 7, 8, 9, 10]]), cap)  # another width
    with pytest.raises(ValueError, match="at least one layer"):
        Capture([])


def test_a_capture_refuses_a_mask_of_another_shape(tiny):
    model, _ = tiny
    cap = Capture(select_layers("middle", model.config.num_hidden_layers))
    forward(model, torch.tensor([[5, 6, 7], [8, 9, 10]]), cap)
    with pytest.raises(
        ValueError, match=r"attention_mask \(1, 3\) does not fit the captured forward \(2, 3\)"
    ):
        cap.maps(torch.ones(1, 3, dtype=torch.long))  # today it would broadcast over row 1


def test_gradient_checkpointing_replays_into_a_used_capture(tiny):
    """Backward replays each checkpointed layer with the same Capture: it adds nothing, raises nothing, and
    the
    maps equal a plain forward's."""
    model, tok = tiny
    ckpt = load_model("tiny-qwen3", dtype=torch.float32)[0]
    ckpt.load_state_dict(model.state_dict())
    use_capture_attention(ckpt)
    policy.checkpointing(ckpt)
    ckpt.train()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]])
    mask = torch.ones_like(ids)
    layers = select_layers("middle", model.config.num_hidden_layers)
    maps = []
    for m in (model, ckpt):
        cap = Capture(layers)
        lp, _ = policy.token_logprobs(m, ids, mask, 3, share_prefix=True, capture=cap)
        maps.append(cap.maps(mask))  # read before backward, as grpo.update
        lp.sum().backward()  # the replay reaches cap.take again
    torch.testing.assert_close(maps[0], maps[1], rtol=0, atol=1e-6)


def test_tensorboard_scalars_of_a_run_equal_its_metrics_with_evaluation(tmp_path, run):
    """grpo.py --report-to tensorboard --eval-every 2 --steps 3: the event files, read back with TensorBoard's
    own reader, hold every numeric metric of metrics.jsonl at its step, eval/accuracy at steps 2 and 3."""
    from tensorboard.backend.event_processing import event_accumulator

    out = run(
        *SMOKE,
        "--steps",
        "3",
        "--report-to",
        "tensorboard",
        "--eval-every",
        "2",
        "--eval-size",
        "3",
        "--out-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines if "eval/accuracy" in m] == [2, 3]
    assert all(m["eval/total"] == 3 for m in lines if "eval/total" in m)
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    logged = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    want = {}
    for m in lines:
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)):  # bools too, as 0 / 1
                want.setdefault(k, {})[m["step"]] = float(v)
    assert set(logged) == set(want)
    for k in want:
        assert logged[k] == pytest.approx(want[k], rel=1e-6), k  # TensorBoard stores fp32


def test_overwrite_deletes_the_kept_checkpoints_and_the_tracker_files_too(tmp_path, run):
    """--overwrite starts afresh: the older saves of --keep-checkpoints and --report-to's event files go with
    the metrics, so the new run's TensorBoard shows no step of the old one."""
    from tensorboard.backend.event_processing import event_accumulator

    old = run(
        *SMOKE,
        "--steps",
        "3",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "3",
        "--report-to",
        "tensorboard",
        "--out-dir",
        str(tmp_path),
    )
    assert old.returncode == 0, old.stderr[-2000:]
    assert (tmp_path / "ckpt-00002").is_dir() and (tmp_path / "tensorboard").is_dir()
    new = run(*SMOKE, "--steps", "1", "--report-to", "tensorboard", "--overwrite", "--out-dir", str(tmp_path))
    assert new.returncode == 0, new.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {e.step for e in acc.Scalars("loss")} == {1} and steps_in(tmp_path) == [1]
