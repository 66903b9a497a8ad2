"""rollouts/step_N.jsonl: the rows a step trained on, each response token with its credit, written as the run
goes (RunLog.step, every --rollouts-every steps) and drawn by `python eval.py credit RUN_DIR`
(evaluation/credit_page.py reads it and describes each field).

Test: python -m pytest -q tests/test_credit_page.py
"""

import json

from training.checkpoint import full_disk


def save_rollouts(path, tok, rollouts):
    """One JSON line per rollout (rollouts: Rollouts, the rows a step kept; a group's rows consecutive):
    prompt (decoded with its special tokens), response (without), reward r_i, adv A_i (0: not trained, no
    credit), and per response token: tokens (each decoded alone), answer (in eq. 2's answer region), score
    (the credit's; flow: tau; 0 on a row not trained), weight (gamma_it, eq. 6). `python eval.py credit
    RUN_DIR` draws them (evaluation/credit_page.py describes each field)."""
    batch, gen, P = rollouts.batch, rollouts.gen, rollouts.batch.prompt_width
    with full_disk(path, "the rollouts"), open(path, "w") as fh:
        for b, j in enumerate(rollouts.kept):
            n = int(batch.response_mask[b].sum())
            ids = batch.input_ids[b, P : P + n].tolist()
            fh.write(
                json.dumps(
                    {
                        "prompt": tok.decode(gen.prompt_ids[j]),
                        "response": gen.texts[j],
                        "reward": nan_none(rollouts.rewards[j].item()),
                        "adv": rollouts.adv[b].item(),
                        "tokens": [tok.decode([t]) for t in ids],
                        "answer": batch.answer_mask[b, P : P + n].tolist(),
                        "score": rollouts.scores[b, :n].float().tolist(),
                        "weight": rollouts.weight[b, :n].tolist(),
                    }
                )
                + "\n"
            )


def nan_none(x):
    return None if x != x else x  # NaN (an unscored reward) is null in JSON
