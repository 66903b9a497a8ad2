"""Which tokens are high-flow: within each sentence (FlowTracer Fig. 3) and across answer forms (Table 11a).

  per_sentence   Fig. 3 / App. E.1: "we identified the top 20% of high-flow and low-flow tokens within each
                 sentence"; eval.py plot --figures tokens counts them
  answer_forms   Table 11a / App. D.2: the same response, its \\boxed{} content rewritten in other answer
                 forms; how much of the answer-only response's high-flow set (top K% by throughput tau) each
                 form keeps; and the same per answer format of the sampled responses, with their accuracy

Table 11a, for each response y with an answer and each form f (FORMS):
    y_f       = y with the content a of its answer span replaced by f's template filled with a
    n         = k0, the tokens of y before the answer (identical in every y_f: only the answer changes)
    S_f(K)    = the ceil(K% n) of those tokens with the highest tau in y_f (ties: the earlier token)
    overlap   = |S_f(K) & S_answer-only(K)| / |S_answer-only(K)|, averaged over the responses
Per answer format (FORMATS, answer_format): the responses grouped by how they give their final answer,
    each group's count, accuracy (mean reward) and overlaps; "fallback" responses have no answer, so no flow.

Departures (numbered):
 1. The paper compares formats of one model prompted for each (its Acc. column differs per format) and does
    not say how it pairs the tokens of different responses. Here one response is rewritten into each form (our
    protocol), so the reasoning tokens are the same tokens and the sets compare position by position;
    no accuracy per form is measured. Top-100% is then 1 by construction (a check, not a finding).
    Table 11a's Acc. column is given per answer format instead (departure 4).
 2. The forms, our reading of the row names: answer-only "a"; full line "The final answer is a."; with
    explanation "a, which follows from the steps above"; multiple-choice "B" (a letter, as a multiple-choice
    output is; the prompt is not changed). The answer span is the last \\boxed{...} (else
    <answer>...</answer>), as in answers.find_answer_span. Every form, answer-only included, is
    re-tokenised from the first answer token on, so all forms go through the same tokenisation.
 3. Fig. 3: a sentence ends at a token holding a newline, or ending in . ! ? followed by whitespace (or the
    end), so "3.5" does not end one. Sentences of one token have no within-sentence ranking and are skipped.
    Only the tokens before the answer ends are used (the flow is 0 after it).
 4. Table 11a's Acc. column, read per answer format of the sampled responses: "boxed" (the last \\boxed{}
    holds the answer), "tags" (<answer>...</answer>, no \\boxed{}), "choice" (the answer is one option
    letter A-J, in either), "fallback" (neither: the reward reads no answer, so such a response is wrong;
    the flow would fall back to its last token, probes.py departure 6). The formats come from the model, not
    from the prompt, so a format's accuracy is that of the responses that chose it.

Run: python eval.py answer-forms --model smollm2-135m --task arithmetic --n-problems 24 --max-new-tokens 128 \
         --batch-size 8 --threads 1          (about 2 minutes on one CPU thread)
"""

import math
import re

from tqdm import tqdm

import data
from data import build_batch
from evaluation import probes
from tasks.answers import answer_token_range, find_answer_span
from training.credit import scoring

FORMS = {
    "answer-only": "{a}",
    "full-line": "The final answer is {a}.",  # departure 2
    "with-explanation": "{a}, which follows from the steps above",
    "multiple-choice": "B",
}
PERCENTS = [20, 40, 60, 80, 100]  # Table 11a's columns
FORMATS = ("boxed", "tags", "choice", "fallback")  # departure 4


# ----------------------------------------------------------------------------- Fig. 3: within each sentence
def sentences(pieces):
    """[(start, end)] token spans of the sentences of a token sequence, from each token's text (dep. 3)."""
    spans, start = [], 0
    for j, p in enumerate(pieces):
        nxt = pieces[j + 1] if j + 1 < len(pieces) else " "
        stop = p.rstrip().endswith((".", "!", "?")) and (p[-1:].isspace() or nxt[:1].isspace())
        if "\n" in p or stop or j == len(pieces) - 1:
            spans.append((start, j + 1))
            start = j + 1
    return spans


def per_sentence(tau, pieces, frac=0.2):
    """Fig. 3: (high, low) token indices, the ceil(frac n) highest and lowest by tau within each sentence of
    n >= 2 tokens (ties: the earlier token ranks higher)."""
    high, low = [], []
    for a, b in sentences(pieces):
        if b - a < 2:
            continue
        order = sorted(range(a, b), key=lambda j: (-tau[j], j))
        k = math.ceil(frac * (b - a) - 1e-9)
        high += order[:k]
        low += order[-k:]
    return high, low


# ----------------------------------------------------------------------------- Table 11a: answer forms
def rewrite(tok, ids, template):
    """(new ids, k0) for a response whose answer content a becomes template.format(a=a), or None without an
    answer. k0 = the token holding the answer's first character: ids[:k0] are kept, the rest is re-tokenised;
    trailing special tokens (EOS) are kept as ids."""
    special, n = set(tok.all_special_ids), len(ids)
    while n and ids[n - 1] in special:
        n -= 1
    core, tail = list(ids[:n]), list(ids[n:])
    rng = answer_token_range(tok, core)
    if rng is None:
        return None
    k0, text = rng[0], tok.decode(core, skip_special_tokens=False)
    s0, s1 = find_answer_span(text)
    c0 = len(tok.decode(core[:k0], skip_special_tokens=False))  # where the kept prefix ends
    rest = text[c0:s0] + template.format(a=text[s0:s1].strip()) + text[s1:]
    return core[:k0] + tok(rest, add_special_tokens=False).input_ids + tail, k0


def answer_format(text):
    """How a response gives its final answer: boxed | tags | choice | fallback (departure 4)."""
    span = find_answer_span(text)
    if span is None:
        return "fallback"
    if re.fullmatch(r"\(?[A-Ja-j]\)?", text[span[0] : span[1]].strip()):
        return "choice"
    return "boxed" if data.last_boxed(text) is not None else "tags"


def top(tau, K):
    """The ceil(K% n) indices with the highest tau (ties: the earlier)."""
    return set(sorted(range(len(tau)), key=lambda j: (-tau[j], j))[: math.ceil(K / 100 * len(tau) - 1e-9)])


def answer_forms(model, tok, records, args, style, cfg):
    """Returns (per-response rows, summary). records: task records (responses are sampled at args.temperature)
    or rows from probes.load_responses; cfg: the credit's grpo.Config (--layers, --seed)."""
    rows = (
        records
        if "response" in records[0]
        else probes.sample_responses(
            model, tok, records, args, style, args.temperature, args.seed, "answer-forms: sample"
        )
    )
    forms = ["answer-only"] + [f for f in args.forms if f != "answer-only"]
    out = []
    for i in tqdm(range(0, len(rows), args.batch_size), desc="answer-forms: flow", unit="batch"):
        chunk = rows[i : i + args.batch_size]
        new = {f: [rewrite(tok, r["response"], FORMS[f]) for r in chunk] for f in forms}
        keep = [b for b, v in enumerate(new["answer-only"]) if v is not None and v[1] > 0]
        tau = {}
        for f in forms if keep else []:  # one flow pass per form
            batch = build_batch(tok, [chunk[b]["prompt"] for b in keep], [new[f][b][0] for b in keep])
            tau[f] = scoring.SIGNALS["flow"](model, batch, cfg)[:, batch.prompt_width :].double().cpu()  # B,R
        for b, r in enumerate(chunk):
            if b not in keep:
                out.append(
                    dict(
                        id=r["record"]["id"],
                        no_answer=True,
                        reward=r["reward"],
                        format=answer_format(r["text"]),
                    )
                )
                continue
            j, k0 = keep.index(b), new["answer-only"][b][1]
            ref = tau["answer-only"][j, :k0].tolist()
            row = dict(
                id=r["record"]["id"],
                no_answer=False,
                k0=k0,
                reward=r["reward"],
                format=answer_format(r["text"]),
                answers={f: tok.decode(new[f][b][0][k0:], skip_special_tokens=True) for f in forms},
                overlap={},
            )
            for f in forms[1:]:
                t = tau[f][j, :k0].tolist()
                row["overlap"][f] = [len(top(ref, K) & top(t, K)) / len(top(ref, K)) for K in args.percents]
            out.append(row)
    return out, summarize(out, forms[1:], args.percents)


def summarize(out, forms, percents):
    done = [r for r in out if not r["no_answer"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731

    def overlap(rows):
        return {
            f: [mean([r["overlap"][f][i] for r in rows if not r["no_answer"]]) for i in range(len(percents))]
            for f in forms
        }

    by = {k: [r for r in out if r["format"] == k] for k in FORMATS}
    formats = {
        k: dict(n=len(rows), accuracy=mean([r["reward"] for r in rows]), overlap=overlap(rows))
        for k, rows in by.items()
    }
    return dict(
        n_responses=len(out),
        n_no_answer=len(out) - len(done),
        n=len(done),
        percents=percents,
        original_accuracy=mean([r["reward"] for r in out]),
        mean_k0=mean([r["k0"] for r in done]),
        overlap=overlap(done),
        formats=formats,
    )


def forms_table(s, args):
    header = ["Format", *(f"Top-{K}%" for K in s["percents"])]
    rows = [["answer-only", *("-" for _ in s["percents"])]] + [[f, *v] for f, v in s["overlap"].items()]
    k0 = f"{s['mean_k0']:.1f}" if s["mean_k0"] is not None else "-"
    return (
        probes.markdown(header, rows)
        + (
            f"\nOverlap with the answer-only high-flow set (Table 11a), mean over n = {s['n']} responses "
            f"({s['n_no_answer']} of {s['n_responses']} had no answer and are left out); {k0} tokens before "
            f"the answer on average; layers {args.layers}; "
            f"original accuracy {s['original_accuracy']:.3f}.\n\n"
            "Per answer format of the responses (departure 4): count, accuracy, overlap per form:\n\n"
        )
        + probes.markdown(
            ["Answer format", "n", "Acc.", "Form", *(f"Top-{K}%" for K in s["percents"])], format_rows(s)
        )
    )


def format_rows(s):
    """Table 11a per answer format: one row per (format, form); a format without an answered response
    (fallback, or none sampled) one row with its count and accuracy only."""
    rows = []
    for k, d in s["formats"].items():
        answered = [(f, v) for f, v in d["overlap"].items() if v and v[0] is not None]
        rows += [[k, d["n"], d["accuracy"], f, *v] for f, v in answered] or [
            [k, d["n"], d["accuracy"], "-", *(None for _ in s["percents"])]
        ]
    return rows
