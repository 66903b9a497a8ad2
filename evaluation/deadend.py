"""Where the credit lands (eval.py deadend): twin prompts whose answers are computed on different lines of one
response. A sanity check that decides whether a credit signal goes to the tokens the answer is computed
from, with the pair of twins as the unit.

The design. A question names two people, each with a count that changes once; the response, written by a
template and read teacher-forced (nothing is sampled), computes each on its own line, the two lines with
disjoint digits, then boxes one result:

    question  Anna has 3 apples and gets 4 more. Ben has 9 pears and gives away 1. How many apples does Anna
              have now?
    response  Anna has $3 + 4 = 7$ apples.
              Ben has $9 - 1 = 8$ pears.
              The final answer is \\boxed{7}.

Its twin asks about Ben and boxes 8; nothing else differs. In one twin Anna's line is used and Ben's is a dead
end; in the other the roles swap at the same positions, so position, token identity and line order cancel
within the pair and what is left is whether a signal follows the answer. The order of the two lines is
balanced over pairs (the question's order in even pairs, reversed in odd ones).

Scored per twin and signal, on one forward of the row (response_states with a Capture, as grpo.py's update):
  AUC         P(score of a used-line digit > score of a dead-end-line digit), ties counted 1/2, over every
              (used, dead-end) pair of digit tokens; a pair's AUC is the mean of its two twins'
  share_diff  the share of the used line's digits that the top-40% rule boosts (eq. 6 under the signal's
              scores: flowtracer.flow_credit, gamma and top_frac of grpo.Config) minus the dead-end line's;
              for flow this is the actual gamma of a training step; the pair's: the mean of its twins'
Over pairs, the replicated unit: the mean with a 95% t interval (evaluation/stats.py, scipy); flow - attention
and flow - raw-flow paired by pair, with the t interval and a Wilcoxon signed-rank test beside (scipy).

The signals, each scored the same way on the same maps:
  flow       tau of eq. 4 (training/credit/scoring.py's SIGNALS["flow"] on the captured maps)
  h          eq. 2 alone: how much of a token's influence reaches the answer (flowtracer.trace_flow)
  raw-flow   eq. 4's flow on W itself, without the h-transform of eq. 3 (raw_flow, below)
  attention  the maximum attention a token receives (SIGNALS["attention"], FlowTracer's Attention baseline)
  entropy    the policy's entropy where the token is predicted (SIGNALS["entropy"], OAR eq. 5)
  random     uniform scores (SIGNALS["random"]): the test's own control, its interval must hold 0.5
  position   the token's index: exactly 0.5 in every pair by construction (the design's position control)

The variant, the method's limit: each pair once more as one of its twins with a line that computes nothing
(PLANTED) placed first, between the two lines or just before the answer line, in equal thirds (pair i:
SLOTS[i mod 3]; the twin alternates so that within a slot the used line comes first in every other pair).
Per slot, over its pairs: the AUC of the used digits over the dead-end digits (does the result survive the
line; one twin a pair, so position is balanced over pairs, not within them), the AUC of the used digits over
the planted line's tokens (below 0.5: the line without computation outranks the computation), and the share
of the planted line's tokens that the top-40% rule boosts.

The verdict, pre-registered (RULES, printed with it): "answer-targeted" when flow's AUC interval lies above
0.5, its AUC >= 0.55 and its top-40% share difference >= +0.10; "and the h-transform is the cause" when
moreover flow - raw-flow's interval lies above 0 (it excludes 0 on the side where the h-transform helps);
otherwise "not answer-targeted at this scale: no learning claim can rest on it". No verdict when the control
fails (random's interval misses 0.5).

Departures (numbered; eval.py's are 1-4):
 5. The prompt: --style question by default, the question alone in one user turn of the chat template
    (SmolLM2's adds its system line), not grpo.py's few-shot prompt of SmolLM2 (fewshot3): the twins are
    teacher-forced, so no exemplar or instruction is needed to write the format, and fewshot3's 380-token
    prompt costs several times as much (--style auto or fewshot3 asks for it). The question region is the
    prompt minus its special tokens, as in training.
 6. raw-flow's source is every question token, 1/|Q| each (eq. 4's s without the h > 0 filter, which needs h);
    the answer rows are cut as in eq. 2, so both flows end at the same sink.

Run: python eval.py deadend --n 200 --threads 1 --json runs/deadend/summary.json   (writes runs/deadend/;
     the measured run, its command and its time: results/deadend/README.md)
Test: python -m pytest -q tests/evaluation/test_deadend.py
"""

import random
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats as sps
from tqdm import tqdm

import data
from evaluation.probes import markdown
from evaluation.stats import fmt_p, t_interval
from flowtracer import Capture, dag_weights, flow_credit, select_layers, trace_flow
from tasks.arithmetic import ITEMS, NAMES
from training.credit.attention import use_capture_attention
from training.credit.oar import eval_mode
from training.credit.scoring import SIGNALS, ForwardOutputs
from training.policy import response_states

SIGNAL_NAMES = ("flow", "h", "raw-flow", "attention", "entropy", "random", "position")
PAIRED = (("flow", "attention"), ("flow", "raw-flow"))  # flow - x, paired by pair
SLOTS = ("first", "middle", "last")  # where the variant's planted line goes
PLANTED = (  # lines that compute nothing: no digit, no name, no item
    "Let me read the question again.",
    "I will write each count on its own line.",
    "Now I check my work.",
    "Both lines are written out.",
)
AUC_MIN, SHARE_MIN = 0.55, 0.10  # the verdict's thresholds (RULES)
RULES = (
    "control: random's 95% interval holds 0.5 (else the test is broken and gives no verdict)",
    f"answer-targeted: flow's AUC interval lies above 0.5, its AUC >= {AUC_MIN} and its top-40% share "
    f"difference >= +{SHARE_MIN:.2f}",
    "and the h-transform is the cause: answer-targeted, and flow - raw-flow's interval lies above 0",
    "otherwise: not answer-targeted at this scale: no learning claim can rest on it",
)


# ----------------------------------------------------------------------------- the twins
class Twin(NamedTuple):
    """One row: a question and its teacher-forced response, with the character spans of its lines."""

    pair: int  # the pair's index
    asks: str  # the name the question asks about
    slot: str  # "" (the main test) or the planted line's slot (the variant)
    question: str
    response: str
    used: tuple  # (start, end) characters of the used line in `response`
    dead: tuple  # (start, end) of the dead-end line
    planted: tuple  # (start, end) of the planted line; () in the main test


def steps():
    """Every one-step change (sign, a, b, c) with a + b = c or a - b = c, three distinct digits, a, c >= 2."""
    out = []
    for a in range(2, 10):
        for b in range(1, 10):
            for sign, c in (("+", a + b), ("-", a - b)):
                if 2 <= c <= 9 and len({a, b, c}) == 3:
                    out.append((sign, a, b, c))
    return out


def make_twins(n, seed):
    """n pairs: the two twins of the main test, then one twin again with a planted line (the variant, slot
    SLOTS[i mod 3]; which twin alternates so that within each slot the used line is first in every other
    pair). Deterministic for a seed."""
    rng, moves, rows = random.Random(f"deadend-{seed}"), steps(), []
    for i in range(n):
        (p, _), (q, _) = rng.sample(NAMES, 2)
        items = rng.sample(ITEMS, 2)
        first = rng.choice(moves)
        second = rng.choice([m for m in moves if not set(m[1:]) & set(first[1:])])  # disjoint digits
        people = [(p, items[0], first), (q, items[1], second)]
        said = [
            f"{who} has {a} {item} and " + (f"gets {b} more." if s == "+" else f"gives away {b}.")
            for who, item, (s, a, b, _) in people
        ]
        lines = [f"{who} has ${a} {s} {b} = {c}$ {item}." for who, item, (s, a, b, c) in people]
        order = [0, 1] if i % 2 == 0 else [1, 0]  # the lines in the question's order, or reversed
        # the variant's twin: its used line first in every other pair of a slot
        used_first = (i // 3) % 2 == 0
        planted, slot = rng.choice(PLANTED), SLOTS[i % 3]
        for ask, var in ((0, ""), (1, ""), (order[0] if used_first else order[1], slot)):
            body = [lines[j] for j in order]
            if var:
                body.insert(SLOTS.index(var), planted)  # before line 1, between the lines, before the answer
            who, item, (_, _, _, c) = people[ask]
            question = " ".join(said) + f" How many {item} does {who} have now?"
            response = "\n".join(body) + f"\nThe final answer is \\boxed{{{c}}}."
            span = lambda line: (response.index(line), response.index(line) + len(line))  # noqa: E731
            rows.append(
                Twin(
                    i,
                    who,
                    var,
                    question,
                    response,
                    span(lines[ask]),
                    span(lines[1 - ask]),
                    span(planted) if var else (),
                )
            )
    return rows


def tokens_in(offsets, span, digits_of=None):
    """Indices of the tokens whose characters meet `span` (start, end); with digits_of (the text), only those
    whose characters inside the span hold a digit."""
    a, b = span or (0, 0)
    out = []
    for k, (s, e) in enumerate(offsets):
        lo, hi = max(s, a), min(e, b)
        if lo < hi and (digits_of is None or any(ch.isdigit() for ch in digits_of[lo:hi])):
            out.append(k)
    return out


# ----------------------------------------------------------------------------- the signals
def raw_flow(attn, question_mask, answer_mask, attention_mask):
    """(B, T) fp64: eq. 4's flow pushed along W itself, without the h-transform (departure 6):
    f(k) = s(k) + sum_{i<k} f(i) W_ik, i.e. (I - M^T) f = s, ONE forward triangular solve (as trace_flow's
    second, with W in place of W'). s = 1/|Q| on every question token; M = dag_weights: eq. 1's W with the
    answer rows cut (the sink of eq. 2). The notebook's "naive forward" (section 3), on a model's maps."""
    M = dag_weights(attn, answer_mask, attention_mask)  # (B, T, T) fp64, M[i, k] = W_ik for i < k
    q = (question_mask.bool() & attention_mask.bool()).to(M.dtype)  # (B, T)
    s = q / q.sum(-1, keepdim=True).clamp_min(1.0)  # (B, T) unit injection
    # unitriangular: the diagonal read as 1 and the strict lower part of -M^T, so this is (I - M^T) f = s
    f = torch.linalg.solve_triangular(-M.mT, s.unsqueeze(-1), upper=False, unitriangular=True)
    return f.squeeze(-1)  # (B, T)


@torch.no_grad()
def forward_scores(model, batch, cfg):
    """{signal: (B, T) scores, 0 off the response} of SIGNAL_NAMES from one forward of the batch: the
    decoder's last hidden states and the cfg.layers head-mean maps (a Capture, each prompt read once:
    training/policy.py's response_states, as grpo.py's update reads them), the entropy of the response
    positions from the LM head."""
    dev, P = model.device, batch.prompt_width
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    cap = Capture(select_layers(cfg.layers, model.config.num_hidden_layers))
    use_capture_attention(model)
    with eval_mode(model):
        hid = response_states(model, ids, mask, P, True, cap)  # (B, R, D): h_{t-1} for response column t
    W = cap.maps(mask)  # (B, T, T) eq. 1
    resp = batch.response_mask.to(dev)[:, P:]  # (B, R)
    ent = torch.zeros(resp.shape, dtype=torch.float32, device=dev)  # (B, R)
    logp = F.log_softmax(model.get_output_embeddings()(hid[resp]).float(), dim=-1)  # (N, V) response only
    ent[resp] = -(logp.exp() * logp).sum(-1)
    out = ForwardOutputs(W, ent)
    scores = {
        s: SIGNALS[s](model, batch, cfg, out).to(dev) for s in ("flow", "attention", "entropy", "random")
    }
    q, a, v = (x.to(dev) for x in (batch.question_mask, batch.answer_mask, batch.attention_mask))
    m = batch.response_mask.to(dev).double()  # (B, T)
    scores["h"] = trace_flow(W, q, a, attention_mask=v).h * m  # eq. 2
    scores["raw-flow"] = raw_flow(W, q, a, v) * m
    scores["position"] = torch.arange(m.shape[1], device=dev, dtype=torch.float64) * m
    return {k: scores[k].double().cpu() for k in SIGNAL_NAMES}


def auc(used, dead):
    """P(u > d) + P(u = d) / 2 over every pair of a used score u and a dead-end score d (ties count half):
    the Mann-Whitney AUC; None when either side is empty."""
    u, d = np.asarray(used, dtype=float)[:, None], np.asarray(dead, dtype=float)[None, :]
    if not u.size or not d.size:
        return None
    return float(((u > d) + 0.5 * (u == d)).mean())


def score_twins(model, tok, twins, style, cfg, batch_rows):
    """One record per row: for each signal the AUC and the boosted shares of its used, dead-end and planted
    tokens, scored on forward_scores; with the tokens, answer and flow for drawing. Rows go in batches of
    whole pairs (the three rows of a pair share its two prompts: each read once)."""
    out, per = [], max(3, batch_rows - batch_rows % 3)
    for i in tqdm(range(0, len(twins), per), desc="deadend: forward", unit="batch"):
        chunk = twins[i : i + per]
        prompts = [
            tok(data.make_prompt({"question": t.question, "task": "math"}, tok, style)).input_ids
            for t in chunk
        ]
        enc = [tok(t.response, add_special_tokens=False, return_offsets_mapping=True) for t in chunk]
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        batch = data.build_batch(tok, prompts, [e.input_ids + eos for e in enc])
        scores, P = forward_scores(model, batch, cfg), batch.prompt_width
        resp = batch.response_mask
        boosted = {s: flow_credit(v, resp, cfg.top_frac, cfg.gamma).weight > 1 for s, v in scores.items()}
        for b, (t, e) in enumerate(zip(chunk, enc)):
            used, dead = (tokens_in(e.offset_mapping, x, t.response) for x in (t.used, t.dead))
            planted = tokens_in(e.offset_mapping, t.planted)
            cols = lambda ks: [P + k for k in ks]  # noqa: E731
            rec = dict(pair=t.pair, asks=t.asks, slot=t.slot, auc={}, auc_planted={}, share={})
            for s, v in scores.items():
                x, g = v[b], boosted[s][b].float()
                rec["auc"][s] = auc(x[cols(used)], x[cols(dead)])
                rec["auc_planted"][s] = auc(x[cols(used)], x[cols(planted)])
                rec["share"][s] = [float(g[cols(ks)].mean()) if ks else None for ks in (used, dead, planted)]
            n = len(e.input_ids) + len(eos)
            rec.update(
                question=t.question,
                response=t.response,
                tokens=[tok.decode([k]) for k in e.input_ids + eos],
                answer=batch.answer_mask[b, P : P + n].tolist(),
                flow=scores["flow"][b, P : P + n].tolist(),
                weight=(1 + (cfg.gamma - 1) * boosted["flow"][b, P : P + n].float()).tolist(),
                used=used,
                dead=dead,
                planted=planted,
                prompt=tok.decode(prompts[b]),
            )
            out.append(rec)
    return out


# ----------------------------------------------------------------------------- over pairs
def pairs_of(recs):
    """One row per pair: each signal's AUC and share difference in the main test (the mean over its twins),
    and in its variant the AUC, the AUC over the planted line and the planted line's boosted share."""
    by = {}
    for r in recs:
        by.setdefault(r["pair"], {}).setdefault(r["slot"], []).append(r)
    mean = lambda xs: None if any(x is None for x in xs) else float(np.mean(xs))  # noqa: E731
    out = []
    for i, rows in sorted(by.items()):
        main, (slot, var) = rows[""], next((k, v) for k, v in rows.items() if k)
        out.append(
            dict(
                pair=i,
                slot=slot,
                question=main[0]["question"],
                response=main[0]["response"],
                auc={s: mean([r["auc"][s] for r in main]) for s in SIGNAL_NAMES},
                share_diff={
                    s: mean([r["share"][s][0] - r["share"][s][1] for r in main]) for s in SIGNAL_NAMES
                },
                variant={
                    "auc": {s: mean([r["auc"][s] for r in var]) for s in SIGNAL_NAMES},
                    "auc_planted": {s: mean([r["auc_planted"][s] for r in var]) for s in SIGNAL_NAMES},
                    "share_planted": {s: mean([r["share"][s][2] for r in var]) for s in SIGNAL_NAMES},
                },
            )
        )
    return out


def interval(xs):
    """(mean, [low, high] of the 95% t interval over the values, or None for fewer than two)."""
    m, h = t_interval(xs)
    return m, None if h is None else [m - h, m + h]


def wilcoxon_p(d):
    """The two-sided Wilcoxon signed-rank p of paired differences d (scipy), or None when every d is 0."""
    d = np.asarray(d, dtype=float)
    return float(sps.wilcoxon(d).pvalue) if np.any(d != 0) and len(d) > 1 else None


def summarize(pairs, model_name, seed):
    """The result: per signal the AUC and the share difference with their 95% t intervals over pairs; flow -
    attention and flow - raw-flow paired by pair; the variant per slot; the verdict (RULES)."""
    signals = {}
    for s in SIGNAL_NAMES:
        a, ci = interval([p["auc"][s] for p in pairs])
        d, sci = interval([p["share_diff"][s] for p in pairs])
        signals[s] = {"auc": a, "auc_ci": ci, "share_diff": d, "share_ci": sci}
    paired = {}
    for x, y in PAIRED:
        diff = [p["auc"][x] - p["auc"][y] for p in pairs]
        m, ci = interval(diff)
        paired[f"{x} - {y}"] = {"diff": m, "ci": ci, "p_wilcoxon": wilcoxon_p(diff), "pairs": len(diff)}
    variant = {}
    for slot in SLOTS:
        ps = [p["variant"] for p in pairs if p["slot"] == slot]
        if ps:
            variant[slot] = {"pairs": len(ps)} | {
                s: dict(
                    zip(
                        ("auc", "auc_ci", "auc_planted", "auc_planted_ci"),
                        (*interval([p["auc"][s] for p in ps]), *interval([p["auc_planted"][s] for p in ps])),
                    ),
                    share_planted=float(np.mean([p["share_planted"][s] for p in ps])),
                )
                for s in SIGNAL_NAMES
            }
    out = {"model": model_name, "n": len(pairs), "seed": seed, "signals": signals, "paired": paired}
    return out | {"variant": variant, "rules": list(RULES), "verdict": verdict(signals, paired)}


def verdict(signals, paired):
    """RULES, applied as written: the control first, then answer-targeted, then the h-transform."""
    above = lambda ci, x: ci is not None and ci[0] > x  # noqa: E731
    rnd, flow, h = signals["random"], signals["flow"], paired["flow - raw-flow"]
    if rnd["auc_ci"] is None or not rnd["auc_ci"][0] <= 0.5 <= rnd["auc_ci"][1]:
        return "no verdict: the control failed (random's interval does not hold 0.5)"
    if not (above(flow["auc_ci"], 0.5) and flow["auc"] >= AUC_MIN and flow["share_diff"] >= SHARE_MIN):
        return "not answer-targeted at this scale: no learning claim can rest on it"
    return "answer-targeted" + (", and the h-transform is the cause" if above(h["ci"], 0.0) else "")


def report(s):
    """The text output: the same numbers as the JSON."""
    iv = lambda ci: "n/a" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"  # noqa: E731
    sig = markdown(
        ["signal", "AUC", "95% t interval", "top-40% share diff", "95% t interval"],
        [[k, v["auc"], iv(v["auc_ci"]), v["share_diff"], iv(v["share_ci"])] for k, v in s["signals"].items()],
    )
    par = markdown(
        ["paired by pair", "Δ AUC", "95% t interval", "p (Wilcoxon)"],
        [[k, v["diff"], iv(v["ci"]), fmt_p(v["p_wilcoxon"])] for k, v in s["paired"].items()],
    )
    var = markdown(
        [
            "slot",
            "pairs",
            "signal",
            "AUC used > dead end",
            "95% t",
            "AUC used > planted",
            "95% t",
            "planted boosted",
        ],
        [
            [
                slot,
                v["pairs"],
                k,
                x["auc"],
                iv(x["auc_ci"]),
                x["auc_planted"],
                iv(x["auc_planted_ci"]),
                x["share_planted"],
            ]
            for slot, v in s["variant"].items()
            for k, x in v.items()
            if k in ("flow", "raw-flow", "attention")
        ],
    )
    rnd = s["signals"]["random"]["auc_ci"]
    ok = rnd is not None and rnd[0] <= 0.5 <= rnd[1]
    return (
        f"{s['model']}: {s['n']} twin pairs (seed {s['seed']}); per pair the mean of its two twins; "
        "intervals over pairs.\n\n"
        + sig
        + "\n"
        + par
        + "\nThe variant: a line that computes nothing, first, in the middle or just before the answer:\n\n"
        + var
        + f"\ncontrol: random's interval {iv(rnd)} {'holds' if ok else 'does NOT hold'} 0.5\n"
        + "rules (pre-registered):\n"
        + "".join(f"  {i}. {r}\n" for i, r in enumerate(RULES, 1))
        + f"verdict: {s['verdict']}\n"
    )


# ----------------------------------------------------------------------------- the probe, and a pair drawn
def probe(model, tok, n, seed, style, cfg, batch_rows=12, name=""):
    """(rows, pairs, summary): make_twins, score_twins, pairs_of, summarize; cfg: a grpo.Config (its layers,
    top_frac, gamma, seed); name: the model's, for the summary."""
    recs = score_twins(model, tok, make_twins(n, seed), style, cfg, batch_rows)
    pairs = pairs_of(recs)
    return recs, pairs, summarize(pairs, name, seed)


def draw_pair(stem, recs, title="Where flow's credit lands: one twin pair"):
    """<stem>.html and .png of one pair's rows (score_twins' records) as eval.py credit draws a step: each
    prompt apart, each response's tokens coloured by flow's throughput tau, the answer boxed, the boosted
    tokens (gamma > 1) underlined; beside each, which line is used and its AUC. Returns the two paths."""
    from evaluation.credit_page import prompt_row
    from evaluation.token_page import Row, Tok, scale, visible, write_page

    bar = scale([x for r in recs for x in r["flow"]], "flow throughput τ (eq. 4)")
    page = []
    for r in recs:
        role = {k: "used line" for k in r["used"]} | {k: "dead-end line" for k in r["dead"]}
        role |= {k: "planted line" for k in r["planted"]}
        toks = [
            Tok(
                visible(t),
                bar.color(f),
                a,
                w > 1,
                f"τ {f:.3g} · γ {w:g}" + (f" · {role[k]}" if k in role else ""),
            )
            for k, (t, a, f, w) in enumerate(zip(r["tokens"], r["answer"], r["flow"], r["weight"]))
        ]
        if not r["slot"]:
            page.append(prompt_row(r["prompt"], f"asks about {r['asks']}"))
        side = [f"used: {r['asks']}'s line", f"flow AUC {r['auc']['flow']:.2f}"]
        if r["slot"]:
            side = [f"planted line ({r['slot']})", *side, f"AUC over it {r['auc_planted']['flow']:.2f}"]
        page.append(Row(side, toks))
    notes = [
        "twins: the same response, one question asks about each line; underlined: gamma = 1.5 (top 40% by τ)",
        "AUC: P(τ of a used-line digit > τ of a dead-end digit), ties 1/2",
    ]
    return write_page(stem, title, notes, page, [bar])
