"""The GPU's decoders on the same rows: training/decode/engine.py against HF generate, beside the bandwidth
bound.

In one run on the same rows: training/decode/engine.py (rollout.generate's path on CUDA: static cache, its
fused step compiled, CUDA graphs, sampling without a sync; one engine.Engine kept for the run, eager on the
CPU), with --model-step the same engine on the model's own forward (its step before the fused one), HF
generate with its dynamic cache and HF generate with cache_implementation="static" (compiled on CUDA by HF;
every decoder is called once before timing, so compilation and graph capture are not timed: the engine's
captures, warm-up and timed, are printed; --no-static leaves the static cache and its compilation out, the
ratios then to HF's dynamic cache). --lora-rank R runs every decoder on the model under peft's adapters of
rank R on every linear (B drawn small, LORA_B: they act), as grpo.py --lora-rank decodes. For each: tok/s,
ms per decode step (wall seconds / the sum over chunks of the chunk's longest response: prefill included)
and its share of the memory-bandwidth bound; then how many greedy rows each equals HF generate's (dynamic),
in fp32 and in bf16. The timing runs in bf16, greedy (--sampled:
App. C.3 sampling), at the shape
  gpu        8 prompts x 8 rows, 256-token prompts (a shared 224-token preamble, then 32 of the question),
             256 new tokens (--max-new-tokens), gen_chunk 64: docs/gpu.md's decode table
  tiny       2 prompts x 4 rows, 32-token prompts, 16 new tokens, gen_chunk 8: the CPU smoke test
`python benchmarks/generate_speed.py --device cuda` (or --engine on the CPU) runs this table too.

The bound (bandwidth_bound; benchmarks/gpu_headline.py's generation line reads it too): each decode step
reads every weight once and the KV cache of its rows,
  bytes = sum over chunks of g rows, over steps t = P .. P+R-1, of (weight bytes + g t 2 L Hkv hd kv_bytes)
  bound tok/s = generated tokens * bandwidth / bytes   (the card's: CARD_BANDWIDTH)

Departures (numbered):
 1. The bandwidth bound leaves out the prefill (compute-bound) and sampling; it is an upper bound on a
    perfectly bandwidth-bound decoder, not a prediction. Each row reads its keys up to its own length, as
    the engine's fused step does under FlexAttention (CUDA, compiled); its SDPA fallback reads all S keys,
    masked, and a finished row of the engine reads one key block until its chunk ends.

Run:  python benchmarks/decode_speed.py --model qwen3-4b-random --rounds 2            # the GPU table
      python benchmarks/decode_speed.py --model qwen3-4b-random --no-static --model-step --lora-rank 16
      python benchmarks/decode_speed.py --model qwen3-4b-random --rounds 2 --no-static --json runs/d.json
      python benchmarks/decode_speed.py --device cpu --model tiny-qwen3 --shape tiny --rounds 1
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import grpo  # noqa: E402
from training.decode.engine import Engine  # noqa: E402
from training.decode.rollout import Sampling, generate, prompt_ids  # noqa: E402
from training.model.load import load_model  # noqa: E402
from training.model.lora import with_lora  # noqa: E402

H100_BANDWIDTH = 3.35e12  # bytes/s, H100 SXM5 HBM3
# Memory bandwidth (bytes/s) of the cards the bound is drawn for, from their datasheets; the first name a
# card's torch.cuda.get_device_name contains is taken, and any other card is counted as an H100 SXM, said so.
CARD_BANDWIDTH = {
    "H200": 4.8e12,
    "H100": H100_BANDWIDTH,
    "A100": 2.0e12,
    "L40": 0.864e12,
    "L4": 0.3e12,
    "T4": 0.32e12,
}


def card_bandwidth(device):
    """The bound's bandwidth for `device` (bytes/s) and the card it was read for (e.g. "H200", or "H100,
    assumed" for a card the table lacks, the CPU included)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for card, bw in CARD_BANDWIDTH.items():
        if card in name:
            return bw, card
    return H100_BANDWIDTH, "H100, assumed"


SHAPES = {
    "gpu": dict(prompts=8, group_size=8, max_new_tokens=256, gen_chunk=64),
    "tiny": dict(prompts=2, group_size=4, max_new_tokens=16, gen_chunk=8),
}
WIDTH = {"gpu": 256, "tiny": 32}  # prompt tokens: a shared preamble, then the question
DECODERS = ("engine", "model step", "HF dynamic", "HF static")
LORA_B = 1e-3  # --lora-rank: the adapters' B drawn N(0, LORA_B^2) (peft starts at 0), so they act


def wide_prompts(tok, width, n):
    """n prompts of `width` tokens: a shared preamble of few-shot exemplars repeated to 7/8 of the width,
    then each question (cut or padded with its own words) to the rest."""
    recs = data.load_task("arithmetic", split="train", seed=0)[:n]
    shot = data.make_prompt(recs[0], tok, "fewshot3")
    pre = tok.decode((tok(shot).input_ids * 2)[: width - width // 8])
    own = [tok(" ".join([r["question"]] * 8)).input_ids[: width // 8] for r in recs]
    return [pre + tok.decode(q) for q in own]


def bandwidth_bound(model, cfg, P, bandwidth):
    """Generated tokens/s if every decode step only read the weights and its rows' KV cache (departure 1)."""
    mc, R, B = model.config, cfg.max_new_tokens, cfg.prompts_per_step * cfg.group_size
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv_bytes = 2 if model.device.type == "cuda" else model.dtype.itemsize  # bf16 under autocast
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * hd * kv_bytes  # K and V, every layer
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    chunks = [min(cfg.gen_chunk, B - c) for c in range(0, B, cfg.gen_chunk)]
    total = sum(R * weights + g * per_token * (R * P + R * (R - 1) / 2) for g in chunks)
    return B * R * bandwidth / total


def adapted(model, rank):
    """`model` under peft's LoRA adapters of `rank` on every linear (grpo.py --lora-rank's), B random
    (LORA_B, seeded) so that the adapters change the rows."""
    pm, g = with_lora(model, grpo.Config(lora_rank=rank)), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * LORA_B)
    return pm


def decoders(model, tok, prompts, s, greedy, eng, static=True, before=None):
    """{name: call} of the GPU table's decoders on the same rows (static=False: without HF's static cache;
    before: an engine on the model step, Engine(fused=False), the engine's step before its fused one), each
    giving Generations; the engine decodes through `eng`, kept for the run (graphs on CUDA; eager on the
    CPU)."""
    new = s["max_new_tokens"]
    sampling = Sampling(new, greedy=True) if greedy else Sampling.of(grpo.Config(max_new_tokens=new))  # C.3
    kw = dict(n=s["group_size"], sampling=sampling, chunk_size=s["gen_chunk"])
    calls = {
        "engine": lambda: generate(model, tok, prompts, engine=eng, **kw),
        "model step": lambda: generate(model, tok, prompts, engine=before, **kw),
        "HF dynamic": lambda: generate(model, tok, prompts, share_prefix=False, **kw),
        "HF static": lambda: generate(
            model, tok, prompts, share_prefix=False, cache_implementation="static", **kw
        ),
    }
    left = {"HF static"} if not static else set()
    return {k: c for k, c in calls.items() if k not in left | ({"model step"} if before is None else set())}


def timed(call, device):
    """(wall seconds, generations) of one call, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    g = call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, g


def compare(args, s):
    """--device cuda / --engine: the three decoders timed (bf16), the bound, the greedy rows equal to HF's."""
    rank, step = getattr(args, "lora_rank", 0), getattr(args, "model_step", False)
    names = [k for k in DECODERS if (k != "HF static" or not args.no_static) and (k != "model step" or step)]
    device, equal, speed, bound, calls = torch.device(args.device), {}, {k: [] for k in names}, None, None
    captures = None
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (README)
    for dtype in (torch.bfloat16, torch.float32):
        model, tok = load_model(args.model, device=device, dtype=dtype)
        model = adapted(model, rank) if rank else model
        prompts = wide_prompts(tok, WIDTH[args.shape], s["prompts"])
        lens = [len(p) for p in prompt_ids(tok, prompts)]
        torch.manual_seed(0)
        eng = Engine(model, graphs=device.type == "cuda")  # kept: captures are not timed
        before = Engine(model, graphs=device.type == "cuda", fused=False) if step else None
        both = (not args.no_static, before)
        greedy = {k: call() for k, call in decoders(model, tok, prompts, s, True, eng, *both).items()}  # warm
        ref = greedy["HF dynamic"].response_ids
        equal[str(dtype)[6:]] = {
            k: sum(a == b for a, b in zip(g.response_ids, ref)) for k, g in greedy.items()
        }
        if dtype == torch.bfloat16:
            calls = decoders(model, tok, prompts, s, not args.sampled, eng, *both)
            for call in calls.values() if args.sampled else []:  # warm-up: sampling's graphs
                call()
            warm = eng.captures
            for r in range(args.rounds):
                for k in names if r % 2 == 0 else names[::-1]:
                    torch.manual_seed(r)
                    sec, g = timed(calls[k], device)
                    c = s["gen_chunk"]
                    steps = sum(max(map(len, g.response_ids[i : i + c])) for i in range(0, len(ref), c))
                    speed[k].append((sec, sum(map(len, g.response_ids)), steps))
                    print(
                        f"round {r + 1}: {k:<11}{sec:8.2f} s  {speed[k][-1][1]} tokens  {steps} steps",
                        flush=True,
                    )
            cfg = SimpleNamespace(
                max_new_tokens=s["max_new_tokens"],
                prompts_per_step=s["prompts"],
                group_size=s["group_size"],
                gen_chunk=s["gen_chunk"],
            )
            bandwidth, card = card_bandwidth(device)
            bound = bandwidth_bound(model, cfg, max(lens), bandwidth)
            captures = (warm, eng.captures - warm, eng.graphs)
        model = greedy = calls = eng = before = None  # the next dtype's model: alone
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows = s["prompts"] * s["group_size"]
    print(
        f"\n{args.model} on {device.type}: {s['prompts']} prompts x {s['group_size']}, prompt tokens "
        f"{min(lens)}-{max(lens)}, {s['max_new_tokens']} new tokens, gen_chunk {s['gen_chunk']}, bf16, "
        f"{'sampled (App. C.3)' if args.sampled else 'greedy'}, medians of {args.rounds} round(s)"
        + (f", LoRA rank {rank} on every linear" if rank else "")
    )
    print(f"bandwidth bound {bound:.1f} tok/s ({card} {bandwidth / 1e12:.2f} TB/s: weights + KV per step)")
    print(
        f"engine graphs: {captures[0]} captured in the warm-up, {captures[1]} in the timed rounds"
        f"{'' if captures[2] else ' (eager: the captures it would make)'}"
    )
    base = names[-1]  # HF static, or HF dynamic
    print(
        f"{'decoder':<12}{'tok/s':>10}{'ms/step':>10}{'of bound':>10}{'x ' + base:>14}"
        f"{'greedy = HF fp32':>18}{'bf16':>6}"
    )
    res = {
        k: dict(
            tok_s=statistics.median(t / sec for sec, t, _ in v),
            ms_step=statistics.median(1e3 * sec / n for sec, _, n in v),
        )
        for k, v in speed.items()
    }
    for k, d in res.items():
        print(
            f"{k:<12}{d['tok_s']:>10.1f}{d['ms_step']:>10.2f}{100 * d['tok_s'] / bound:>9.3g}%"
            f"{d['tok_s'] / res[base]['tok_s']:>14.2f}{equal['float32'][k]:>12}/{rows}"
            f"{equal['bfloat16'][k]:>3}/{rows}"
        )
    return {
        "speed": res,
        "equal": equal,
        "bound_tok_s": bound,
        "rows": rows,
        "captures": captures[:2],
        "tokens": {k: [t for _, t, _ in v] for k, v in speed.items()},
        "model": args.model,
        "device": args.device,
        "max_new_tokens": s["max_new_tokens"],
        "sampled": args.sampled,
        "lora_rank": rank,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="decode_speed.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument(
        "--device", default="cuda", choices=["cpu", "cuda"], help="cpu: the format (the engine eager)"
    )
    ap.add_argument("--model", default="qwen3-4b-random", help="a load.load_model name")
    ap.add_argument(
        "--shape", default="gpu", choices=SHAPES, help="gpu: docs/gpu.md's table; tiny: a smoke test"
    )
    ap.add_argument(
        "--sampled", action="store_true", help="time App. C.3 sampling instead of greedy decoding"
    )
    ap.add_argument("--max-new-tokens", type=int, default=0, help="override the shape's (0: the shape's)")
    ap.add_argument(
        "--no-static",
        action="store_true",
        help="leave out HF's static cache (and its compilation); ratios to HF's dynamic cache",
    )
    ap.add_argument("--model-step", action="store_true", help="+ the engine on the model's own forward")
    ap.add_argument("--lora-rank", type=int, default=0, help="every decoder on peft's adapters of this rank")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the decoders")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", default="", help="also write what is printed here")
    args = ap.parse_args(argv)
    if min(args.rounds, args.threads) < 1 or min(args.max_new_tokens, args.lora_rank) < 0:
        ap.error("--rounds and --threads must be >= 1, --max-new-tokens and --lora-rank >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible (--device cpu --shape tiny shows the format)")
    torch.set_num_threads(args.threads)
    s = SHAPES[args.shape]
    out = compare(args, {**s, "max_new_tokens": args.max_new_tokens or s["max_new_tokens"]})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
