"""App. C.3's dynamic filter (grpo.py departure 6, --dynamic-filter): the paper filters samples "by difficulty
(0.1-0.95) and by response length" without defining the length rule. Here a group is trained when its accuracy
is in [filter_low, filter_high] (the paper's 0.1 and 0.95), and in it the responses that ended before
max_new_tokens (DAPO's overlong filter). On for the paper's models (training/presets.py), off otherwise.

Run: python grpo.py --dynamic-filter --model tiny-qwen3 --steps 2   (groups/filtered in metrics.jsonl)
"""


def kept_rows(rewards, truncated, cfg):
    """(row indices for the update, {metric: count dropped}) under --dynamic-filter (App. C.3, departure 6):
    groups with accuracy in [filter_low, filter_high], and in them the responses that ended before
    max_new_tokens."""
    acc = (rewards.view(-1, cfg.group_size) >= 1).float().mean(-1)  # (B/G,)
    ok = (acc >= cfg.filter_low) & (acc <= cfg.filter_high)
    kept = [j for j in range(len(rewards)) if ok[j // cfg.group_size] and not truncated[j]]
    return kept, {"groups/filtered": int((~ok).sum()), "rows/truncated_dropped": int(sum(truncated))}
