"""The learning experiment's results (eval.py learn; the grid: learn.py): from the finished arm-seeds to
learn.json, learn.md (the tables) and learn.png (held-out accuracy and training reward against step).

    summarize(g, runs, finals)   -> the markdown, the three files written atomically into g.out

Statistics over seeds, the replicated unit (stats.py): per arm, the mean gain (last step - step 0) +- a 95% t
interval; flow - none paired by seed: the mean difference, its t interval and p, a two-level bootstrap (seeds,
then questions), the exact sign-flip test, for the last step and the area under the held-out curve; the seeds
that a half-width of 0.05 would need. A question-level table follows, labelled: conditional on the trained
models. learn.py's docstring gives the setting and its departures.

Run: python eval.py learn --arms none,flow --seeds 2 -- --dataset arithmetic --steps 40
"""

import json

import numpy as np

from evaluation.probes import markdown, pyplot
from evaluation.stats import (
    fmt_p,
    paired_bootstrap,
    seed_test,
    seeds_needed,
    sign_test,
    t_interval,
    two_level,
    variance_parts,
)
from training.run import directory

QUESTION_KEYS = ("greedy", "greedy_lenient", "samples", "samples_lenient")  # per question, right of 1 / k
SCORES = {"acc": "", "acc_lenient": "_lenient", "mean@k": "_mean@k", "mean@k_lenient": "_mean@k_lenient"}


def summarize(g, runs, finals):
    """learn.json, learn.md, learn.png from the finished arm-seeds (learn.collect: runs per arm, finals per
    arm-seed), into the grid's g.out; returns the markdown. Every interval and p-value of the headline is
    over seeds (stats.py); the question-level tests are conditional on the trained models."""
    per_arm, vs_none, Q, B = {}, {}, len(g.recs), g.cfg.bootstrap
    for arm, rs in runs.items():
        per_arm[arm] = {
            "seeds": len(rs),
            "curve_columns": ["step", *SCORES],
            "final_acc": variance_parts([r["after"] for r in rs], Q),
        }
        for sfx in SCORES.values():
            if rs[0]["after" + sfx] is not None and rs[0]["after" + sfx] == rs[0]["after" + sfx]:  # no NaN
                m, h = t_interval([r["after" + sfx] - r["before" + sfx] for r in rs])
                per_arm[arm].update({f"gain{sfx}": m, f"gain{sfx}_ci95": h})
    for arm in (a for a in runs if a != "none" and "none" in runs):
        seeds = [s for s in g.seeds if (arm, s) in finals and ("none", s) in finals]
        by = {(r["seed"], x): r for x in (arm, "none") for r in runs[x]}
        vs = vs_none[arm] = {"seeds": seeds}
        for score, key in (("strict", "greedy"), ("lenient", "greedy_lenient")):
            a, b = ([finals[x, s][key] for s in seeds] for x in (arm, "none"))  # (S, Q) each
            vs[score] = seed_test(np.mean(a, 1), np.mean(b, 1)) if seeds else {}
            if seeds:
                vs[score]["two_level_ci95"] = list(two_level(a, b, B, seed=0)[1:])
                d, lo, hi, p = paired_bootstrap(a, b, B, seed=0)  # conditional on the models
                wins, losses, p_sign = sign_test(a, b)
                vs[score]["per_question"] = {
                    "diff": d,
                    "ci95": [lo, hi],
                    "p_bootstrap": p,
                    "arm_only": wins,
                    "none_only": losses,
                    "p_sign": p_sign,
                }
        vs["auc"] = seed_test([by[s, arm]["auc"] for s in seeds], [by[s, "none"]["auc"] for s in seeds])
        if len(seeds) > 1:
            sd = float(np.std([by[s, arm]["after"] - by[s, "none"]["after"] for s in seeds], ddof=1))
            vs["power"] = {
                "sd_diff": sd,
                "seeds_for_half_width_0.05": seeds_needed(sd, 0.05),
                "seeds_for_80pct_power_at_0.05": seeds_needed(sd, delta=0.05),
            }
    result = {**g.setting, "arms": runs, "summary": {"per_arm": per_arm, "vs_none": vs_none, "bootstrap": B}}
    directory.write_atomic(g.out / "learn.json", json.dumps(result))
    directory.write_atomic(g.out / "learn.md", table := report(g.setting, result["summary"], g.out))
    plot(g.out / "learn.png", runs)
    return table


def report(setting, summary, out):
    s, k, B = setting, setting["eval_k"], summary["bootstrap"]
    ci = lambda m, h: f"{m:+.3f} ± " + ("n/a" if h is None else f"{h:.3f}")  # noqa: E731
    iv = lambda x: "n/a" if not x else f"[{x[0]:+.3f}, {x[1]:+.3f}]"  # noqa: E731
    head = (
        f"Held-out: {s['eval_size']} questions of {s['eval_dataset']} (test split), evaluated at steps "
        "0, "
        f"{', '.join(map(str, s['eval_steps']))}. Recipe: `grpo.py {' '.join(s['recipe'])}`; "
        f"--out-dir `{out}`\n\n"
        "Every interval and p-value below is over seeds (the training run is the replicated unit).\n\n"
        "Gain = last - step 0, mean over seeds ± 95% t interval; the sd of the final accuracy over "
        "seeds, and (in brackets) the sd that the binomial noise of the held-out questions alone "
        "gives:\n\n"
    )
    cols = [
        c
        for c, x in zip(
            ["greedy strict", "greedy lenient", f"mean@{k} strict", f"mean@{k} lenient"], SCORES.values()
        )
        if k or "mean" not in x
    ]
    arms = markdown(
        ["arm", "seeds", *cols, "sd (binomial)"],
        [
            [
                a,
                r["seeds"],
                *(ci(r[f"gain{x}"], r[f"gain{x}_ci95"]) for x in SCORES.values() if f"gain{x}" in r),
                f"{r['final_acc']['sd']:.3f} ({r['final_acc']['binomial_sd']:.3f})",
            ]
            for a, r in summary["per_arm"].items()
        ],
    )
    rows, cond, power = [], [], []
    names = {"strict": "greedy strict", "lenient": "greedy lenient", "auc": "area (mean of steps > 0)"}
    for a, v in ((a, v) for a, v in summary["vs_none"].items() if v["seeds"]):
        for sc, name in names.items():
            x = v[sc]
            rows.append(
                [
                    f"{a} - none",
                    name,
                    len(v["seeds"]),
                    f"{x['diff']:+.3f}",
                    iv(x["ci95"]),
                    fmt_p(x["p_t"]),
                    iv(x.get("two_level_ci95")),
                    f"{fmt_p(x['p_signflip'])} (min {x['p_signflip_min']:.3g})",
                ]
            )
        for sc in ("strict", "lenient"):
            q = v[sc]["per_question"]
            cond.append(
                [
                    f"{a} - none",
                    sc,
                    f"{q['diff']:+.3f}",
                    iv(q["ci95"]),
                    fmt_p(q["p_bootstrap"], B),
                    f"{q['arm_only']} : {q['none_only']}",
                    fmt_p(q["p_sign"]),
                ]
            )
        if "power" in v:
            pw = v["power"]
            power.append(
                f"{a} - none: sd of the per-seed difference {pw['sd_diff']:.3f}; seeds per arm for "
                f"a 95% half-width of 0.05: {pw['seeds_for_half_width_0.05']}; for 80% power to "
                f"detect +0.05: {pw['seeds_for_80pct_power_at_0.05']}."
            )
    paired = markdown(
        [
            "arms",
            "score",
            "seeds",
            "Δ",
            "95% t interval",
            "p (paired t)",
            "two-level bootstrap 95%",
            "p (exact sign flip)",
        ],
        rows,
    )
    second = markdown(
        ["arms", "score", "Δ", "bootstrap 95% CI", "p (bootstrap)", "arm only : none only", "p (sign test)"],
        cond,
    )
    return (
        head
        + arms
        + "\nPaired by seed, last step (and the area under the held-out curve):\n\n"
        + paired
        + ("\n" + "\n".join(power) + "\n" if power else "")
        + "\nSecondary, by (seed, question) pair: conditional on these trained models; not a test of the "
        "method:\n\n" + second
    )


def plot(path, runs):
    """Held-out accuracy and training reward against step: each arm's mean over seeds with a 95% t band,
    the individual seeds faintly."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, rs in runs.items():
        for ax, pts in zip(axes, ([[c[:2] for c in r["curve"]] for r in rs], [r["reward"] for r in rs])):
            steps = sorted(set.intersection(*({s for s, _ in p} for p in pts)))
            if not steps:
                continue
            ys = np.array([[dict(map(tuple, p))[s] for s in steps] for p in pts])  # (seeds, steps)
            (line,) = ax.plot(steps, ys.mean(0), label=f"{arm} (n={len(rs)})")
            for y in ys:
                ax.plot(steps, y, color=line.get_color(), alpha=0.15, lw=0.7)
            if len(ys) > 1:
                h = [t_interval(col)[1] for col in ys.T]
                ax.fill_between(steps, ys.mean(0) - h, ys.mean(0) + h, color=line.get_color(), alpha=0.2)
    axes[0].set(title="held-out greedy accuracy, strict (band: 95% t over seeds)", xlabel="step")
    axes[1].set(title="training reward (band: 95% t over seeds)", xlabel="step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
