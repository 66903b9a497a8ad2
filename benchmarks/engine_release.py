"""What the decode engine's released layout costs a step: its K, V buffers made again, its graphs captured
again.

budget.plan releases the engine (training/decode/engine.py) for the update where the step does not fit with
its cache resident: after each rollout its K, V buffers are freed, and before the next they are reserved and
allocated again and its graphs captured again. This measures that on one engine: release, reserve and
allocate (reserve_s); a short call (one chunk of rows, 16 new tokens) with the engine resident (call_s)
against the same call right after a release (released_s: its buffers made and its graphs captured again),
and the graph shapes that call captured. On the CPU, where grpo.py has no engine, an eager one made as
setup makes it (preflight.make_engine): no graphs, the allocation alone. benchmarks/gpu_headline.py prints
this line, "engine release", for each budget, on the run's own engine after its rollout.

Run:  python benchmarks/engine_release.py --max-new-tokens 8192 --gen-chunk 32   # Qwen3-4B's 8K layout
      python benchmarks/engine_release.py --model tiny-qwen3 --device cpu --max-new-tokens 16 --gen-chunk 4
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
from training.decode.rollout import Sampling, generate, prompt_ids  # noqa: E402
from training.memory import preflight  # noqa: E402
from training.model.load import load_model  # noqa: E402


def synced(device):
    """perf_counter after the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def release_cost(cfg, model, tok, prompts, eng, new, autocast, graphs):
    """What the layout "released" (budget.plan) costs a step, on the engine `eng` (None: an eager one made
    as setup makes it): {bytes of its K, V buffers, reserve_s: release, reserve and allocate them again;
    graphs: those a rollout captured (captured again every step once released); call_s: a short call (one
    chunk, min(16, new) new tokens) with the engine resident, released_s: the same right after a release
    (its buffers made and its graphs captured again); captures: that call's}; None without an engine."""
    widest = max(map(len, prompt_ids(tok, prompts)))
    eng = eng or preflight.make_engine(cfg, model, tok, widest, 0)
    if eng is None:
        return None
    dev = model.device
    sampling = Sampling.of(cfg)._replace(max_new_tokens=min(16, new))  # the run's, a short call
    kw = dict(n=cfg.group_size, sampling=sampling, chunk_size=cfg.gen_chunk, engine=eng)
    one = prompts[: max(1, cfg.gen_chunk // cfg.group_size)]  # one chunk of rows
    with torch.no_grad(), autocast:
        generate(model, tok, one, **kw)  # warm: graphs captured
        t0 = synced(dev)
        generate(model, tok, one, **kw)
        t1 = synced(dev)
        eng.release()
        t2 = synced(dev)
        eng.reserve(eng.rows, eng.S, eng.width, *eng.settings, eng.warp)
        eng.allocate(SimpleNamespace(layers=[]))  # in the model's dtype
        t3 = synced(dev)
        c = eng.captures
        eng.release()
        t4 = synced(dev)
        generate(model, tok, one, **kw)
        t5 = synced(dev)
    return dict(
        bytes=eng.keys.nbytes + eng.values.nbytes,
        reserve_s=t3 - t2,
        graphs=graphs,
        call_s=t1 - t0,
        released_s=t5 - t4,
        captures=eng.captures - c,
        eager=not eng.graphs,
    )


def line(e, unit, name):
    """release_cost's line, in `unit` bytes called `name` (GB on a GPU, MB on the CPU)."""
    graphs = "" if e["graphs"] is None else f"; the rollout captured {e['graphs']} graphs"
    return (
        f"engine release {e['bytes'] / unit:.2f} {name} of K, V made again in {e['reserve_s']:.4f} s"
        f"{graphs}; a 16-token call {e['call_s']:.3f} s resident, {e['released_s']:.3f} s released "
        f"({e['captures']} graph shape(s): "
        f"{'eager, none captured' if e['eager'] else 'captured again'})"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="engine_release.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument(
        "--model", default="qwen3-4b-random", help="a load.py name (qwen3-4b-random: no download)"
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the format only")
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="the response budget R")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt width (memory.py's default)")
    ap.add_argument("--prompts-per-step", type=int, default=16, help="prompts of the step (the 1K step: 16)")
    ap.add_argument("--group-size", type=int, default=8, help="G rollouts per prompt (App. C.3)")
    ap.add_argument("--gen-chunk", type=int, default=64, help="rows per generate call: the engine's rows")
    ap.add_argument("--json", default="", help="also write every number here")
    args = ap.parse_args(argv)
    if min(args.max_new_tokens, args.prompt_tokens, args.prompts_per_step, args.gen_chunk) < 1:
        ap.error("--max-new-tokens, --prompt-tokens, --prompts-per-step and --gen-chunk must be >= 1")
    if args.group_size < 2:
        ap.error("--group-size must be >= 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible (--device cpu --model tiny-qwen3 shows the format)")
    flags = dict(
        model=args.model,
        device=args.device,
        max_new_tokens=args.max_new_tokens,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        gen_chunk=args.gen_chunk,
    )
    cfg = grpo.parse_args([x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))])
    model, tok = load_model(args.model, device=args.device)  # bf16 on CUDA, fp32 on the CPU
    g = torch.Generator().manual_seed(0)
    prompts = [
        "".join(chr(32 + int(c)) for c in torch.randint(95, (args.prompt_tokens,), generator=g))
        for _ in range(args.prompts_per_step)
    ]  # random printable text, as gpu_headline.py's
    widest = max(map(len, prompt_ids(tok, prompts)))
    eng = preflight.make_engine(cfg, model, tok, widest, 0)
    e = release_cost(cfg, model, tok, prompts, eng, args.max_new_tokens, contextlib.nullcontext(), None)
    if e is None:
        print(f"{args.model}: no decode engine for this model (grpo.py decodes with HF generate)")
        return None
    unit, name = (1e9, "GB") if args.device == "cuda" else (1e6, "MB")
    print(
        f"{args.model} on {args.device}: {args.prompts_per_step} prompts x {args.group_size}, gen_chunk "
        f"{args.gen_chunk}, {args.prompt_tokens} + {args.max_new_tokens} tokens"
    )
    print(line(e, unit, name))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "result": e}, indent=1))
    return e


if __name__ == "__main__":
    main()
