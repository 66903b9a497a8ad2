"""Held-out evaluation: greedy accuracy on questions that training never sees, inside the training process.

grpo.py --eval-every N evaluates the policy it is training every N steps and at the last (`accuracy`: no
checkpoint reloaded, no process restarted); eval.py learn reads those evaluations from metrics.jsonl and adds
its own at step 0 and mean@k at the last step (`greedy`, `sampled`). One implementation for both:

  records    the held-out questions: the first `eval_size` of the test split of `eval_dataset` (default:
             the training task), generated with seed 0 whatever the run's seed, so that every run of a
             comparison answers the same questions; refused (ValueError) when one of them is a training
             question of the run's seed (the generated tasks draw another training split per seed).
  greedy     per question 1 if the greedy response gets reward 1 (the run's reward: data.reward, the answer
             in the task's format, or grpo.py --reward's), strict; and lenient = strict, or
             answers.last_number_equal (math tasks, departure 1).
  sampled    the same counts over k samples per question, sampled as the training run samples (rollout's
             Sampling.of: its temperature, top-p and top-k), with torch's global RNG seeded first (learn.py's
             process only: it would move the training's RNG).
  accuracy   greedy, as the metrics of a metrics.jsonl line: eval/accuracy, eval/correct, eval/total,
             eval/accuracy_lenient, and eval/right, eval/right_lenient (per question 0/1, in record order:
             learn.py's paired tests; trackers skip them, tracking.py departure 1).

Responses come from training.decode.rollout.generate, the rollout path of training, with the prompt of
training (data.make_prompt in the run's style), through the run's decode engine on CUDA (`engine`: no second
engine, no second KV cache, its greedy graphs captured once for the run; training/memory/preflight.py reserves
it for the held-out prompts too); `max_new_tokens` and `chunk_size` (rows per generate call) are given:
greedy decoding with the same records, order, budget and chunking gives the same responses in or out of the
training process. The model is put in eval mode for the evaluation and left in the mode it had.

Departures (numbered):
 1. Lenient scoring is defined for math tasks; Countdown and multiple choice score lenient = strict.

Wiring (grpo.py): once at setup
      recs = heldout.records(cfg.dataset, cfg.eval_dataset, cfg.eval_size, cfg.seed, cfg.data_path, records)
  and at step s when s % cfg.eval_every == 0 or s == cfg.steps (after the update, before the metrics line),
  at cfg.gen_chunk rows a call, through the out-of-memory back-off (training/memory/backoff.py): `evaluate`
      m.update(heldout.evaluate(run))

Run: python -c "from training.run import heldout; from training.model import load
                m, t = load.load_model('tiny-qwen3');
                print(heldout.accuracy(m, t, heldout.records('arithmetic', '', 4, 0), 'plain', 8, 4))"
"""

import contextlib

import torch

import data
from tasks.answers import last_number_equal
from training.decode.rollout import Sampling, generate
from training.memory import backoff
from training.usercode.guard import Interrupted


def records(
    dataset, eval_dataset="", eval_size=500, seed=0, data_path="", train=None, eval_path="", fields=("", "")
):
    """The first `eval_size` questions of the held-out task's test split (all, if fewer), or of the file
    `eval_path` (grpo.py --eval-data-path; --dataset custom reads only that), its columns named by fields
    (--question-field, --answer-field). seed: the training run's seed, or a list of them (learn.py's grid);
    train: the training records when the caller has them (one seed). ValueError: the task has no test split,
    or a held-out question is a training question."""
    task = (eval_dataset or dataset).lower()
    try:
        recs = data.load_task(
            task,
            split="test",
            path=eval_path or None,
            seed=0,
            question_field=fields[0],
            answer_field=fields[1],
        )[:eval_size]
    except ValueError as e:  # e.g. dapo-math-17k has no test split
        raise ValueError(f"the held-out split of {task}: {e} (choose another with --eval-dataset)") from None
    held, seen = {r["question"] for r in recs}, {}
    generated = (
        dataset.lower() in data.TASKS and data.TASKS[dataset.lower()].generator is not None and not data_path
    )
    for s in [seed] if isinstance(seed, int) else seed:
        key = s if generated else None  # a fixed training split is checked once
        if key not in seen:
            rows = (
                train
                if train is not None
                else data.load_task(
                    dataset,
                    split="train",
                    path=data_path or None,
                    seed=s,
                    question_field=fields[0],
                    answer_field=fields[1],
                )
            )
            seen[key] = len(held & {r["question"] for r in rows})
        if seen[key]:
            raise ValueError(
                f"{seen[key]} held-out question(s) of {task} are training questions of "
                f"{dataset} too (seed {s})"
            )
    return recs


@contextlib.contextmanager
def evaluating(model):
    """model.eval() inside, the mode it had (train or eval) after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def right(recs, texts, n, reward=None, ids=None):
    """(strict, lenient) per record: how many of its n responses (texts[i*n:(i+1)*n], their token ids `ids`)
    are right, by `reward` (the run's: None is data.reward, or --reward's, scored once for all the responses
    as grpo.py scores a batch: data.batch_reward; right = reward >= 1, an unscored NaN is not)."""
    rows = [r for r in recs for _ in range(n)]
    scores = data.batch_reward(reward or data.reward, texts, rows, ids)
    strict, lenient = [], []
    for i, r in enumerate(recs):
        ok = [x >= 1 for x in scores[i * n : (i + 1) * n]]
        loose = [
            x or (r["task"] == "math" and last_number_equal(t, r["answer"]))  # departure 1
            for t, x in zip(texts[i * n : (i + 1) * n], ok)
        ]
        strict.append(sum(ok))
        lenient.append(sum(loose))
    return strict, lenient


def greedy(
    model,
    tok,
    recs,
    style,
    max_new_tokens,
    chunk_size,
    engine=None,
    reward=None,
    template_kwargs=None,
    done=None,
):
    """{"greedy": [0/1 per record], "greedy_lenient": [...]}; uses no random numbers. engine: the run's
    decode engine (greedy graphs beside its sampling ones, over the same buffers), or None; done: the
    responses of a call that ran out of memory (rollout.generate's `done`: those left are generated)."""
    prompts = [data.make_prompt(r, tok, style, template_kwargs) for r in recs]
    with evaluating(model):
        argmax = Sampling(max_new_tokens, greedy=True)
        g = generate(model, tok, prompts, 1, argmax, chunk_size=chunk_size, engine=engine, done=done)
    strict, lenient = right(recs, g.texts, 1, reward, g.response_ids)
    return {"greedy": strict, "greedy_lenient": lenient}


def sampled(model, tok, recs, style, sampling, chunk_size, k, seed):
    """{"samples": [0..k right per record], "samples_lenient": [...]}: k responses per record, drawn as
    `sampling` says (a rollout.Sampling: the training run's, Sampling.of); torch's RNG seeded with `seed`."""
    prompts = [data.make_prompt(r, tok, style) for r in recs]
    torch.manual_seed(seed)
    with evaluating(model):
        s = generate(model, tok, prompts, k, sampling, chunk_size=chunk_size)
    strict, lenient = right(recs, s.texts, k, None, s.response_ids)
    return {"samples": strict, "samples_lenient": lenient}


def accuracy(
    model,
    tok,
    recs,
    style,
    max_new_tokens,
    chunk_size,
    engine=None,
    reward=None,
    template_kwargs=None,
    done=None,
):
    """Greedy held-out accuracy as metrics (see the docstring), by `reward` (grpo.py: the run's) with prompts
    through template_kwargs; the model's mode and the RNG are left as they were. engine: the run's (grpo.py
    passes run.engine: one engine, one set of buffers, for the run); done: as `greedy`'s (grpo.py calls
    through training/memory/backoff.py, which halves chunk_size on an out-of-memory error). A first Ctrl-C /
    SIGTERM inside a --reward here comes after the step's update: the evaluation is dropped ({}), and
    grpo.py's RunLog, told first (guard.interruptible), saves the step and stops."""
    try:
        g = greedy(model, tok, recs, style, max_new_tokens, chunk_size, engine, reward, template_kwargs, done)
    except Interrupted:
        return {}
    n = len(recs)
    return {
        "eval/accuracy": sum(g["greedy"]) / n,
        "eval/correct": sum(g["greedy"]),
        "eval/total": n,
        "eval/accuracy_lenient": sum(g["greedy_lenient"]) / n,
        "eval/right": g["greedy"],
        "eval/right_lenient": g["greedy_lenient"],
    }


def evaluate(run) -> dict:
    """The eval/* metrics of the run's policy now (grpo.train, every --eval-every steps and at the last):
    `accuracy` on the run's held-out records with its reward, prompt style and decode engine, through the
    out-of-memory back-off (backoff.generate: a smaller gen_chunk, as the rollout)."""
    pol, task = run.policy, run.task
    return backoff.generate(
        run,
        "held-out evaluation",
        accuracy,
        pol.model,
        pol.tok,
        task.eval_records,
        task.style,
        run.cfg.max_new_tokens,
        reward=task.reward,
        template_kwargs=task.template_kwargs,
    )
