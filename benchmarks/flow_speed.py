"""Time the vectorised flow (two triangular solves) against the per-token loop reference of eq. 2-4.

The loop is the one in tests/test_flowtracer.py (taken straight from the equations, in Python floats).
It does ~3.5 T^2 Python-level multiply-adds; where a full run would exceed the time budget it is run
at a smaller T and scaled by (T / T_run)^2, which the output states.

--solves times trace_flow's pieces alone on --rows rows at once (the 8K update's micro-batch is 4): the fp64
copy of -M (_neg_dag), the h solve (I - M) h = 1_A, the g solve (I - M^T) g = s / h, and trace_flow whole;
then the same two solves in fp32, and whether h stays exact in fp32: every node reachable in fp64 still
reachable (h > 0), and max |h32 - h64| / h64 <= T 2^-24 (a triangular solve's forward-error scale). h decays
geometrically with the distance to the answer (flowtracer.py departure 1); on the synthetic map below its
smallest value is 9e-11 at T = 1024, 2e-39 at 4096 and 1e-77 at 8192, where 3,629 of 8,192 nodes underflow
to 0 in fp32 (measured on the CPU: the values do not depend on the device). trace_flow stays fp64.

Run: python benchmarks/flow_speed.py [--sizes 256 1024 4096] [--device cuda]
     python benchmarks/flow_speed.py --solves --device cuda             # T = 1024 and 8192, 4 rows
     python benchmarks/flow_speed.py --solves --sizes 128 --rows 2      # the format, on a CPU, in seconds
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_flowtracer import reference_flow  # noqa: E402

from flowtracer import _neg_dag, trace_flow  # noqa: E402


def synthetic_attention(T, device):
    """Softmax attention with a BOS sink and local decay, like a middle layer of a real model."""
    k = torch.arange(T, dtype=torch.float32, device=device)
    dist = k[:, None] - k[None, :]
    scores = (-dist / 16.0).masked_fill(dist < 0, -math.inf)
    scores[:, 0] = 2.0
    attn = scores.softmax(-1)
    q = torch.zeros(T, dtype=torch.bool, device=device)
    q[1 : max(2, T // 8)] = True  # the question
    a = torch.zeros(T, dtype=torch.bool, device=device)
    a[T - 6 : T - 1] = True  # the answer
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
    while T_run > 64 and (T_run / 1024) ** 2 * 2.0 > budget_s:  # ~2 s at T=1024 on 2 CPU cores
        T_run //= 2
    sub, qs, as_ = synthetic_attention(T_run, "cpu")
    rows = sub.double().tolist()
    t0 = time.perf_counter()
    reference_flow(rows, qs.tolist(), as_.tolist())
    dt = time.perf_counter() - t0
    return dt * (T / T_run) ** 2, T_run


def timed(fn, device, repeats):
    """Median seconds of fn() over `repeats` calls after one warm-up, synchronised on CUDA; and its result."""
    out = fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def solve_pieces(A, a, q, device, repeats):
    """Seconds of trace_flow's two solves on -M^T = A (its dtype), and h: (t_h, t_g, h)."""
    t_h, h = timed(
        lambda: torch.linalg.solve_triangular(
            A.mT, a.to(A.dtype).unsqueeze(-1), upper=True, unitriangular=True
        ).squeeze(-1),
        device,
        repeats,
    )  # (B, T) (I - M) h = 1_A (eq. 2)
    src = (q & (h > 0)).to(A.dtype)  # (B, T)
    s_over_h = src / src.sum(-1, keepdim=True).clamp_min(1) / h.clamp_min(torch.finfo(A.dtype).tiny)
    rhs = torch.where(h > 0, s_over_h, torch.zeros_like(h)).unsqueeze(-1)  # (B, T, 1) s / h
    t_g, _ = timed(
        lambda: torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True), device, repeats
    )  # (I - M^T) g = s / h
    return t_h, t_g, h


def solves(T, rows, device, repeats):
    """trace_flow's pieces on `rows` copies of the synthetic (T, T) map, fp64 then fp32 (module docstring)."""
    attn, q, a = synthetic_attention(T, device)
    attn, q, a = attn.expand(rows, T, T).contiguous(), q.expand(rows, T), a.expand(rows, T)  # (B, T, T)
    v = torch.ones_like(a)  # (B, T)
    t_copy, A64 = timed(lambda: _neg_dag(attn, a, v), device, repeats)  # (B, T, T) -M^T, fp64
    t_all, _ = timed(lambda: trace_flow(attn, q, a), device, repeats)
    h64_t, g64_t, h64 = solve_pieces(A64, a, q, device, repeats)
    A32 = A64.float()
    del A64
    h32_t, g32_t, h32 = solve_pieces(A32, a, q, device, repeats)
    h64, h32 = h64[0], h32[0].double()  # (T,) row 0
    both = (h64 > 0) & (h32 > 0)
    lost = int(((h64 > 0) & (h32 == 0)).sum())
    rel = float(((h32 - h64).abs() / h64)[both].max()) if bool(both.any()) else 0.0
    return {
        "fp64": {"copy": t_copy, "h_solve": h64_t, "g_solve": g64_t, "trace_flow": t_all},
        "fp32": {"copy": None, "h_solve": h32_t, "g_solve": g32_t, "trace_flow": None},
        "check": {
            "reachable": int((h64 > 0).sum()),
            "lost": lost,
            "min_h64": float(h64[h64 > 0].min()),
            "max_rel": rel,
            "exact": lost == 0 and rel <= T * 2.0**-24,
        },
    }


def show_solves(args):
    print(
        f"device={args.device} torch={torch.__version__} rows={args.rows} repeats={args.repeats}: "
        f"trace_flow's solves alone (median seconds)"
    )
    print(f"{'T':>6} {'dtype':>6} {'copy -M':>10} {'h solve':>10} {'g solve':>10} {'trace_flow':>11}")
    f = lambda x: f"{x:10.4f}" if x is not None else f"{'-':>10}"  # noqa: E731
    for T in args.sizes:
        res = solves(T, args.rows, args.device, args.repeats)
        for name in ("fp64", "fp32"):
            r = res[name]
            print(
                f"{T:>6} {name:>6} {f(r['copy'])} {f(r['h_solve'])} {f(r['g_solve'])} "
                f"{f(r['trace_flow']):>11}"
            )
        c = res["check"]
        verdict = "exact in fp32" if c["exact"] else "NOT exact in fp32: keep fp64"
        print(
            f"       h: {c['reachable']} of {T} nodes reachable in fp64 (smallest h {c['min_h64']:.3g}); "
            f"{c['lost']} underflow to 0 in fp32; max |h32 - h64| / h64 = {c['max_rel']:.3g} "
            f"(bound T 2^-24 = {T * 2.0**-24:.3g}): {verdict}"
        )


def main():
    p = argparse.ArgumentParser(
        prog="flow_speed.py",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="lengths T to time; None: 256 1024 4096, or 1024 8192 with --solves",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the vectorised flow runs")
    p.add_argument(
        "--solves",
        action="store_true",
        help="trace_flow's solves alone, fp64 and fp32, and whether h is exact in fp32",
    )
    p.add_argument("--rows", type=int, default=4, help="--solves: rows solved at once (8K micro-batch: 4)")
    p.add_argument("--repeats", type=int, default=3, help="--solves: timed calls per piece (median)")
    args = p.parse_args()
    args.sizes = args.sizes or ([1024, 8192] if args.solves else [256, 1024, 4096])
    if min(args.sizes) < 2:
        p.error("--sizes must be >= 2")
    if args.rows < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible")
    if args.solves:
        show_solves(args)
        return
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
