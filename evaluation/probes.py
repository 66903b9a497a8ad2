"""Causal probes of token importance: the masking intervention (FlowTracer Table 1); the Oracle recall (OAR
Fig. 5a) is evaluation/recall.py, on the same decoder and helpers.

Both experiments take a finished response, change something at or before a position, regenerate the rest,
and ask whether the final answer moved. Both use the same decoder, regenerate.continue_prefixes: its masked
tokens keep their positions, and so do the tokens after them.

intervene  (FlowTracer §3.2, Table 1, App. E.1). On a seeded random sample of problems (App. E.1: "randomly
    sampled 500 instances"; eval.py --n-problems), for each response:
    t0 ~ U{1..k0}, k0 = the first answer token; n = ceil(0.2 t0) of the response tokens [0, t0) are selected
    by flow throughput tau (top n: "high", bottom n: "low") or uniformly ("random"); no later token may attend
    to them (prefix tokens after them included, since the prefix is re-encoded under the mask); the response
    is regenerated from t0. Four rows per problem: none (no mask: the noise floor), high, low, random.
    answer change       = the regenerated final answer differs from the original one (math-equivalence)
    correctness reverse = the reward flipped (either way; both directions are also reported)
    ... "vs none"       = the same two rates against the unmasked regeneration with the same noise
                          (departure 1): the effect of the mask alone, without the resampling noise of the
                          paper's definition.
    Two denominators. "answered" (the first table): the responses with an answer. "all" (the
    paper's, App. E.1: "instances where answer extraction failed were treated as incorrect"): every response;
    one without an extractable answer is incorrect and its flow targets its last token (departure 6).
    In both, a regeneration without an extractable answer is incorrect and counts as an answer change.

Departures (numbered):
 1. Regeneration samples with the Gumbel-max trick, temperature only (App. E.1: T = 0.7; no top-k / top-p),
    and all four rows of a problem read the same noise at every step (common random numbers). So high, low and
    random are paired, and an empty selection reproduces the "none" row exactly.
 2. t0 is drawn before the answer starts (the paper: "randomly truncated"), so the regeneration always
    re-derives the answer; a later t0 could not change it. Responses with no answer are counted and reported
    ("no_answer"), left out of the "answered" table and kept in the "all" one (departure 6).
 3. The regeneration gets the budget the original had left: max_new_tokens - t0.
 4. (recall's: evaluation/recall.py)
 5. Both accept fixed responses instead (--responses, load_responses), e.g. a trained policy's rollouts; those
    need not be greedy or sampled at T.
 6. A response without an answer has no answer region, so no flow. For the "all" rates (the paper's
    failed-extraction-is-incorrect rule) its answer region is its last token, as OAR falls back to the last
    token's logits (oar.py departure 1); k0 is then that token. The paper does not say what it did with them.
    Empty responses (nothing to truncate) are left out of both and counted ("n_empty").

Run: python eval.py intervene --model smollm2-135m --task gsm8k --n-problems 200
     python eval.py recall --model smollm2-135m --task arithmetic --n-responses 32 --max-positions 32
     python eval.py recall --task arithmetic --signals oar-p --oar-outcomes as-mean lt-logits as-joint  # 5b
"""

import math
import random

from tqdm import tqdm

import data
from data import build_batch
from evaluation.regenerate import continue_prefixes
from training.credit import scoring

CONDITIONS = ("none", "high", "low", "random")  # "none": regenerate with no mask, the noise floor


def markdown(header, rows):
    """A markdown table; floats with 3 decimals, None as "-"."""
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]) + "\n"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------- shared steps
def sample_responses(model, tok, records, args, style, temperature, seed, desc):
    """One response per record (prompt ids, response ids, text, reward), decoded in batches."""
    rows = []
    for i in tqdm(range(0, len(records), args.batch_size), desc=desc, unit="batch"):
        recs = records[i : i + args.batch_size]
        prompts = [tok(data.make_prompt(r, tok, style)).input_ids for r in recs]
        seeds = [seed * 1_000_003 + i + j for j in range(len(recs))]
        outs = continue_prefixes(
            model, tok, prompts, [args.max_new_tokens] * len(recs), temperature=temperature, seeds=seeds
        )
        for r, p, y in zip(recs, prompts, outs):
            text = tok.decode(y, skip_special_tokens=True)
            rows.append(dict(record=r, prompt=p, response=y, text=text, reward=data.reward(text, r)))
    return rows


def load_responses(path, tok, style):
    """Fixed responses instead of sampled ones: JSONL rows {"question", "answer", "response"} (+ optional
    "id", "task"), e.g. a trained policy's rollouts. The response text is tokenised as it stands."""
    rows = []
    for where, row in data.read_rows(path):
        if not all(isinstance(row.get(k), (str, int, float)) for k in ("question", "answer", "response")):
            raise data.DataError(f"{where}: needs the fields question, answer and response")
        task = row.get("task", "math")  # "custom": your task's rows (no built-in reward: reward None)
        kinds = (*data.REWARDS, "custom")
        if not isinstance(task, str) or task not in kinds or not data.style_fits(style, task):
            raise data.DataError(
                f"{where}: task {task!r} is not one of {', '.join(kinds)} that the "
                f"{style!r} prompt style fits"
            )
        data.unicode_text(where, question=row["question"], answer=row["answer"], response=row["response"])
        rec = dict(
            id=str(row.get("id", f"responses/{len(rows)}")),
            source="responses",
            question=row["question"],
            answer=data.answer_text(row["answer"]),
            task=task,
        )
        y = tok(str(row["response"]), add_special_tokens=False).input_ids
        if not y:
            raise data.DataError(f"{where}: empty response")
        text = tok.decode(y, skip_special_tokens=True)
        rows.append(
            dict(
                record=rec,
                prompt=tok(data.make_prompt(rec, tok, style)).input_ids,
                response=y,
                text=text,
                reward=data.reward(text, rec) if task in data.REWARDS else None,
            )
        )
    if not rows:
        raise data.DataError(f"{path}: no rows")
    return rows


def regions(tok, rows, answer_pattern=None):
    """The rows' Batch; the answer region: answers.find_answer_span's (eval.py plot --answer-pattern)."""
    return build_batch(
        tok, [r["prompt"] for r in rows], [r["response"] for r in rows], answer_pattern=answer_pattern
    )


def last_token_answers(batch):
    """The batch with the last response token as the answer region of the rows without one (departure 6)."""
    am, P = batch.answer_mask.clone(), batch.prompt_width
    n = batch.response_mask[:, P:].sum(-1)  # (B,) response lengths
    for b in ((~am.any(-1)) & (n > 0)).nonzero().flatten().tolist():
        am[b, P + int(n[b]) - 1] = True
    return batch._replace(answer_mask=am)


def changed(old_text, new_text):
    """The final answer moved: one of the two has no \\boxed{} answer and the other has, or they differ as
    math."""
    old, new = data.last_boxed(old_text), data.last_boxed(new_text)
    if old is None or new is None:
        return (old is None) != (new is None)
    return data.math_reward(new_text, old) == 0.0


# ----------------------------------------------------------------------------- intervene (Table 1)
def select(tau, t0, frac, rng):
    """Response positions [0, t0): the ceil(frac t0) highest / lowest by tau (ties: the earlier), and
    random."""
    n = max(1, math.ceil(frac * t0 - 1e-9))
    order = sorted(range(t0), key=lambda j: (-tau[j], j))
    low = sorted(range(t0), key=lambda j: (tau[j], j))[:n]
    return {
        "none": [],
        "high": sorted(order[:n]),
        "low": sorted(low),
        "random": sorted(rng.sample(range(t0), n)),
    }


def intervene(model, tok, records, args, style, cfg):
    """Returns (per-response rows, summary). records: task records, or rows from load_responses; cfg: the
    credit's grpo.Config (--layers, --seed)."""
    rng = random.Random(args.seed)
    rows = (
        records
        if "response" in records[0]
        else sample_responses(
            model, tok, records, args, style, args.temperature, args.seed, "intervene: sample"
        )
    )
    out = []
    for i in tqdm(range(0, len(rows), args.batch_size), desc="intervene: regenerate", unit="batch"):
        chunk = rows[i : i + args.batch_size]
        batch = regions(tok, chunk)
        found = batch.answer_mask.any(-1).tolist()  # (B,) an answer was extracted
        batch = last_token_answers(batch)  # departure 6
        tau = scoring.SIGNALS["flow"](model, batch, cfg)  # (B, T) throughput on the response
        jobs = []
        for b, r in enumerate(chunk):
            seed = 10**9 + args.seed * 1_000_003 + i + b  # one noise stream per problem
            ans = batch.answer_mask[b, batch.prompt_width :].nonzero().flatten()
            if len(ans) == 0:  # an empty response
                out.append(dict(id=r["record"]["id"], no_answer=True, empty=True, reward=r["reward"]))
                continue
            k0 = int(ans[0])  # first answer token
            t0 = rng.randint(1, max(1, k0))
            tau_r = tau[b, batch.prompt_width : batch.prompt_width + t0].tolist()
            jobs.append((r, t0, select(tau_r, t0, args.frac, rng), seed, not found[b]))
        prefixes, blocked, budgets, seeds, groups = [], [], [], [], []
        for r, t0, sel, seed, _ in jobs:
            P = len(r["prompt"])
            for c in CONDITIONS:  # four rows, one noise stream
                prefixes.append(r["prompt"] + r["response"][:t0])
                blocked.append([P + k for k in sel[c]])
                budgets.append(args.max_new_tokens - t0)
                seeds.append(seed)
                groups.append(seed)  # the four rows share their prefix
        new = (
            continue_prefixes(model, tok, prefixes, budgets, blocked, args.temperature, seeds, groups)
            if jobs
            else []
        )
        for j, (r, t0, sel, _, no_answer) in enumerate(jobs):
            row = dict(
                id=r["record"]["id"],
                no_answer=no_answer,
                empty=False,
                t0=t0,
                n_selected=len(sel["high"]),
                reward=r["reward"],
                text=r["text"],
            )
            for c_i, c in enumerate(CONDITIONS):
                text = tok.decode(r["response"][:t0] + new[4 * j + c_i], skip_special_tokens=True)
                rew, base = data.reward(text, r["record"]), row["none"] if c != "none" else None
                row[c] = dict(
                    selected=sel[c],
                    text=text,
                    reward=rew,
                    changed=changed(r["text"], text),
                    no_answer=data.last_boxed(text) is None,  # vs the unmasked row, same noise:
                    changed_vs_none=changed(base["text"], text) if base else False,
                    reversed_vs_none=base is not None and rew != base["reward"],
                )
            out.append(row)
    return out, summarize_intervene(out)


def intervene_table(s, args):
    names = {
        "none": "None (no mask: noise floor)",
        "random": f"Random ({args.frac:.0%})",
        "low": f"Low-flow (Bottom {args.frac:.0%})",
        "high": f"High-flow (Top {args.frac:.0%})",
    }
    keys = (
        "answer_change",
        "correctness_reverse",
        "correct_to_wrong",
        "wrong_to_correct",
        "no_answer_after",
        "answer_change_vs_none",
        "correctness_reverse_vs_none",
    )
    header = [
        "Perturbation target",
        "Answer change",
        "Correctness reverse",
        "correct->wrong",
        "wrong->correct",
        "no answer after",
        "Answer change vs none",
        "Correctness reverse vs none",
    ]
    table = lambda r: markdown(header, [[names[c], *(r[c][k] for k in keys)] for c in CONDITIONS])  # noqa
    a = s["all"]
    return (
        table(s)
        + (
            f"\nn = {s['n']} responses with an answer ({s['n_no_answer']} of {s['n_responses']} had none and "
            f"are left out); original accuracy {s['original_accuracy']:.3f}; T = {args.temperature}. "
            f'"vs none": against the unmasked regeneration with the same noise (departure 1).\n\nAll '
            f"responses, failed extraction counted as incorrect (App. E.1; departure 6):\n\n"
        )
        + table(a)
        + (
            f"\nn = {a['n']} responses ({s['n_no_answer'] - s['n_empty']} without an answer, flow to their "
            f"last token; {s['n_empty']} empty, left out); original accuracy {a['original_accuracy']:.3f}.\n"
        )
    )


def rates(done):
    """The Table 1 rates of each condition over the rows `done`."""
    s = dict(n=len(done), original_accuracy=sum(r["reward"] for r in done) / max(1, len(done)))
    for c in CONDITIONS:
        flips = [(r["reward"] > 0.5, r[c]["reward"] > 0.5) for r in done]
        s[c] = dict(
            answer_change=sum(r[c]["changed"] for r in done) / max(1, len(done)),
            correctness_reverse=sum(a != b for a, b in flips) / max(1, len(done)),
            correct_to_wrong=sum(a and not b for a, b in flips),
            wrong_to_correct=sum(b and not a for a, b in flips),
            no_answer_after=sum(r[c]["no_answer"] for r in done),
            answer_change_vs_none=sum(r[c]["changed_vs_none"] for r in done) / max(1, len(done)),
            correctness_reverse_vs_none=sum(r[c]["reversed_vs_none"] for r in done) / max(1, len(done)),
        )
    return s


def summarize_intervene(out):
    """The "answered" rates at the top level (with the counts), the paper's "all" rates under "all"."""
    done = [r for r in out if not r["no_answer"]]
    s = dict(
        n_responses=len(out),
        n_no_answer=len(out) - len(done),
        n_empty=sum(r["empty"] for r in out),
        **rates(done),
        all=rates([r for r in out if not r["empty"]]),
    )
    s["original_accuracy"] = sum(r["reward"] for r in out) / max(1, len(out))  # of every sampled response
    return s
