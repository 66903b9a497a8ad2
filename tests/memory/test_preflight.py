"""training/memory/preflight.py on the CPU: each preflight part forced to fail by a fake (the run goes on with
its fallback and one line), one engine for a run with held-out evaluation (counted across two steps and two
evaluations, its buffers reserved once), an optimizer fallback that survives --resume. What Triton's launcher
needs: tests/gpu_kernels/test_availability.py."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

import grpo
from flowtracer import add_head_mean
from training import policy
from training.decode import engine, rollout
from training.memory import preflight
from training.model import trainable
from training.model.load import load_model
from training.run import heldout
from training.run.setup import Run


# ----------------------------------------------------------------------------- each part's fallback
@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)


def cfg_of(**kw):
    return SimpleNamespace(
        **{
            **dict(
                share_prefix=True,
                gen_chunk=8,
                prompts_per_step=2,
                group_size=2,
                max_new_tokens=6,
                temperature=0.99,
                top_k=100,
                top_p=1.0,
                logprob_chunk=4,
            ),
            **kw,
        }
    )


def record(model, tok, opt, head_mean, layers=(1, 2)):
    """run.load_for_update's Run as the preflight reads it (no autocast: the CPU's bf16 weights as they
    are)."""
    pol = policy.Policy(model, tok, None, opt, None, contextlib.nullcontext(), torch.device("cpu"))
    return Run(cfg_of(), pol, list(layers), head_mean)


def kahan(model):
    return trainable.make_optimizer(
        model, SimpleNamespace(optimizer="kahan", lr=1e-3, weight_decay=0.0), "cpu"
    )


def test_each_failing_part_is_replaced_with_one_line(tiny, monkeypatch, capsys):
    """A kernel whose launch fails, optimi's Triton step failing, the engine's trial failing: each replaced
    by its fallback, one line each naming the part, the error and what runs instead, then the summary."""
    model, tok = tiny
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: "triton")

    def launch_fails(*a):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable\nmore")

    def boom(*a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(preflight, "optimizer_trial", boom)
    monkeypatch.setattr(preflight, "engine_trial", boom)
    u = record(model, tok, kahan(model), launch_fails)
    capsys.readouterr()
    got = preflight.try_parts(cfg_of(), u, "cpu", widest=20)
    assert got.head_mean is add_head_mean and got.engine is None and got.optimizer == "foreach"
    assert all((g["triton"], g["foreach"]) == (False, True) for g in u.policy.opt.param_groups)
    err = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert (
        capsys.readouterr().out.splitlines()
        == got.lines
        == [
            "preflight: the head-mean kernel failed (RuntimeError: Failed to find C compiler. Please specify "
            "via CC environment variable); flow credit uses add_head_mean, the PyTorch reference",
            f"preflight: the optimizer's Triton step failed ({err}); torch-optimi's foreach step runs "
            "instead (the same arithmetic)",
            f"preflight: the decode engine failed ({err}); rollouts decode with rollout.decode, without the "
            "engine",
            got.lines[-1],
        ]
    )
    assert got.lines[-1].startswith("preflight: no GPU part ran on cpu in ")


def test_a_kernel_that_runs_but_differs_is_not_used(tiny, monkeypatch, capsys):
    """A kernel that returns wrong maps (half the reference's) fails its trial; the real parts pass."""
    model, tok = tiny
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)

    def half(buf, q, k, mask, scale, chunk):
        add_head_mean(buf, q, k, mask, scale, chunk)
        buf.mul_(0.5)

    u = record(model, tok, torch.optim.AdamW(model.parameters()), half)
    got = preflight.try_parts(cfg_of(), u, "cpu", widest=20)
    assert got.head_mean is add_head_mean and got.optimizer == "" and isinstance(got.engine, engine.Engine)
    assert "differs from add_head_mean by" in got.lines[0]
    assert got.lines[1].startswith("preflight: decode engine ran on cpu") and len(got.lines) == 2
    assert got.engine.captures == 2 and got.engine.S >= 20 - 1 + 6  # the trial: greedy and sampled


def test_a_long_prompt_mid_run_recaptures_nothing(tiny, monkeypatch):
    """The engine reserved for the run's widest prompt: short calls, then one at the widest, keep the same
    buffers and every graph (an engine sized by its first call regrows and drops them)."""
    model, tok = tiny
    short, long = [[1] + list(range(5, 12))] * 2, [[1] + list(range(5, 120))]
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    u = record(model, tok, torch.optim.AdamW(model.parameters()), None)
    eng = preflight.try_parts(cfg_of(), u, "cpu", widest=len(long[0])).engine
    kw = dict(n=2, sampling=rollout.Sampling.of(cfg_of()), chunk_size=8, engine=eng)  # the run's
    rollout.generate(model, tok, short, **kw)
    keys, graphs = eng.keys, set(eng.graph)
    rollout.generate(model, tok, long, **kw)
    assert eng.keys is keys and graphs <= set(eng.graph)
    grown = engine.Engine(model)  # sized by its first call
    rollout.generate(model, tok, short, **{**kw, "engine": grown})
    keys = grown.keys
    rollout.generate(model, tok, long, **{**kw, "engine": grown})
    assert grown.keys is not keys


# ----------------------------------------------------------------------------- one engine for the run
def test_one_engine_for_a_run_with_held_out_evaluation(tmp_path, monkeypatch):
    """grpo.py with --eval-every 1 for two steps, the preflight's path forced on the CPU: one engine made,
    every rollout and evaluation through it, the same buffers throughout, and no rollout or evaluation
    captures a graph: the preflight's trial captured the run's two (greedy beside sampled)."""
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    made, calls = [], []
    real_init, real_generate = engine.Engine.__init__, rollout.generate
    monkeypatch.setattr(
        engine.Engine, "__init__", lambda self, *a, **k: made.append(self) or real_init(self, *a, **k)
    )

    def counted(model, tok, prompts, n, sampling, **kw):
        out = real_generate(model, tok, prompts, n, sampling, **kw)
        eng = kw.get("engine")
        calls.append((eng, eng.captures if eng else None, id(eng.keys) if eng else None, sampling.greedy))
        return out

    monkeypatch.setattr(grpo, "generate", counted)
    monkeypatch.setattr(heldout, "generate", counted)
    cfg = grpo.parse_args(
        [
            "--model",
            "tiny-qwen3",
            "--device",
            "cpu",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "6",
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--eval-size",
            "3",
            "--gen-chunk",
            "8",
            "--out-dir",
            str(tmp_path / "run"),
        ]
    )
    run = grpo.setup(cfg)
    grpo.train(cfg, run)
    assert len(made) == 1 and [c[3] for c in calls] == [False, True, False, True]  # step, eval, step, eval
    assert all(c[0] is run.engine for c in calls) and len({c[2] for c in calls}) == 1
    assert calls[0][1] == calls[1][1] == calls[3][1] == 2  # the preflight's two graphs: none after it
    assert run.engine.S >= run.task.widest_prompt - 1 + 6


# ----------------------------------------------------------------------------- the optimizer's setting
def test_an_optimizer_fallback_survives_resume(tmp_path, monkeypatch, capsys):
    """A run saved where optimi's Triton step ran (its param groups say triton=True) resumes where the step
    fails: the preflight's fallback is written after the checkpoint loads, so the foreach step runs (the
    loaded triton=True would run Triton on these CPU tensors and fail) and the run finishes."""
    out = str(tmp_path / "run")
    args = [
        "--model",
        "tiny-qwen3",
        "--device",
        "cpu",
        "--optimizer",
        "kahan",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--save-every",
        "1",
        "--out-dir",
        out,
    ]
    grpo.train(grpo.parse_args(args + ["--steps", "1"]))
    state_file = tmp_path / "run" / "ckpt" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    for g in state["optimizer"]["param_groups"]:
        g["triton"], g["foreach"] = True, False  # as a run on a GPU saved it
    torch.save(state, state_file)
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: "triton")

    def fails(device):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(preflight, "optimizer_trial", fails)
    capsys.readouterr()
    cfg = grpo.parse_args(args + ["--steps", "2", "--resume", out])
    run = grpo.setup(cfg)
    assert all((g["triton"], g["foreach"]) == (False, True) for g in run.policy.opt.param_groups)
    assert grpo.train(cfg, run).status == 0 and int(run.policy.sched.last_epoch) == 2
    assert capsys.readouterr().out.count("preflight: the optimizer's Triton step failed") == 1


# ----------------------------------------------------------------------------- the run's own kernel, its RNG
def test_the_kernel_trial_is_the_runs_call(tiny, monkeypatch):
    """The head-mean kernel is tried as the run calls it: the run's dtype (bf16 here), the model's head dim
    and heads, transformers' bool padding mask, and with --share-prefix the response pass over the cached
    prompt (S > T), on each chosen layer; an fp32 toy input would compile another kernel."""
    model, tok = tiny
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    calls = []

    def kernel(buf, q, k, mask, scale, chunk):
        calls.append(
            (
                q.dtype,
                k.dtype,
                q.shape,
                k.shape,
                None if mask is None else (mask.dtype, mask.shape),
                bool(mask is not None and not mask.all()),
            )
        )
        add_head_mean(buf, q, k, mask, scale, chunk)

    u = record(model, tok, torch.optim.AdamW(model.parameters()), kernel)
    got = preflight.try_parts(cfg_of(), u, "cpu", widest=20)
    assert got.head_mean is kernel
    assert got.lines[-1].startswith("preflight: head-mean kernel, decode engine ran")
    mc = model.config
    assert {c[0] for c in calls} == {c[1] for c in calls} == {torch.bfloat16}
    assert {(c[2][1], c[2][3], c[3][1]) for c in calls} == {
        (mc.num_attention_heads, mc.head_dim, mc.num_key_value_heads)
    }
    assert all(c[4][0] == torch.bool and c[4][1][1] == 1 for c in calls)  # (B, 1, T, S) bool
    assert any(c[5] for c in calls)  # a padded row's mask
    assert any(c[3][2] > c[2][2] for c in calls)  # the response pass: S > T
    assert len(calls) == 2 * len(u.layers)  # prompt and response passes


class FakeCudaRng:
    """torch.cuda's RNG state as the checkpoint reads it (get_rng_state_all / set_rng_state_all), on a
    machine without a GPU; every sampled decode step draws from it (Engine.step wrapped)."""

    def __init__(self, monkeypatch):
        self.state = [torch.tensor([7, 0], dtype=torch.uint8)]
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.state])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda st: setattr(self, "state", list(st)))
        real = engine.Engine.step

        def step(eng, b):
            if eng.warp is not None:  # sampled, not greedy
                self.state[0][1] += 1  # a draw moves the offset
            return real(eng, b)

        monkeypatch.setattr(engine.Engine, "step", step)


def test_the_samplers_trial_leaves_the_rng_as_it_was(tiny, monkeypatch):
    """The preflight captures the sampler's graph too (a draw on the CPU's and the faked GPU's RNG), and
    both RNG states are those of before the preflight: the first rollout draws what --resume restores."""
    model, tok = tiny
    monkeypatch.setattr(preflight, "on_gpu", lambda device: True)
    cuda = FakeCudaRng(monkeypatch)
    drawn = []
    real = engine.sample
    monkeypatch.setattr(engine, "sample", lambda *a: drawn.append(1) or real(*a))
    torch.manual_seed(3)
    cpu, gpu = torch.get_rng_state(), [s.clone() for s in cuda.state]
    got = preflight.try_parts(
        cfg_of(), record(model, tok, torch.optim.AdamW(model.parameters()), None), "cpu", widest=20
    )
    assert drawn and got.engine.captures == 2  # the sampler ran and is captured
    assert torch.equal(torch.get_rng_state(), cpu)
    assert len(cuda.state) == 1 and torch.equal(cuda.state[0], gpu[0])
