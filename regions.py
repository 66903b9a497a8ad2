"""The regions of a batch: where the question, the response and the answer are, in text and in tokens.

    find_answer_span    the characters of the final answer: the last \\boxed{...}, else <answer>...</answer>
    answer_token_range  the tokens of that answer in a response, by bisection over the decoded prefixes
    Batch / build_batch [left-padded prompt | right-padded response] with the three masks, as HF generate
    take                some rows of a Batch

These are the sets of FlowTracer's equations (flowtracer.py): the question is the source of the flow (eq. 4),
the answer its sink (eq. 2), the response the tokens that get credit (eq. 6). Region boundaries are
flowtracer.py's departure 2: the question is the prompt minus special tokens (BOS, chat markers), the answer
the content of the last \\boxed{...} (else the last <answer>...</answer>).

Run the tests: python -m pytest -q tests/test_flowtracer.py -k "answer_span or build_batch"
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from answers import boxed_span


def find_answer_span(text: str) -> tuple[int, int] | None:
    """Character span (start, end) of the final answer: the content of the last closed \\boxed{...}
    (nested braces allowed; answers.boxed_span), else of the last <answer>...</answer>, else None. Empty
    content is None. Linear in len(text), however many braces or tags are left open."""
    best, tag, pos = boxed_span(text), None, 0
    while best is None and (i := text.find("<answer>", pos)) >= 0 and (j := text.find("</answer>", i)) >= 0:
        tag, pos = (i + 8, j) if text[i + 8:j].strip() else tag, j + 9
    return best or tag


def answer_token_range(tokenizer, ids: list[int]) -> tuple[int, int] | None:
    """Token positions [k0, k1) of the answer in a response, or None.

    Token k spans characters [c_k, c_{k+1}) of the decoded text, with c_k = len(decode(ids[:k])); this
    follows the generated ids exactly (re-tokenising the text could split it differently). c_k is
    monotone, so the two boundary tokens are found by bisection: O(log T) decodes, not T.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    span = find_answer_span(text)
    if span is None:
        return None
    c = lambda k: len(tokenizer.decode(ids[:k], skip_special_tokens=False))  # noqa: E731
    k0 = bisect.bisect_right(range(len(ids) + 1), span[0], key=c) - 1     # token holding the first char
    k1 = bisect.bisect_left(range(len(ids) + 1), span[1], key=c)          # first token at/after the end
    return (max(k0, 0), k1) if k1 > max(k0, 0) else None


class Batch(NamedTuple):
    input_ids: torch.Tensor       # (B, T) long: [left-padded prompt | right-padded response]
    attention_mask: torch.Tensor  # (B, T) long: 1 on real tokens
    question_mask: torch.Tensor   # (B, T) bool: prompt tokens (special tokens excluded unless asked)
    response_mask: torch.Tensor   # (B, T) bool: generated tokens, EOS included
    answer_mask: torch.Tensor     # (B, T) bool: tokens of the final answer span inside the response
    prompt_width: int             # P: response token j of row b sits at column P + j

    def to(self, device):
        return Batch(*(x.to(device) for x in self[:-1]), self.prompt_width)


def build_batch(tokenizer, prompt_ids: list[list[int]], response_ids: list[list[int]],
                  question_special: bool = False) -> Batch:
    """Lay out prompts + responses as HF generate does and mark the three regions.

    question_special=False drops special tokens (BOS, <|im_start|>, ...) from the question region: the BOS
    attention sink would otherwise take most of the injected flow. The remaining chat-template words stay.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    B, P, R = len(prompt_ids), max(map(len, prompt_ids)), max([len(r) for r in response_ids] + [0])
    ids = torch.full((B, P + R), pad, dtype=torch.long)
    attn_mask = torch.zeros(B, P + R, dtype=torch.long)
    q, resp, ans = (torch.zeros(B, P + R, dtype=torch.bool) for _ in range(3))
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[b, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attn_mask[b, P - len(p):P + len(r)] = 1
        q[b, P - len(p):P] = torch.tensor([question_special or t not in special for t in p], dtype=torch.bool)
        resp[b, P:P + len(r)] = True
        rng = answer_token_range(tokenizer, list(r)) if r else None
        if rng is not None:
            ans[b, P + rng[0]:P + rng[1]] = True
    return Batch(ids, attn_mask, q, resp, ans, P)


def take(batch: Batch, rows) -> Batch:
    """The rows `rows` (a list or index tensor) of a batch, same width and prompt_width."""
    idx = torch.as_tensor(rows, dtype=torch.long, device=batch.input_ids.device)
    return Batch(*(x[idx] for x in batch[:-1]), batch.prompt_width)
