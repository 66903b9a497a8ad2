"""Time the vectorised flow (two triangular solves) against the per-token loop reference of eq. 2-4.

The loop is the one in tests/test_flowtracer.py (taken straight from the equations, in Python floats).
It does ~3.5 T^2 Python-level multiply-adds; where a full run would exceed the time budget it is run
at a smaller T and scaled by (T / T_run)^2, which the output states.

Run: python benchmarks/flow_speed.py [--sizes 256 1024 4096] [--device cuda]
"""
import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from flowtracer import trace_flow  # noqa: E402

from test_flowtracer import reference_flow  # noqa: E402


def synthetic_attention(T, device):
    """Softmax attention with a BOS sink and local decay, like a middle layer of a real model."""
    k = torch.arange(T, dtype=torch.float32, device=device)
    dist = k[:, None] - k[None, :]
    scores = (-dist / 16.0).masked_fill(dist < 0, -math.inf)
    scores[:, 0] = 2.0
    attn = scores.softmax(-1)
    q = torch.zeros(T, dtype=torch.bool, device=device); q[1:max(2, T // 8)] = True
    a = torch.zeros(T, dtype=torch.bool, device=device); a[T - 6:T - 1] = True
    return attn, q, a


def time_fast(attn, q, a, repeats=3):
    trace_flow(attn, q, a)  # warm-up
    if attn.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        trace_flow(attn, q, a)
    if attn.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def time_loop(attn, q, a, budget_s=20.0):
    """Run the reference in full when it fits the budget, else scale from a smaller T (cost ~ T^2)."""
    T = attn.shape[0]
    T_run = T
    while T_run > 64 and (T_run / 1024) ** 2 * 2.0 > budget_s:   # ~2 s at T=1024 on 2 CPU cores
        T_run //= 2
    sub, qs, as_ = synthetic_attention(T_run, "cpu")
    rows = sub.double().tolist()
    t0 = time.perf_counter()
    reference_flow(rows, qs.tolist(), as_.tolist())
    dt = time.perf_counter() - t0
    return dt * (T / T_run) ** 2, T_run


def main():
    p = argparse.ArgumentParser(prog="flow_speed.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="lengths T to time")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the vectorised flow runs")
    args = p.parse_args()
    if min(args.sizes) < 2:
        p.error("--sizes must be >= 2")
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'T':>6} {'fast (s)':>10} {'loop (s)':>12} {'loop run at T':>14} {'speed-up':>10}")
    for T in args.sizes:
        attn, q, a = synthetic_attention(T, args.device)
        t_fast = time_fast(attn, q, a)
        t_loop, T_run = time_loop(attn.cpu(), q.cpu(), a.cpu())
        note = "" if T_run == T else f" (loop run at T={T_run}, scaled by T^2)"
        print(f"{T:>6} {t_fast:>10.4f} {t_loop:>12.2f} {T_run:>14} {t_loop / t_fast:>9.0f}x{note}")


if __name__ == "__main__":
    main()
