"""The attention maps' memory: FlowTracer's capture against eager attention with output_attentions.

One no-grad forward of --rows rows of T tokens (--tokens: a table row each), its peak bytes three ways:
  plain     sdpa attention, no map kept
  capture   under attention.capturing: the middle layers' head mean, (b, T, T) fp32
  eager     eager attention with output_attentions: every layer's (b, H, T, T)
and the extra of each over the plain forward. Eager at 8K needs L b H T^2 2 bytes (~164 GB for one row of
Qwen3-4B): an out-of-memory error is reported as such, with that size. On a GPU the peaks are
memtrace.cuda_peak's (torch.cuda.max_memory_allocated), on the CPU memtrace.track_peak's count of live tensor
bytes. benchmarks/gpu_headline.py prints this table once, at its largest budget (P + R tokens).

Run:  python benchmarks/attention_memory.py                                 # one GPU: Qwen3-4B at 1K and 8K
      python benchmarks/attention_memory.py --model tiny-qwen3 --device cpu --tokens 48   # the format
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evaluation import memtrace  # noqa: E402
from flowtracer import select_layers  # noqa: E402
from training.credit.attention import capturing  # noqa: E402
from training.model.load import load_model  # noqa: E402


def attention_peaks(model, layers, rows, T):
    """{plain, capture, eager: peak bytes of one no-grad forward of `rows` rows of T tokens} (None: OOM)."""
    dev = model.device
    ids = torch.randint(256, (rows, T), generator=torch.Generator().manual_seed(1)).to(dev)  # (b, T)
    mask = torch.ones_like(ids)  # (b, T)
    tracker = memtrace.cuda_peak() if dev.type == "cuda" else memtrace.track_peak()
    impl, out = model.config._attn_implementation, {}
    model.eval()
    with torch.no_grad(), tracker as tr:
        for name in ("plain", "capture", "eager"):
            tr.phase(name)
            try:
                if name == "capture":
                    with capturing(model, mask, layers) as cap:
                        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
                    kept = cap.attn  # (b, T, T) fp32
                elif name == "eager":
                    model.set_attn_implementation("eager")
                    kept = model(
                        input_ids=ids,
                        attention_mask=mask,
                        use_cache=False,
                        logits_to_keep=1,
                        output_attentions=True,
                    ).attentions  # L x (b, H, T, T)
                else:
                    kept = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
                out[name] = True
            except torch.OutOfMemoryError:
                out[name] = None
            finally:
                kept = None  # noqa: F841  the next phase starts empty
                model.set_attn_implementation(impl)
        tr.phase(None)
    return {k: tr.peak[k] if ok else None for k, ok in out.items()}


def attention_maps(model, layers, rows, T):
    """attention_peaks, the extra of each over the plain forward, and the maps' own sizes (bytes)."""
    peaks = attention_peaks(model, layers, rows, T)
    mc = model.config
    eager_need = mc.num_hidden_layers * rows * mc.num_attention_heads * T * T * model.dtype.itemsize
    extra = {k: v - peaks["plain"] if v is not None and peaks["plain"] else None for k, v in peaks.items()}
    return dict(
        rows=rows,
        tokens=T,
        layers=len(select_layers(layers, mc.num_hidden_layers)),
        peak=peaks,
        extra=extra,
        eager_maps_bytes=eager_need,
        capture_maps_bytes=rows * T * T * 4,
    )


def show(a, unit, name):
    """attention_maps' table as text, in `unit` bytes called `name` (GB on a GPU, MB on the CPU)."""
    f = lambda v: f"{v / unit:10.2f}" if v is not None else f"{'-':>10s}"  # noqa: E731
    print(
        f"attention maps, one no-grad forward of {a['rows']} x {a['tokens']} tokens ({name}): "
        f"peak / extra over plain"
    )
    for k, why in (
        ("plain", "sdpa"),
        ("capture", f"attention.capturing, mean of {a['layers']} layer(s)"),
        ("eager", "eager, output_attentions"),
    ):
        oom = f"out of memory (the maps alone: {a['eager_maps_bytes'] / unit:.2f} {name})"
        print(
            f"  {k:8s} {f(a['peak'][k]) if a['peak'][k] is not None else oom:>10s}"
            f" {f(a['extra'][k]) if a['peak'][k] is not None else '':>10s}   {why}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="attention_memory.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument(
        "--model", default="qwen3-4b-random", help="a load.py name (qwen3-4b-random: no download)"
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the format only")
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1280, 8448],
        help="T of each forward (256-token prompts + 1K and 8K responses: gpu_headline.py's)",
    )
    ap.add_argument("--rows", type=int, default=1, help="rows of each forward")
    ap.add_argument("--layers", default="middle", help="the captured layers, as grpo.py's --layers")
    ap.add_argument("--json", default="", help="also write every number here")
    args = ap.parse_args(argv)
    if min(args.rows, *args.tokens) < 1:
        ap.error("--rows and --tokens must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible (--device cpu --model tiny-qwen3 shows the format)")
    device = torch.device(args.device)
    model, _ = load_model(args.model, device=device)  # bf16 on CUDA, fp32 on the CPU
    try:
        select_layers(args.layers, model.config.num_hidden_layers)
    except ValueError as e:
        ap.error(f"--layers: {e}")
    unit, name = (1e9, "GB") if device.type == "cuda" else (1e6, "MB")
    results = []
    for T in args.tokens:
        results.append(attention_maps(model, args.layers, args.rows, T))
        print(f"\n== {args.model} on {device.type} ==")
        show(results[-1], unit, name)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
