"""The learning experiment's results (eval.py learn; the grid: learn.py): from the finished arm-seeds to
learn.json, learn.md (the tables) and learn.png (held-out accuracy and training reward against step).

    summarize(g, runs, finals)   -> the markdown, the three files written atomically into g.out
    python -m evaluation.learn_report results/learn/learn.json [...]   -> saved grids' secondary endpoint and
                                 the seeds each effect size needs, from learn.json alone (nothing is run)

Statistics over seeds, the replicated unit (stats.py): per arm, the mean gain (last step - step 0) +- a 95% t
interval; each arm - none paired by seed: the mean difference, its t interval and p, a two-level bootstrap
(seeds, then questions), the exact sign-flip test, for the last step and the area under the held-out curve;
the seeds that a half-width of 0.05 would need. A question-level table follows, labelled: conditional on the
trained models. learn.py's docstring gives the setting and its departures.

The secondary endpoint, declared before the data of every grid summarized from now on (SECONDARY): the
training reward's area, reward_area, the mean of grpo.py's reward/mean over steps 2..N. Each step's prompts
are new to the model (it has not trained on them) and the same in every arm of a seed, and step 1's rollouts
are the same in every arm (the same weights), so steps 2..N are where the arms can differ; it reads every
step, where the held-out curve reads two or four. learn.json records the declaration; a grid whose
learn.json lacks it was summarized before, and its secondary endpoint is printed "chosen after the data".

Run: python eval.py learn --arms none,flow,random --seeds 2 -- --dataset arithmetic --steps 40
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

SECONDARY = "reward_area: the mean training reward over steps 2..N, each arm - none paired by seed"
EFFECTS = (0.10, 0.05, 0.03, 0.02)  # differences the seeds table sizes for (80% power, paired t)
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
        vs["reward_area"] = seed_test(*([reward_area(by[s, x]) for s in seeds] for x in (arm, "none")))
        if len(seeds) > 1:
            vs["effect_seeds"] = effect_seeds(by, arm, seeds)
            sd = float(np.std([by[s, arm]["after"] - by[s, "none"]["after"] for s in seeds], ddof=1))
            vs["power"] = {
                "sd_diff": sd,
                "seeds_for_half_width_0.05": seeds_needed(sd, 0.05),
                "seeds_for_80pct_power_at_0.05": seeds_needed(sd, delta=0.05),
            }
    result = {**g.setting, "secondary": SECONDARY, "arms": runs}
    result["summary"] = {"per_arm": per_arm, "vs_none": vs_none, "bootstrap": B}
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
    names["reward_area"] = "training reward, steps 2..N (secondary, declared before the data)"
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
        + seeds_markdown({a: v["effect_seeds"] for a, v in summary["vs_none"].items() if "effect_seeds" in v})
        + "\nSecondary, by (seed, question) pair: conditional on these trained models; not a test of the "
        "method:\n\n" + second
    )


def reward_area(run):
    """The secondary endpoint of one arm-seed: the mean of its training reward/mean over steps 2..N (a step
    skipped by the dynamic filter has none and is left out)."""
    xs = [v for step, v in run["reward"] if step >= 2]
    return float(np.mean(xs)) if xs else float("nan")


ENDPOINTS = {  # an arm-seed's number on each endpoint, for the seeds table
    "held-out greedy, last step": lambda r: r["after"],
    "held-out area (steps > 0)": lambda r: r["auc"],
    "training reward, steps 2..N": reward_area,
}


def effect_seeds(by, arm, seeds):
    """{endpoint: {"sd", "seeds"}}: the sd of the per-seed difference arm - none over `seeds` (by: (seed, arm)
    -> run), and per effect size delta of EFFECTS the seeds per arm for 80% power to detect it, two-sided at
    0.05, with a paired t test (stats.seeds_needed: the noncentral t, scipy)."""
    out = {}
    for name, f in ENDPOINTS.items():
        try:
            sd = float(np.std([f(by[s, arm]) - f(by[s, "none"]) for s in seeds], ddof=1))
        except KeyError:  # a grid saved before this endpoint was recorded
            continue
        out[name] = {"sd": sd, "seeds": {f"{e:g}": seeds_needed(sd, delta=e) for e in EFFECTS}}
    return out


def seeds_markdown(tables):
    """{arm: effect_seeds(...)} as a table: per endpoint the measured sd and the seeds each effect needs."""
    if not tables:
        return ""
    rows = [
        [f"{a} - none", name, f"{x['sd']:.3f}", *(x["seeds"][f"{e:g}"] or "> 10000" for e in EFFECTS)]
        for a, t in tables.items()
        for name, x in t.items()
    ]
    head = ["arms", "endpoint", "sd of the per-seed difference", *(f"δ = {e:g}" for e in EFFECTS)]
    return (
        "\nSeeds per arm for 80% power to detect a difference δ (paired t, two-sided 0.05), from the "
        "measured sd:\n\n" + markdown(head, rows)
    )


def saved_grid(grids):
    """The secondary endpoint and the seeds table of saved grids, [(learn.json's dict, its path)], their
    arm-seeds pooled by (seed, arm) (grids of one recipe, other seeds), as markdown: "chosen after the data"
    unless every grid's summary declared SECONDARY."""
    by = {(r["seed"], a): r for grid, _ in grids for a, rs in grid["arms"].items() for r in rs}
    arms = list(dict.fromkeys(a for _, a in by))
    declared = all(grid.get("secondary") == SECONDARY for grid, _ in grids)
    rows, tables = [], {}
    for arm in (a for a in arms if a != "none" and "none" in arms):
        seeds = sorted(s for s, a in by if a == arm and (s, "none") in by)
        t = seed_test(*([reward_area(by[s, x]) for s in seeds] for x in (arm, "none")))
        ci = "n/a" if not t["ci95"] else f"[{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}]"
        rows.append(
            [f"{arm} - none", len(seeds), f"{t['diff']:+.3f}", ci, fmt_p(t["p_t"]), fmt_p(t["p_signflip"])]
        )
        if len(seeds) > 1:
            tables[arm] = effect_seeds(by, arm, seeds)
    head = ["arms", "seeds", "Δ", "95% t interval", "p (paired t)", "p (exact sign flip)"]
    return (
        f"{' + '.join(w for _, w in grids)}: the training reward's area over steps 2..N (the mean of "
        f"reward/mean), paired by seed; "
        f"{'declared before the data' if declared else 'chosen after the data'}:\n\n"
        + markdown(head, rows)
        + seeds_markdown(tables)
    )


def main(argv=None):
    """python -m evaluation.learn_report LEARN_JSON [...]: saved_grid's markdown, printed."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m evaluation.learn_report", description=saved_grid.__doc__)
    ap.add_argument("learn_json", nargs="+", help="grids' learn.json files (eval.py learn's), pooled by seed")
    args = ap.parse_args(argv)
    try:
        print(saved_grid([(json.loads(Path(f).read_text()), f) for f in args.learn_json]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{' '.join(args.learn_json)}: not learn.json files of eval.py learn ({e})")


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


if __name__ == "__main__":
    main()
