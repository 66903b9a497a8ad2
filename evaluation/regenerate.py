"""The decoder of the causal probes (probes.py): continue responses with chosen tokens masked out of every
later token's view, their positions kept.

    continue_prefixes(model, tok, prefixes, budgets, blocked=None, temperature=0.0, seeds=None, groups=None)
        -> the new token ids of each row

A plain loop with a KV cache, explicit position ids and a 4D additive attention mask, so that masking a token
never shifts the RoPE positions of the tokens after it (zeroing HF's 2D mask would: HF derives position ids
from its cumsum). The prefixes are encoded in three levels that share the cache (all rows, each group, each
row). Sampling is Gumbel-max at a temperature, the noise drawn per seed, so rows with one seed read the same
noise at every step (probes.py departure 1).

Run the tests: python -m pytest -q tests/evaluation/test_probes.py -k decode
"""

import os

import torch
from transformers import DynamicCache

from training.decode.rollout import eos_ids


def additive(allowed, dtype):
    """Bool "may attend" -> the additive mask attention adds to its scores: 0, or the dtype's minimum."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def prefill_mask(keys, q_start):
    """(B, 1, S - q_start, S) bool for the queries at columns q_start..S-1: query q may read key i iff i <= q
    and keys[b, i] (a real, unblocked token), or i == q. So a blocked token still reads itself and what came
    before it, and no later token reads it."""
    S = keys.shape[-1]
    q = torch.arange(q_start, S, device=keys.device)[:, None]  # (S - q_start, 1)
    i = torch.arange(S, device=keys.device)[None, :]  # (1, S)
    return (((i <= q) & keys[:, None, :]) | (i == q))[:, None]  # (B, 1, S - q_start, S)


def extend(model, cache, keys, pos, segs, blocked=None):
    """Append one token segment per cache row, left-padded to a common width W, to the KV cache.

    keys: (b, K) bool, the cached columns later tokens may read; pos: (b,) the next true position of each row.
    blocked[r]: offsets in segs[r] that no later token may read. Padding columns are never read and take no
    position, so a row's positions stay 0, 1, 2, ... whatever the padding. Returns (last logits (b, V) or
    None when every segment is empty, keys (b, K + W), pos (b,)).
    """
    b, W, dev = len(segs), max(map(len, segs)), keys.device
    if W == 0:
        return None, keys, pos
    ids = torch.zeros(b, W, dtype=torch.long)
    new, blk = torch.zeros(b, W, dtype=torch.bool), torch.zeros(b, W, dtype=torch.bool)
    for r, s in enumerate(segs):
        if s:
            ids[r, W - len(s) :], new[r, W - len(s) :] = torch.tensor(s, dtype=torch.long), True
            blk[r, [W - len(s) + j for j in (blocked[r] if blocked else [])]] = True
    ids, new, blk = ids.to(dev), new.to(dev), blk.to(dev)
    cols = torch.cat([keys, new & ~blk], -1)  # (b, K + W)
    p = pos[:, None] + (new.long().cumsum(-1) - 1).clamp(min=0)  # (b, W) true positions
    out = model(
        input_ids=ids,
        attention_mask=additive(prefill_mask(cols, keys.shape[-1]), model.dtype),
        position_ids=p,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float(), cols, pos + new.sum(-1)


@torch.no_grad()
def continue_prefixes(model, tok, prefixes, budgets, blocked=None, temperature=0.0, seeds=None, groups=None):
    """Continue each prefix (list of token ids) for up to budgets[b] tokens; stop after an EOS (kept).

    blocked[b]: prefix positions that no later token may attend to. temperature 0: greedy; else Gumbel-max
    sampling with noise from torch.Generator(seeds[b]): rows with the same seed read the same noise (dep. 1).
    Returns the new token ids per row. The prefixes are encoded in three levels that share the KV cache: the
    prefix common to all rows once, then each group's (groups[b]) common rest once per group, then each row's
    own rest; sharing stops before the first blocked token and the last token of each row. Finished rows
    leave the batch.
    """
    B, dev = len(prefixes), model.device
    blocked, groups = blocked or [[] for _ in prefixes], groups or [0] * B
    cut = [min([len(p) - 1] + list(x)) for p, x in zip(prefixes, blocked)]  # shareable length of each row
    members = {}
    for b, g in enumerate(groups):
        members.setdefault(g, []).append(b)
    order = [b for rows in members.values() for b in rows]  # batch rows, grouped
    L1 = min(len(os.path.commonprefix(prefixes)), min(cut))
    L2 = {
        g: max(L1, min(len(os.path.commonprefix([prefixes[b] for b in rows])), min(cut[b] for b in rows)))
        for g, rows in members.items()
    }
    cache = DynamicCache(config=model.config)
    keys, pos = torch.zeros(1, 0, dtype=torch.bool, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
    _, keys, pos = extend(model, cache, keys, pos, [prefixes[0][:L1]])  # level 1: all rows
    idx = torch.zeros(len(members), dtype=torch.long, device=dev)
    cache.batch_select_indices(idx)
    _, keys, pos = extend(
        model,
        cache,
        keys[idx],
        pos[idx],  # level 2: each group
        [prefixes[rows[0]][L1 : L2[g]] for g, rows in members.items()],
    )
    idx = torch.tensor([i for i, rows in enumerate(members.values()) for _ in rows], device=dev)
    cache.batch_select_indices(idx)
    logits, keys, pos = extend(
        model,
        cache,
        keys[idx],
        pos[idx],  # level 3: each row
        [prefixes[b][L2[groups[b]] :] for b in order],
        [[j - L2[groups[b]] for j in blocked[b]] for b in order],
    )
    gens = {s: torch.Generator().manual_seed(s) for s in set(seeds or [])} if temperature > 0 else {}
    eos, new, alive = set(eos_ids(model, tok)), [[] for _ in prefixes], list(order)
    keep = [i for i, b in enumerate(alive) if budgets[b] > 0]
    while keep:
        if len(keep) < len(alive):  # finished rows leave the batch
            idx = torch.tensor(keep, device=dev)
            cache.batch_select_indices(idx)
            logits, keys, pos, alive = logits[idx], keys[idx], pos[idx], [alive[i] for i in keep]
        if temperature > 0:  # Gumbel-max = softmax(logits / T) sampling
            # lockstep
            u = {s: torch.rand(logits.shape[-1], generator=g).clamp_(1e-20, 1.0) for s, g in gens.items()}
            noise = torch.stack([u[seeds[b]] for b in alive]).to(dev).log().neg().log()  # (b, V) log(-log u)
            logits = logits / temperature - noise
        step = logits.argmax(-1).tolist()  # (b,)
        for b, t in zip(alive, step):
            new[b].append(t)
        keep = [i for i, (b, t) in enumerate(zip(alive, step)) if t not in eos and len(new[b]) < budgets[b]]
        if keep:
            logits, keys, pos = extend(model, cache, keys, pos, [[t] for t in step])
    return new
