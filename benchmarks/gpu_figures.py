"""What each part of benchmarks/gpu_report.py leaves (its figures, read from its JSON, log or JUnit XML),
and the goals of docs/gpu.md judged on them: met, short, or why there is no figure.

Run:  python benchmarks/gpu_figures.py runs/gpu-report/report.jsonl   # a report's goals judged again
Test: python -m pytest -q tests/benchmarks/test_gpu_report.py
"""

import argparse
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, NamedTuple

GB = 1e9  # training/memory/budget.py's unit


# ----------------------------------------------------------------------------- what each part leaves
def read_json(path):
    return json.loads(path.read_text()) if path.is_file() else None


def preflight_figures(out, log):
    lines = [s for s in log.splitlines() if s.startswith(("preflight:", "engine:"))]
    t = re.search(r"^preflight: .* ran on \S+ in ([\d.]+) s", log, re.M)
    return {"lines": lines, "preflight_s": float(t.group(1)) if t else None} if lines else None


def step_figures(name):
    """gpu_headline.py's --json (one budget) as the report's figures: memory in GB, the step's times."""

    def figures(out, log):
        res = read_json(out / f"{name}.json")
        if not res:
            return None
        r = res["results"][0]
        o, g = r["overhead"], r["generation"]
        mem = {
            ph: {k: m[k] / GB if m[k] is not None else None for k in ("estimate", "allocated", "reserved")}
            for ph, m in r["memory"].items()
        }  # GB
        for ph, m in mem.items():
            m["ratio"] = r["memory"][ph]["ratio"]  # estimate / allocated
        keys = ("rows", "max_new_tokens", "gen_chunk", "micro_batch")
        return {
            **{k: r[k] for k in keys},
            "generate_s": o["generate_s"],
            "update_none_s": o["update_none_s"],
            "update_flow_s": o["update_flow_s"],
            "step_s": o["step_flow_s"],
            "flow_of_update": o["of_update"],
            "tok_s": g["tok_s"],
            "of_bound": g["of_bound"],
            "memory": mem,
            "peak_gb": max(max(m["allocated"], m["reserved"] or 0) for m in mem.values()),
        }

    return figures


def decoder_figures(name, beside=None):
    """decode_speed.py's --json as the report's figures; beside: another part whose engine's tok/s on the
    same rows is read too (`beside_tok_s`: full fine-tuning's, beside LoRA's)."""

    def figures(out, log):
        res = read_json(out / f"{name}.json")
        if not res:
            return None
        tok_s = {k: d["tok_s"] for k, d in res["speed"].items()}
        f = {
            "tok_s": tok_s,
            "rows": res["rows"],
            "greedy_equal_fp32": res["equal"]["float32"],
            "engine_x": {k: tok_s["engine"] / v for k, v in tok_s.items() if k != "engine"},
            "of_bound": tok_s["engine"] / res["bound_tok_s"],
            "captures": res["captures"],
        }
        other = read_json(out / f"{beside}.json") if beside else None
        if beside:
            f["beside_tok_s"] = other["speed"]["engine"]["tok_s"] if other else None
        return f

    return figures


def lora_check(f):
    """LoRA's engine tok/s against full fine-tuning's on the same rows (the decoders part's)."""
    if f["beside_tok_s"] is None:
        return "no full fine-tuning figure (decoders did not run)", False
    r = f["tok_s"]["engine"] / f["beside_tok_s"]
    return f"{100 * r:.0f}% ({f['tok_s']['engine']:.0f} / {f['beside_tok_s']:.0f} tok/s)", r >= 0.7


def backward_figures(name):
    """eval.py memory --measure --snapshot's log and its snapshot's sums (<name>.pickle.json): each phase's
    estimate and allocated peak (GB) and their ratio, and the backward's peak by site, largest first."""

    def figures(out, log):
        rows = re.findall(
            r"^  (\S.*?)\s+estimate\s+([\d.]+)\s+measured\s+([\d.]+)\s+ratio ([\d.]+)$", log, re.M
        )
        held = read_json(out / f"{name}.pickle.json")
        if not rows or not held:
            return None
        memory = {
            ph: {"estimate": float(e), "allocated": float(m), "ratio": float(r)} for ph, e, m, r in rows
        }
        sites = [{"gb": n / GB, "blocks": b, "site": site} for n, b, site in held["rows"][:12]]
        return {
            "memory": memory,
            "peak_gb": held["peak"] / GB,
            "before_gb": held["before"] / GB,
            "sites": sites,
        }

    return figures


def backward_check(f):
    """The backward's estimate / allocated, within 3% of 1."""
    r = f["memory"]["backward"]["ratio"]
    return f"estimate/allocated {r:.3f}, peak {f['peak_gb']:.2f} GB", abs(r - 1) <= 0.03


def suite_figures(out, log):
    """Counts of the JUnit XML pytest wrote: all tests, and the cases whose id names cuda."""
    if not (out / "suite.xml").is_file():
        return None
    count = {"all": {}, "cuda": {}}
    for case in ET.parse(out / "suite.xml").iter("testcase"):
        kinds = {c.tag for c in case} & {"failure", "error", "skipped"}
        outcome = (
            {"failure": "failed", "error": "errors", "skipped": "skipped"}[min(kinds)] if kinds else "passed"
        )
        for k in ("all", "cuda") if "cuda" in case.get("name", "") else ("all",):
            count[k][outcome] = count[k].get(outcome, 0) + 1
    return count


# ----------------------------------------------------------------------------- the goals
def worst_phase(f):
    """The phase whose estimate / allocated is furthest from 1, and whether it is within 10%."""
    ph, m = max(f["memory"].items(), key=lambda kv: abs(kv[1]["ratio"] - 1))
    return f"worst {ph}: estimate/allocated {m['ratio']:.3f}", abs(m["ratio"] - 1) <= 0.10


def counts(c):
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"


def suite_check(f):
    bad = f["all"].get("failed", 0) + f["all"].get("errors", 0)
    return f"{counts(f['all'])} (cuda cases: {counts(f['cuda'])})", bad == 0


class Goal(NamedTuple):
    text: str
    part: str
    check: Callable  # the part's figures -> (the figure shown, met)


GOALS = [  # docs/gpu.md's targets
    Goal(
        "generation >= 50% of the bandwidth bound (1K)",
        "headline",
        lambda f: (f"{100 * f['of_bound']:.1f}%", f["of_bound"] >= 0.5),
    ),
    Goal(
        "the 1K step of 128 rows <= 45 s",
        "headline",
        lambda f: (f"{f['step_s']:.1f} s, {f['rows']} rows", f["step_s"] <= 45),
    ),
    Goal(
        "flow credit <= 3% of the update (1K)",
        "headline",
        lambda f: (f"{100 * f['flow_of_update']:.1f}%", f["flow_of_update"] <= 0.03),
    ),
    Goal("every phase within 10% of its estimate (1K)", "headline", worst_phase),
    Goal("every phase within 10% of its estimate (LoRA, 24 GB)", "lora24", worst_phase),
    Goal("the LoRA step under 24 GB", "lora24", lambda f: (f"peak {f['peak_gb']:.2f} GB", f["peak_gb"] < 24)),
    Goal("the backward within 3% of its estimate (1K, each prompt read once)", "backward", backward_check),
    Goal(
        "the backward within 3% of its estimate (1K, --no-share-prefix)", "backward-unshared", backward_check
    ),
    Goal(
        "the engine's greedy rows equal HF's in fp32",
        "decoders",
        lambda f: (
            f"{f['greedy_equal_fp32']['engine']}/{f['rows']}; {f['engine_x']['HF dynamic']:.2f}x HF dynamic",
            f["greedy_equal_fp32"]["engine"] == f["rows"],
        ),
    ),
    Goal("LoRA's generation >= 70% of full fine-tuning's tok/s (same rows)", "lora", lora_check),
    Goal(
        "the engine >= 2x HF's static cache",
        "static",
        lambda f: (f"{f['engine_x']['HF static']:.2f}x", f["engine_x"]["HF static"] >= 2),
    ),
    Goal("the suite on CUDA with 0 failed", "suite", suite_check),
]


def goals(records):
    """(goal, figure, verdict) for each of GOALS: "met", "short", or why its part left no figure."""
    rec, out = {r["part"]: r for r in records}, []
    for g in GOALS:
        r = rec.get(g.part)
        if r is None:
            out.append((g.text, "-", "not run (--parts)"))
        elif not r["figures"] or "error" in r["figures"]:
            out.append((g.text, "-", r.get("why") or f"{r['status']}: no figure (its log: {r['log']})"))
        else:
            shown, met = g.check(r["figures"])
            out.append((g.text, shown, "met" if met else "short"))
    return out


def table(records):
    """The goals as gpu_report.py prints them at its end: one line each, its figure and its verdict."""
    lines = [f"{'goal':<70}{'figure':<44}verdict"]
    return "\n".join(lines + [f"{t:<70}{f:<44}{v}" for t, f, v in goals(records)])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="gpu_figures.py", description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a report.jsonl that benchmarks/gpu_report.py wrote")
    args = ap.parse_args(argv)
    try:
        lines = Path(args.report).read_text().splitlines()
        records = [json.loads(s) for s in lines if s.strip()]
    except (OSError, ValueError) as e:
        ap.error(f"{args.report}: {e}")
    if not records or records[0].get("part") != "device":
        ap.error(f"{args.report}: not a report of gpu_report.py (its first line names the device)")
    print(f"{records[0].get('device', '?')}, {records[0].get('date', '?')}\n" + table(records[1:]))


if __name__ == "__main__":
    main()
