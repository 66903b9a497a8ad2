"""training/memory/backoff.py on the CPU: each phase of a tiny run forced out of memory by a fake that raises
torch.OutOfMemoryError on work wider than 2 rows (the update's token_logprobs, the rollout's prefill or the
engine's buffers, held-out evaluation's prefill), and at every size. The run goes on at 2 with one line, its
run_config.json says 2 and --resume continues there; the gradient (fp32) and the rollouts equal those of the
run started at 2; at every size one line, exit status 1, and the last step saved (or the last checkpoint
standing where the weights moved), from which --resume is exact."""

import json
import weakref
import zlib

import pytest
import torch
from conftest import assert_to_rounding, flat, grpo_steps

import grpo
from training.decode import engine, rollout
from training.memory import budget, preflight
from training.run import checkpoint as ckpt_io
from training.run import heldout, log

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.99 GiB"
TINY = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "6",
    "--gen-chunk",
    "8",
    "--micro-batch",
    "8",
]
NOT_COMPARED = ("time/", "mem/", "oom/")  # the clock, the process's RSS, the back-offs


@pytest.fixture(autouse=True)
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # grpo_steps' runs/ land in tmp_path


@pytest.fixture(autouse=True)
def varied_rewards(monkeypatch):
    """Rewards that vary within groups (a crc of the text), the same for the same text in every run."""
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: zlib.crc32(txt.encode()) % 4 / 3)


def armed(monkeypatch, after_step=0):
    """A switch that turns on once `after_step` steps are logged (RunLog.step counts them)."""
    on = {"on": after_step == 0}
    real = log.RunLog.step

    def step(self, s, *a, **k):
        out = real(self, s, *a, **k)
        on["on"] = on["on"] or s + 1 >= after_step
        return out

    monkeypatch.setattr(log.RunLog, "step", step)
    return on


def update_fails(monkeypatch, wider_than=2, after_step=0):
    """grpo's token_logprobs raising torch.OutOfMemoryError on a micro-batch of more than `wider_than` rows
    (0: every one) once `after_step` steps are logged; returns the widths of the forwards that ran."""
    real, on, ran = grpo.token_logprobs, armed(monkeypatch, after_step), []

    def fake(model, ids, *a, **k):
        if on["on"] and ids.shape[0] > wider_than:
            raise torch.OutOfMemoryError(OOM)
        ran.append(ids.shape[0])
        return real(model, ids, *a, **k)

    monkeypatch.setattr(grpo, "token_logprobs", fake)
    return ran


def prefill_fails(monkeypatch, wider_than=2, after_step=0, distinct=False):
    """rollout.prefill_rows raising on more than `wider_than` rows (distinct: prompts) a chunk."""
    real, on, ran = rollout.prefill_rows, armed(monkeypatch, after_step), []

    def fake(model, prefix, row_ids, pad):
        n = len(set(map(tuple, row_ids))) if distinct else len(row_ids)
        if on["on"] and n > wider_than:
            raise torch.OutOfMemoryError(OOM)
        ran.append(n)
        return real(model, prefix, row_ids, pad)

    monkeypatch.setattr(rollout, "prefill_rows", fake)
    return ran


def lines(capsys, prefix="backoff:"):
    return [x for x in capsys.readouterr().out.splitlines() if x.startswith(prefix)]


def saved(out, name="run_config.json"):
    return json.loads((out / "ckpt" / name).read_text())


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def same(a, b):
    """Two runs' metrics lines equal but for the clock, the RSS and the back-offs."""
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(NOT_COMPARED)}  # noqa: E731
    return [keep(m) for m in a] == [keep(m) for m in b]


# ----------------------------------------------------------------------------- the update
def test_the_gradient_after_a_back_off_is_the_smaller_micro_batchs(monkeypatch):
    """The update runs out of memory on micro-batches wider than 2 rows, after the first micro-batch of 4 has
    accumulated its gradient: the gradients are zeroed, the update redone at 2, and the first optimizer
    step's gradient equals that of the run started at 2 (fp32 rounding, against an fp64 run)."""
    real, ran = grpo.token_logprobs, []

    def partial(model, ids, *a, **k):  # 4 rows pass once, then fail: a partial
        if ids.shape[0] > 2 and 4 in ran:  # sum of gradients is left behind
            raise torch.OutOfMemoryError(OOM)
        ran.append(ids.shape[0])
        return real(model, ids, *a, **k)

    monkeypatch.setattr(grpo, "token_logprobs", partial)

    def first_gradient(run):
        got, names = {}, {p: n for n, p in run.policy.model.named_parameters()}
        run.policy.opt.register_step_pre_hook(
            lambda opt, *_: (
                got
                or got.update(
                    {names[p]: p.grad.detach().clone() for g in opt.param_groups for p in g["params"]}
                )
            )
        )
        return got

    runs = grpo_steps(
        monkeypatch,
        "cpu",
        [
            ("fp64", [*TINY, "--micro-batch", "2", "--steps", "1", "--out-dir", "runs/t-a"], True),
            ("at 2", [*TINY, "--micro-batch", "2", "--steps", "1", "--out-dir", "runs/t-b"], False),
            ("backed off", [*TINY, "--micro-batch", "4", "--steps", "1", "--out-dir", "runs/t-c"], False),
        ],
        first_gradient,
    )
    m, _, grad = runs["backed off"]
    assert m["oom/backoffs"] == 1 and m["rows/trained"] == 8 and 4 in ran  # a partial sum existed
    assert_to_rounding(flat(grad), flat(runs["at 2"][2]), flat(runs["fp64"][2]), what="the first gradient")


def test_a_run_whose_update_runs_out_of_memory_finishes_at_micro_batch_2_and_resumes_there(
    tmp_path, monkeypatch, capsys
):
    ran = update_fails(monkeypatch)
    out = tmp_path / "run"
    grpo.main([*TINY, "--micro-batch", "4", "--steps", "2", "--save-every", "1", "--out-dir", str(out)])
    said = lines(capsys)
    assert said == [
        f"backoff: the update ran out of memory at micro_batch 4 (OutOfMemoryError: {OOM}): "
        "micro_batch 2 from here on; the update is redone from its start on the same rollouts"
    ]
    assert set(ran) == {2} and saved(out)["micro_batch"] == 2
    assert [m["oom/backoffs"] for m in metrics(out)] == [1, 0] and metrics(out)[0]["rows/trained"] > 2
    grpo.main(["--resume", str(out), "--steps", "3"])
    assert lines(capsys) == [] and saved(out)["micro_batch"] == 2 and len(metrics(out)) == 3


# ----------------------------------------------------------------------------- the rollout
def test_a_run_whose_rollout_runs_out_of_memory_finishes_at_gen_chunk_2_as_the_run_started_there(
    tmp_path, monkeypatch, capsys
):
    """A chunk of more than 2 rows runs out of memory in its prefill (before any sample is drawn): the run
    goes on at gen_chunk 2 and every step equals the run started at 2; --resume continues at 2."""
    ran = prefill_fails(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    grpo.main([*TINY, "--gen-chunk", "4", "--steps", "2", "--save-every", "1", "--out-dir", str(a)])
    assert lines(capsys) == [
        f"backoff: the rollout ran out of memory at gen_chunk 4 (OutOfMemoryError: "
        f"{OOM}): gen_chunk 2 from here on; the 0 rows done are kept, the others made"
    ]
    assert set(ran) == {2} and saved(a)["gen_chunk"] == 2
    grpo.main([*TINY, "--gen-chunk", "2", "--steps", "2", "--out-dir", str(b)])
    assert lines(capsys) == [] and same(metrics(a), metrics(b))
    assert [m["oom/backoffs"] for m in metrics(a)] == [1, 0]
    grpo.main(["--resume", str(a), "--steps", "3"])
    assert lines(capsys) == [] and saved(a)["gen_chunk"] == 2 and set(ran) == {2}


def test_the_rows_done_are_kept_and_only_the_others_generated(monkeypatch):
    """rollout.generate's `done`: a call that raised midway keeps its finished chunks; called again, it
    generates the rows not yet generated, and greedy rows equal one call's."""
    from training.model.load import load_model

    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    prompts = ["Q: 1+1? A:", "Q: 2+3? A:", "Q: 7+9? A:"]
    kw = dict(n=2, sampling=rollout.Sampling(5, greedy=True), chunk_size=2)
    want = rollout.generate(model, tok, prompts, **kw)
    done, real, calls = rollout.Generations([], [], [], []), rollout.prefill_rows, []

    def once(*a):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError(OOM)
        return real(*a)

    monkeypatch.setattr(rollout, "prefill_rows", once)
    with pytest.raises(torch.OutOfMemoryError):
        rollout.generate(model, tok, prompts, done=done, **kw)
    assert len(done.texts) == 2  # the first chunk is kept
    got = rollout.generate(model, tok, prompts, done=done, **kw)
    assert got is done and got.response_ids == want.response_ids and len(calls) == 4  # 1 + 1 failed + 2


def engine_fails(monkeypatch, wider_than=2):
    """The engine's decode runs out of memory when it holds more than `wider_than` rows."""
    real = engine.Engine.steps

    def steps(self, *a):
        if self.rows > wider_than:
            raise torch.OutOfMemoryError(OOM)
        return real(self, *a)

    monkeypatch.setattr(engine.Engine, "steps", steps)


@pytest.mark.parametrize("when", ["preflight", "rollout"])
def test_the_engine_is_resized_to_the_chunk_it_backs_off_to(when, tmp_path, monkeypatch, capsys):
    """The preflight's path on the CPU: the engine's buffers do not fit 8 rows, at setup (the preflight's
    trial) or in the first rollout: gen_chunk 2, the engine resized to 2 rows (not dropped), and the run
    equals the one started at gen_chunk 2."""
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    a, b = tmp_path / "a", tmp_path / "b"
    if when == "preflight":
        engine_fails(monkeypatch)
    cfg = grpo.parse_args([*TINY, "--steps", "2", "--out-dir", str(a)])
    run = grpo.setup(cfg)
    if when == "rollout":
        assert run.engine.rows == 8 and run.engine.keys is not None  # the trial allocated 8 rows
        engine_fails(monkeypatch)
    grpo.train(cfg, run)
    said = lines(capsys)
    assert len(said) == 2 and "at gen_chunk 8 (" in said[0] and "at gen_chunk 4 (" in said[1]
    assert said[1].endswith("gen_chunk 2 from here on" if when == "preflight" else "the others made")
    assert run.engine is not None and run.engine.rows == 2 and run.engine.keys.shape[1] == 2
    assert not run.engine.off and cfg.gen_chunk == 2
    grpo.main([*TINY, "--gen-chunk", "2", "--steps", "2", "--out-dir", str(b)])
    assert same(metrics(a), metrics(b))


# ----------------------------------------------------------------------------- held-out evaluation
def test_held_out_evaluation_backs_off_and_the_run_resumes_at_its_size(tmp_path, monkeypatch, capsys):
    """Evaluation chunks of more than 2 questions (distinct prompts; a rollout chunk has one) run out of
    memory: one line, gen_chunk 2 for the evaluation and the rollouts after it; the accuracy is the greedy
    one at chunk 2; --resume continues at 2."""
    prefill_fails(monkeypatch, distinct=True)
    out = tmp_path / "run"
    cfg = grpo.parse_args(
        [
            *TINY,
            "--gen-chunk",
            "4",
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--eval-size",
            "5",
            "--save-every",
            "1",
            "--out-dir",
            str(out),
        ]
    )
    run = grpo.setup(cfg)
    grpo.train(cfg, run)
    assert lines(capsys) == [
        f"backoff: the held-out evaluation ran out of memory at gen_chunk 4 "
        f"(OutOfMemoryError: {OOM}): gen_chunk 2 from here on; the 0 rows done are "
        "kept, the others made"
    ]
    m = metrics(out)
    assert saved(out)["gen_chunk"] == 2 and [x["oom/backoffs"] for x in m] == [1, 0]
    pol, task = run.policy, run.task
    want = heldout.accuracy(pol.model, pol.tok, task.eval_records, task.style, 6, 2, reward=task.reward)
    assert m[-1]["eval/right"] == want["eval/right"] and m[-1]["eval/total"] == 5
    grpo.main(["--resume", str(out), "--steps", "3"])
    assert lines(capsys) == [] and saved(out)["gen_chunk"] == 2


# ----------------------------------------------------------------------------- at every size
@pytest.mark.parametrize("phase", ["update", "rollout"])
def test_out_of_memory_at_every_size_is_one_line_exit_1_and_the_last_step_saved(
    phase, tmp_path, monkeypatch, capsys
):
    """From step 2 on every width runs out of memory: one line naming the phase, the sizes tried and the
    estimate, exit status 1; step 1 is saved (no optimizer step had begun since), and --resume from it gives
    the step 2 of the run that never failed."""
    (update_fails if phase == "update" else prefill_fails)(monkeypatch, wider_than=0, after_step=1)
    out, ref = tmp_path / "run", tmp_path / "ref"
    flags = [*TINY, "--micro-batch", "4", "--gen-chunk", "4", "--save-every", "10"]
    with pytest.raises(SystemExit) as e:
        grpo.main([*flags, "--steps", "3", "--out-dir", str(out)])
    said = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo.py:")]
    field, tried = ("micro_batch", "gen_chunk 4") if phase == "update" else ("gen_chunk", "micro_batch 4")
    assert e.value.code == 1 and len(said) == 1, said
    assert said[0].startswith(
        f"grpo.py: stopping: out of memory in the {phase} at {field} 1 ({field} tried: "
        f"4, 2, 1; {tried}; OutOfMemoryError: {OOM}); the estimate at these sizes: "
    )
    assert " GB at its peak (" in said[0] and said[0].endswith(
        f"on the cpu; step 1 is saved ({out / 'ckpt'}): --resume continues from it"
    )
    assert (out / "ckpt" / ckpt_io.MARK).read_text() == "1" and len(metrics(out)) == 1
    assert saved(out)[field] == 1
    monkeypatch.undo()  # the memory is there again
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: zlib.crc32(txt.encode()) % 4 / 3)
    grpo.main(["--resume", str(out), "--steps", "2"])
    grpo.main([*flags, "--steps", "1", "--out-dir", str(ref)])  # step 1 saved at its end, as usual
    grpo.main(["--resume", str(ref), "--steps", "2", f"--{field.replace('_', '-')}", "1"])
    assert metrics(ref)[1]["rows/trained"] > 0 and same(metrics(out), metrics(ref))  # exact from step 1


def test_out_of_memory_after_an_optimizer_step_stops_and_the_last_checkpoint_stands(
    tmp_path, monkeypatch, capsys
):
    """--num-iterations 2: the second PPO epoch of step 2 runs out of memory after the first epoch stepped.
    Redone, the update would train on those rollouts twice: one line, exit 1, nothing saved over step 1's
    weights (they moved), the checkpoint on disk stands."""
    on, calls, real = armed(monkeypatch, after_step=1), [], grpo.token_logprobs

    def second_epoch(model, ids, *a, **k):
        calls.append(on["on"])
        if on["on"] and calls.count(True) > 1:  # 8 rows, one micro-batch an epoch
            raise torch.OutOfMemoryError(OOM)
        return real(model, ids, *a, **k)

    monkeypatch.setattr(grpo, "token_logprobs", second_epoch)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        grpo.main(
            [*TINY, "--num-iterations", "2", "--steps", "3", "--save-every", "10", "--out-dir", str(out)]
        )
    said = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo.py:")]
    assert e.value.code == 1 and len(said) == 1 and calls.count(True) == 2
    assert "out of memory in the update after an optimizer step began (the weights moved" in said[0]
    assert said[0].endswith("no checkpoint was written yet") and not (out / "ckpt").exists()


def test_other_errors_are_not_caught(tmp_path, monkeypatch):
    """Only memory is backed off: another error of the update goes on as it was."""

    def boom(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(grpo, "token_logprobs", boom)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        grpo.train(grpo.parse_args([*TINY, "--steps", "1", "--out-dir", str(tmp_path / "run")]))


# ----------------------------------------------------------------------------- the engine released
def test_a_released_engine_is_freed_for_the_update_and_reserved_again_for_the_rollout(tmp_path, monkeypatch):
    """The plan's layout "released" (forced here; budget.plan picks it where it lets larger sizes fit): the
    engine's buffers are freed before each update (no tensor keeps their storage alive) and made again, its
    graphs captured again, by the next rollout; the run equals the one whose engine stays resident."""
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    a, b = tmp_path / "a", tmp_path / "b"
    grpo.main([*TINY, "--steps", "2", "--out-dir", str(b)])  # resident
    cfg = grpo.parse_args([*TINY, "--steps", "2", "--out-dir", str(a)])
    run = grpo.setup(cfg)
    run.budget = budget.Budget(24 * budget.GB, "a test", budget.Plan(8, 8, "backward", 0.0, (8, 8), True))
    rolled, during, real = [], [], grpo.update
    real_release = engine.Engine.release

    def release(self):
        rolled.append((weakref.ref(self.keys.untyped_storage()), self.captures))  # what the rollout held
        return real_release(self)

    def update(run, *args):
        during.append((run.engine.keys is None, run.engine.n is None, rolled[-1][0]() is None))
        return real(run, *args)

    monkeypatch.setattr(engine.Engine, "release", release)
    monkeypatch.setattr(grpo, "update", update)
    setup = run.engine.captures  # the preflight's trial
    grpo.train(cfg, run)
    assert during == [(True, True, True)] * 2  # freed in both updates
    first, second = rolled[0][1] - setup, rolled[1][1] - rolled[0][1]
    assert len(rolled) == 2 and (first, second) == (0, 1)  # the preflight's graph; once released, again
    assert run.engine.keys is None and same(metrics(a), metrics(b))  # released after the last rollout
