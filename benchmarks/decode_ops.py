"""The operators of one decode step of training/decode/engine.py, before and after its fused step.

One Engine.step (the forward of one new token per row, sampling, the bookkeeping), its aten operators
counted as they are dispatched (a TorchDispatchMode), for each step the engine can run:
  model   the model's own forward over the static cache (the engine's step before the fused one, now its
          fallback for a model the fused step cannot read): HF's decoder layers, its SDPA attention
  fused   training/decode/fused_step.py: Q, K, V and gate, up merged, its own attention over the rows'
          lengths (sdpa here: the eager step; flex where CUDA compiles it), top-k on the 16-bit logits
`ops` counts every dispatch; `kernels` leaves out the views and metadata (VIEWS), which launch no kernel on a
GPU; `matmuls` the mm / addmm / bmm / linear among them. Eagerly each such operator is (at least) one kernel
launch; a CUDA graph replays them all in one launch, and a compiled step (torch.compile, fullgraph=True, as
the engine runs it on CUDA) fuses the elementwise ones. --compiled also compiles the fused step of the CPU
models with Inductor here and counts the launches in its generated code (`compiled`: its C++ kernels and
extern calls; Inductor's CPU code fuses even the attention into its loops, which CUDA's Triton code does
not, so the GPU's count is higher: it needs a GPU, benchmarks/gpu_report.py's decode part).
At the shape of `--rows` rows, a greedy step (--sampled: App. C.3's warp), the models:
  tiny-qwen3, tiny-llama   load.py's random tiny models, on the CPU
  qwen3-4b-random          Qwen3-4B's architecture on the meta device (no memory: only the dispatches)

Run:  python benchmarks/decode_ops.py                       # the three models, 64 rows, greedy
      python benchmarks/decode_ops.py --models tiny-qwen3 --rows 4 --sampled
      python benchmarks/decode_ops.py --models tiny-qwen3 --compiled   # + Inductor's launches, ~1 min
"""

import argparse
import contextlib
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
from flowtracer import IMPL, register_attention  # noqa: E402
from training.decode.engine import Engine  # noqa: E402
from training.decode.rollout import Sampling  # noqa: E402
from training.model import load  # noqa: E402

MODELS = ("tiny-qwen3", "tiny-llama", "qwen3-4b-random")
VIEWS = {  # aten operators that make a view or read metadata: no kernel
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "expand",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "split",
    "split_with_sizes",
    "alias",
    "permute",
    "as_strided",
    "detach",
    "lift_fresh",
    "_reshape_alias",
    "unbind",
    "chunk",
    "narrow",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
}
MATMULS = {"mm", "addmm", "bmm", "linear", "matmul", "baddbmm"}
LAUNCH = re.compile(r"^\s+(cpp_fused\w*\(|triton_\w+\.run\(|extern_kernels\.\w+\(|torch\.ops\.|aten\.)")


class Count(TorchDispatchMode):
    """The aten operators dispatched inside the block, by name (aten.mm.default -> "mm")."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def model_of(name):
    """(model, tokenizer): the tiny ones on the CPU in fp32, qwen3-4b-random on the meta device in bf16."""
    if name == "qwen3-4b-random":
        register_attention()
        return load.random_model(name, torch.device("meta"), torch.bfloat16, IMPL)
    return load.load_model(name, device="cpu", dtype=torch.float32)


@torch.no_grad()
def count_step(model, tok, rows, warp, fused):
    """{ops, kernels, matmuls, top}: the operators of one Engine.step of `rows` rows, each row at its own
    position (a 48-token prompt and a few new tokens), all writing."""
    eng = Engine(model, graphs=False, fused=fused).reserve(
        rows, 64, 16, [tok.eos_token_id], tok.pad_token_id, warp
    )
    if eng.keys is None:  # the model step's buffers come with a decode's prefill: here, the model's dtype
        eng.allocate(None)
    eng.cache(rows)  # its Cache of SlotLayers, made once per width (not a step's work)
    eng.n.copy_(torch.arange(rows) % 16 + 48)  # (rows,) the slots they write
    eng.done.fill_(False)
    scope = contextlib.nullcontext() if model.device.type == "meta" else eng.scope()  # meta: no autocast
    with scope, Count() as c:
        eng.step(rows)
    kernels = {k: v for k, v in c.ops.items() if k not in VIEWS}
    return dict(
        ops=sum(c.ops.values()),
        kernels=sum(kernels.values()),
        matmuls=sum(v for k, v in kernels.items() if k in MATMULS),
        top=Counter(kernels).most_common(6),
    )


def compiled_launches(model, tok, rows, warp):
    """The launches in Inductor's code for the fused step (torch.compile, fullgraph=True): the lines of its
    generated call() that run a kernel or an extern op."""
    from torch._inductor.utils import run_and_get_code

    eng = Engine(model, graphs=False).reserve(rows, 64, 16, [tok.eos_token_id], tok.pad_token_id, warp)
    eng.n.copy_(torch.arange(rows) % 16 + 48)
    eng.done.fill_(False)
    torch._dynamo.reset()
    with torch.no_grad(), eng.scope():
        _, code = run_and_get_code(torch.compile(eng.step, fullgraph=True), rows)
    torch._dynamo.reset()
    call = code[-1][code[-1].index("def call(") :]
    return sum(bool(LAUNCH.match(line)) for line in call.splitlines())


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="decode_ops.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    ap.add_argument("--rows", type=int, default=64, help="rows a step decodes (gen_chunk 64: grpo.py's)")
    ap.add_argument("--sampled", action="store_true", help="App. C.3's sampling (T, top-k) instead of greedy")
    ap.add_argument(
        "--compiled", action="store_true", help="+ Inductor's launches of the CPU models' fused step"
    )
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names or set(names) - set(MODELS) or args.rows < 1:
        ap.error(f"--models takes names of {MODELS}, --rows >= 1; got {args.models!r}, {args.rows}")
    warp = Sampling.of(grpo.Config()).warp if args.sampled else None
    print(f"one decode step, {args.rows} rows, {'sampled ' + str(warp) if warp else 'greedy'}")
    print(f"{'model':18s}{'step':>7s}{'layers':>8s}{'ops':>8s}{'kernels':>9s}{'matmuls':>9s}  top kernels")
    out = {}
    for name in names:
        model, tok = model_of(name)
        for fused in (False, True):
            r = count_step(model, tok, args.rows, warp, fused)
            out[name, "fused" if fused else "model"] = r
            if fused and args.compiled and model.device.type == "cpu":
                r["compiled"] = compiled_launches(model, tok, args.rows, warp)
            top = ", ".join(f"{k} {v}" for k, v in r["top"])
            print(
                f"{name:18s}{'fused' if fused else 'model':>7s}{model.config.num_hidden_layers:8d}"
                f"{r['ops']:8d}{r['kernels']:9d}{r['matmuls']:9d}  {top}"
            )
            if "compiled" in r:
                print(f"{name:18s}{'fused':>7s} compiled by Inductor on the CPU: {r['compiled']} launches")
    return out


if __name__ == "__main__":
    main()
