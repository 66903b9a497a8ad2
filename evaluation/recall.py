"""The Oracle recall of credit signals (OAR §5.1, eq. 19, Fig. 5a, 5b), a causal probe beside the masking
intervention (evaluation/probes.py, whose decoder, helpers and numbered departures 1, 5 and 6 it shares).

For a correct greedy response y: O_t = 1 if replacing y_t by the most probable token other than y_t, then
decoding the rest greedily, makes the answer wrong. recall@K% = the share of the causal tokens that rank in
the top K% by a credit signal (pooled over responses). OAR-P / OAR-G score tokens against an outcome phi
(oar.py): --oar-outcomes picks it (OAR §6.2, Fig. 5b). The default is AS-Mean, the paper's (§6.2: its
training runs and this experiment use it; Fig. 5b's best). Several outcomes give one row per OAR signal and
outcome, named like "oar-p:lt-logits".

Departure (numbered as in probes.py):
 4. Oracle responses are greedy, so decoding the suffix greedily without a replacement gives them back (up to
    float near-ties) and a flip is due to the replacement. "Second most probable" is read as the best token
    other than y_t (the same for greedy y). Positions are a seeded sample of at most max_positions among the
    tokens before the answer ends; tokens are ranked among those same tokens. recall = hits / causal, pooled.

Run: python eval.py recall --model smollm2-135m --task arithmetic --n-responses 32 --max-positions 32
     python eval.py recall --task arithmetic --signals oar-p --oar-outcomes as-mean lt-logits as-joint  # 5b
"""

import dataclasses
import math
import random

import torch
from tqdm import tqdm

import data
from evaluation.probes import markdown, pyplot, regions, sample_responses
from evaluation.regenerate import continue_prefixes
from training.credit import scoring

KS = list(range(10, 101, 10))  # recall@K% (OAR Fig. 5a)
OAR = ("oar-p", "oar-g")  # the signals scored against an outcome (oar.OUTCOMES)


@torch.no_grad()
def alternatives(model, r):
    """(n,) the best token other than y_t at every response position t, under pi(. | x, y_<t)
    (departure 4)."""
    ids = torch.tensor([r["prompt"] + r["response"]], device=model.device)
    logits = (
        model(input_ids=ids).logits[0, len(r["prompt"]) - 1 : -1].float()
    )  # (n, V): column t predicts y_t
    top2 = logits.topk(2, dim=-1).indices.cpu()  # (n, 2)
    y = torch.tensor(r["response"])
    return torch.where(top2[:, 0] == y, top2[:, 1], top2[:, 0]).tolist()


def recall(model, tok, records, args, style, cfg):
    """Returns (per-response rows, summary); cfg: the credit's grpo.Config (--layers, --seed), each OAR
    outcome asked for set on a copy. Raises ValueError when no response is correct."""
    rng, outcomes = random.Random(args.seed), args.oar_outcomes
    cfgs = {o: dataclasses.replace(cfg, oar_outcome=o) for o in outcomes}
    runs = {
        (f"{s}:{o}" if s in OAR and len(outcomes) > 1 else s): (s, o)  # Fig. 5b: one row per outcome
        for s in args.signals
        for o in (outcomes if s in OAR else outcomes[:1])
    }
    unknown = [s for s in args.signals if s not in scoring.SIGNALS]
    if unknown:
        raise ValueError(f"unknown signal(s) {unknown}; known: {sorted(scoring.SIGNALS)}")
    pool = records if "response" in records[0] else []
    for i in range(0, len(records) if not pool else 0, args.batch_size):  # greedy, until enough are correct
        batches = math.ceil(len(records) / args.batch_size)
        pool += sample_responses(
            model,
            tok,
            records[i : i + args.batch_size],
            args,
            style,
            0.0,
            args.seed + i,
            f"recall: greedy {i // args.batch_size + 1}/{batches}",
        )
        if sum(r["reward"] == 1.0 for r in pool) >= args.n_responses:
            break
    rows = [r for r in pool if r["reward"] == 1.0][: args.n_responses]
    if not rows:
        raise ValueError(
            f"recall: none of the {len(pool)} greedy responses is correct (no_answer: "
            f"{sum(data.last_boxed(r['text']) is None for r in pool)}); nothing to probe. "
            f"Use more problems or an easier task (--task arithmetic)."
        )
    out = []
    for i in tqdm(range(0, len(rows), args.batch_size), desc="recall: signals", unit="batch"):
        chunk = rows[i : i + args.batch_size]
        batch = regions(tok, chunk)
        P = batch.prompt_width
        # (B, R)
        scores = {
            k: scoring.SIGNALS[s](model, batch, cfgs[o])[:, P:].float().cpu() for k, (s, o) in runs.items()
        }
        for b, r in enumerate(chunk):
            # answer end: the candidate tokens
            end = int(batch.answer_mask[b, P:].nonzero().flatten()[-1]) + 1
            out.append(
                dict(
                    id=r["record"]["id"],
                    record=r,
                    end=end,
                    scores={s: v[b, :end].tolist() for s, v in scores.items()},
                )
            )
    for o in tqdm(out, desc="recall: oracle", unit="response"):
        r = o.pop("record")
        alt = alternatives(model, r)
        pos = sorted(rng.sample(range(o["end"]), min(args.max_positions, o["end"])))
        causal = []
        for c in range(0, len(pos), args.batch_size * 4):
            ts = pos[c : c + args.batch_size * 4]
            new = continue_prefixes(
                model,
                tok,
                [r["prompt"] + r["response"][:t] + [alt[t]] for t in ts],
                [args.max_new_tokens - t - 1 for t in ts],
            )
            for t, y in zip(ts, new):
                text = tok.decode(r["response"][:t] + [alt[t]] + y, skip_special_tokens=True)
                causal.append(data.reward(text, r["record"]) != r["reward"])  # eq. 19
        o.update(positions=pos, causal=[t for t, c in zip(pos, causal) if c], text=r["text"])
    s = summarize_recall(out, list(runs))
    s.update(
        n_pool=len(pool),
        pool_correct=sum(r["reward"] == 1.0 for r in pool),  # the responses searched
        pool_no_answer=sum(data.last_boxed(r["text"]) is None for r in pool),
    )
    return out, s


def summarize_recall(out, signals):
    """recall@K% = sum over responses |causal in top ceil(K% n)| / sum |causal| (departure 4)."""
    n_causal = sum(len(o["causal"]) for o in out)
    s = dict(
        n_responses=len(out),
        n_positions=sum(len(o["positions"]) for o in out),
        n_causal=n_causal,
        causal_rate=n_causal / max(1, sum(len(o["positions"]) for o in out)),
        ks=KS,
        recall={},
    )
    for sig in signals:
        hits = [0] * len(KS)
        for o in out:
            sc = o["scores"][sig]
            order = sorted(range(len(sc)), key=lambda j: (-sc[j], j))  # ties: the earlier token
            for i, K in enumerate(KS):
                top = set(order[: math.ceil(K / 100 * len(sc) - 1e-9)])
                hits[i] += sum(t in top for t in o["causal"])
        s["recall"][sig] = [h / n_causal if n_causal else None for h in hits]
    return s


def recall_table(s):
    rows = [[sig] + v for sig, v in s["recall"].items()]
    return markdown(["signal"] + [f"@{k}%" for k in s["ks"]], rows) + (
        f"\n{s['n_responses']} correct responses (of {s.get('n_pool', '?')} searched, "
        f"{s.get('pool_correct', '?')} correct, {s.get('pool_no_answer', '?')} without an answer), "
        f"{s['n_positions']} oracle positions, {s['n_causal']} causal ({s['causal_rate']:.3f}).\n"
    )


def recall_figure(s, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    for sig, v in s["recall"].items():
        ax.plot(s["ks"], v, marker="o", label=sig)
    ax.plot([0, 100], [0, 1], "k:", lw=0.8, label="chance")
    ax.set(xlabel="top K% tokens", ylabel="causal-token recall", title="Oracle recall (OAR Fig. 5a)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
