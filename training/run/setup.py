"""The run: everything a grpo.py step reads, made once before the first step (`setup` -> Run).

setup's order is cheapest checks first: the run directory is checked and the data read before the model
loads, so a bad --data-path fails in a second, not after loading 4B weights; the run directory is created
(and locked) once the model has loaded, so a model that fails leaves nothing behind. The prompts are rendered
and tokenized once here, those the run will read, with the tokenizer alone before the weights load; which a
step reads is a function of (seed, step), so --resume lines up. A prompt and --max-new-tokens must fit the
model's positions (prompt_limit: a longer prompt is skipped and counted, said once; --max-new-tokens alone
past them is an error), and cfg.precision_resolved records what --precision resolves to on the device (every
run_config.json holds it beside --precision). The step is then sized before the weights
load (training/memory/budget.py's size: on CUDA its estimate from the model's config and the run's widest
prompt, against the GPU's memory or --gpu-gb; on the CPU a size left at 0 takes the CPU's). Last, one call to
training/memory/preflight.py: on CUDA each GPU part is tried once (or replaced by its fallback, one line each)
and the decode engine is reserved for the widest prompt the run decodes.

Run: python grpo.py --model tiny-qwen3 --steps 1    (setup, then one step)
"""

import dataclasses
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

import data
import flowtracer
from training.credit import attention, baselines
from training.decode.rollout import prefix_problem, prompt_ids
from training.memory import budget, preflight
from training.model import load, trainable
from training.policy import Policy, sharing_problem
from training.run import checkpoint as ckpt_io
from training.run import directory, heldout, tracking
from training.run.checkpoint import checkpoint_bytes, discard, gb
from training.run.directory import WRITES, RunError, check_unlocked, dir_problem, lock_out_dir
from training.run.log import RunLog
from training.usercode import reward_code


class Task(NamedTuple):
    """The task as a run reads it: its records, the order a step takes them in, their prompts."""

    records: list  # the task's training records
    order: list  # the record each prompt slot reads: step s reads order[s n:(s + 1) n]
    prompt_ids: dict  # {record: its prompt as token ids}, for the records this run reads
    style: str  # the prompt style in force (data.make_prompt)
    eval_records: list  # the held-out questions of --eval-every (empty when off)
    widest_prompt: int  # tokens of the widest prompt the run reads (training, <= prompt_limit;
    # held-out): what the decode engine and the budget's estimate are sized to
    reward: object = data.reward  # (completion, record) -> float: data.reward, or --reward's (reward_code.py)
    template_kwargs: dict | None = None  # --chat-template-kwargs, for apply_chat_template (prompts.py)
    prompt_limit: int = 1024  # the longest prompt a step trains on (Limit.tokens; longer: skipped, counted)
    limit_words: str = "--max-prompt-tokens 1024"  # it and what sets it (Limit.words): the step's line


@dataclass
class Run:
    """Everything a step reads, made once by `setup`; load_for_update makes the part grpo.update reads."""

    cfg: object  # grpo.Config
    policy: Policy  # the model, tokenizer, reference, optimizer, schedule, autocast (policy.py)
    layers: list  # the layers the update's Capture reads (--layers); []: the credit reads none
    head_mean: object  # the function a Capture sums head means with (flowtracer.head_mean_kernel)
    task: Task | None = None  # the records, their order and prompts, the reward
    engine: object = None  # the CUDA decode engine, reserved and kept for the run (preflight.py)
    log: RunLog | None = None  # the run directory: metrics, rollouts, checkpoints, curves
    start: int = 0  # the first step to run (the checkpoint's, on --resume)
    bad_steps: int = 0  # consecutive non-finite steps, as the checkpoint left them
    budget: object = None  # budget.size's Budget on CUDA (the card, the plan), None on the CPU


def setup(cfg) -> Run:
    """Everything before the first step, cheapest checks first: the run directory is checked and the data read
    before the model loads, so a bad --data-path fails in a second, not after loading 4B weights; the step
    is sized to the card before the weights load (training/memory/budget.py); the run directory is created
    (and
    locked) once the model has loaded, so a model that fails leaves nothing."""
    ckpt = ckpt_io.find_checkpoint(cfg.resume) if cfg.resume else None
    mark = (ckpt / ckpt_io.MARK).read_text().strip() if ckpt else ""
    done = int(mark) if mark.isdigit() else 0  # the checkpoint's step (its marker)
    if ckpt and done >= cfg.steps:
        raise ValueError(
            f"--resume {cfg.resume}: the run is at step {done} already and --steps is "
            f"{cfg.steps}: nothing to run (give --steps more than {done})"
        )
    out = Path(cfg.out_dir)
    check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite, claim=False)  # no mkdir
    records = data.load_task(
        cfg.dataset,
        split="train",
        path=cfg.data_path or None,
        seed=cfg.seed,
        question_field=cfg.question_field,
        answer_field=cfg.answer_field,
    )
    kwargs = reward_code.template_kwargs(cfg) if cfg.chat_template_kwargs else None  # apply_chat_template's
    style = (
        cfg.prompt_style if cfg.prompt_style != "auto" else data.default_style(cfg.model, records[0]["task"])
    )
    evals = (
        heldout.records(
            cfg.dataset,
            cfg.eval_dataset,
            cfg.eval_size,
            cfg.seed,
            cfg.data_path,
            records,
            cfg.eval_data_path,
            (cfg.question_field, cfg.answer_field),
        )
        if cfg.eval_every
        else []
    )
    tok = load.load_tokenizer(cfg.model)  # the tokenizer alone: no weights yet
    reward = data.reward  # the task's, or --reward's: the user's
    if cfg.reward:  # functions, checked on the first row
        reward = reward_code.load(
            cfg,
            records[0],
            reward_code.trl_prompt(tok, style, kwargs),
            [k for r in [*records, *evals] for k in r],
        )  # TRL's form: the columns
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = trainable.device_of(cfg.device)  # CUDA: expandable segments, before it starts
    before, cfg.precision_resolved = cfg.precision_resolved, trainable.precision(cfg, device).name  # saved
    if before and before != cfg.precision_resolved:  # with the run (run_config.json); a resume elsewhere:
        print(
            f"precision: the run computed in {before}; here --precision {cfg.precision} is "
            f"{cfg.precision_resolved}"
        )
    n = cfg.prompts_per_step
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    order = [perm[i % len(perm)] for i in range(cfg.steps * n)]  # a function of (seed, step): --resume
    todo = sorted(set(order[done * n :]))  # the prompts left, tokenized once
    ids = dict(zip(todo, prompt_ids(tok, [data.make_prompt(records[i], tok, style, kwargs) for i in todo])))
    held_out = prompt_ids(tok, [data.make_prompt(r, tok, style, kwargs) for r in evals])
    limit = prompt_limit(cfg, [len(x) for x in ids.values()], [len(x) for x in held_out])  # positions
    widths = [len(x) for x in ids.values() if len(x) <= limit.tokens] + [len(x) for x in held_out]
    widest = max(widths, default=1)  # the engine and the estimate are sized to it
    sized = budget.size(cfg, device, widest, len(evals))  # sizes left at 0 chosen; CUDA: to the card
    run = load_for_update(cfg, device, str(ckpt) if ckpt else None)  # the policy (departure 3), its credit
    check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite)  # created, locked
    start, bad = ckpt_io.load_checkpoint(ckpt, run.policy.opt, run.policy.sched) if ckpt else (0, 0)
    check_disk(
        out,
        run.policy.model,
        trainable.scheme(cfg, device),
        start,
        cfg.steps,  # 2 ckpts
        cfg.save_every,
        cfg.save_optimizer,
    )
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    tracker = (
        None
        if cfg.report_to == "none"
        else tracking.open(cfg.report_to, out, dataclasses.asdict(cfg), resume_step=start or None)
    )
    metrics = directory.open_metrics(out, start if ckpt else None)
    run_log = RunLog(out, cfg, run.policy, metrics, tracker)
    where = "" if baselines.is_paper(cfg) else " (training/credit/baselines.py)"
    print(
        f"GRPO: {cfg.model} on {cfg.dataset} ({style} prompts), credit={cfg.credit}/{cfg.shaping}"
        f"{where}, {cfg.prompts_per_step}x{cfg.group_size} "
        f"rollouts/step, device={device}, out={out}"
    )
    parts = (
        preflight.try_parts(cfg, run, device, widest, len(evals))
        if preflight.on_gpu(device)
        else preflight.GpuParts(run.head_mean, None, run.policy.use_kernel(), [])
    )  # the CPU: no GPU part
    task = Task(records, order, ids, style, evals, widest, reward, kwargs, limit.tokens, limit.words)
    return dataclasses.replace(
        run,
        cfg=cfg,
        head_mean=parts.head_mean,
        task=task,
        engine=parts.engine,
        log=run_log,
        start=start,
        bad_steps=bad,
        budget=sized,
    )  # cfg: the one log saves


def load_for_update(cfg, device, path=None) -> Run:
    """The part of a Run that grpo.update reads, made as setup makes it: the policy (trainable.load_policy:
    the model from `path`, a checkpoint, or cfg.model; its tokenizer, reference, optimizer, schedule and
    autocast) and the credit's layers and head-mean kernel. memtrace.measure and benchmarks/gpu_headline.py
    run grpo.update on this, so what they measure is what grpo.py runs. A model whose update cannot read
    each prompt once says so here, once (policy.sharing_problem), and so do rollouts that cannot
    (rollout.prefix_problem); a credit that reads attention maps on a model whose attention cannot give
    them is refused here (attention.capture_problem), and a model that gives them from its own eager
    attention says so (attention.eager_line)."""
    cfg = budget.largest(cfg)  # a size left at 0: the CPU's, as setup's (a copy)
    pol = trainable.load_policy(cfg, device, path)
    impl = attention.capture_impl(pol.model)  # load_model's choice for its class
    if impl is None and cfg.credit in attention.MAP_CREDITS:
        raise ValueError(attention.capture_problem(pol.model, cfg.credit))
    if impl == flowtracer.EAGER_IMPL:
        print(attention.eager_line(pol.model))
    problem = sharing_problem(pol.model) if cfg.share_prefix else None
    if problem:
        print(f"update: each row reads its prompt again (no --share-prefix): {problem}")
    problem = prefix_problem(pol.model) if cfg.share_prefix else None
    if problem:
        print(f"rollout: HF generate reads each row's prompt (no --share-prefix): {problem}")
    maps = baselines.reads_maps(cfg)
    return Run(
        cfg,
        pol,
        flowtracer.select_layers(cfg.layers, pol.model.config.num_hidden_layers) if maps else [],
        flowtracer.head_mean_kernel(device) if maps else None,
    )


# ----------------------------------------------------------------------------- the model's length
class Limit(NamedTuple):
    tokens: int  # the longest prompt a step trains on
    words: str  # it and what sets it: --max-prompt-tokens N, or the model's positions less --max-new-tokens


def prompt_limit(cfg, widths, held_out, n_positions=None) -> Limit:
    """The longest prompt a step trains on: --max-prompt-tokens, and within the model's positions (its
    config's max_position_embeddings, read without the weights; n_positions: given instead) with
    --max-new-tokens after it, so that no row runs past the length the model was trained on (RoPE past it;
    an index error elsewhere). A config without positions: no bound. The run's prompts (widths, their token
    counts) that fit --max-prompt-tokens but not the positions are said in one line: skipped and counted, as
    --max-prompt-tokens skips (prompts/skipped_long). ValueError where --max-new-tokens alone fills the
    positions, or a held-out question is past them (its evaluation would run past the model's length)."""
    n = n_positions or getattr(load.load_config(cfg.model), "max_position_embeddings", None)
    if not isinstance(n, int) or cfg.max_prompt_tokens + cfg.max_new_tokens <= n:
        return Limit(cfg.max_prompt_tokens, f"--max-prompt-tokens {cfg.max_prompt_tokens}")
    if cfg.max_new_tokens >= n:
        raise ValueError(
            f"--max-new-tokens {cfg.max_new_tokens}: {cfg.model} has {n} positions (its config's "
            f"max_position_embeddings), and a prompt and its response must fit them: give --max-new-tokens "
            f"below {n}"
        )
    limit = Limit(
        n - cfg.max_new_tokens,
        f"{n - cfg.max_new_tokens} tokens ({cfg.model}'s {n} positions "
        f"less --max-new-tokens {cfg.max_new_tokens})",
    )
    over = sum(w > limit.tokens for w in held_out)
    if over:
        raise ValueError(
            f"{over} of the {len(held_out)} held-out questions are longer than {limit.words}: give fewer "
            f"--max-new-tokens, or another --eval-dataset"
        )
    past = sum(limit.tokens < w <= cfg.max_prompt_tokens for w in widths)
    if past:
        print(
            f"prompts: {past} of the run's {len(widths)} prompts are longer than {limit.words}: skipped "
            f"and counted (prompts/skipped_long), as --max-prompt-tokens skips"
        )
    return limit


# ----------------------------------------------------------------------------- a new run's directory, checked
def check_out_dir(out, resume, overwrite, claim=True):
    """A new run never silently replaces an old one: an out_dir holding metrics or a checkpoint needs
    --resume (continue it) or --overwrite (delete it first); RunError naming both flags otherwise, or the PID
    of another run writing there. claim=False checks only and creates nothing (run.setup, before the model
    loads: a model that fails to load leaves no directory); claim=True creates and locks out_dir
    (lock_out_dir) and, with --overwrite, deletes the old run."""
    out, problem = Path(out), dir_problem(out, WRITES)
    if problem:  # a file, a symlink loop, a dangling link, no write permission, a directory
        raise RunError(f"--out-dir {problem}")  # named metrics.jsonl, a file named ckpt: one line
    lock_out_dir(out) if claim else check_unlocked(out)
    held = [p for p in ("metrics.jsonl", "ckpt", "ckpt.tmp", "ckpt.old") if (out / p).exists()]
    if resume or not held:
        return
    if not overwrite:
        raise RunError(
            f"{out} already holds a run ({', '.join(held)}): continue it with --resume {out}, "
            f"or start afresh with --overwrite"
        )
    if not claim:
        return
    kept = sorted(p.name for p in out.glob("ckpt-*"))  # --keep-checkpoints' older saves
    for p in held + kept + ["rollouts", "curves.png", "tensorboard", "wandb"]:  # + --report-to's files
        discard(out / p) if (out / p).is_dir() else (out / p).unlink(missing_ok=True)


def check_disk(out, model, scheme, start, steps, save_every, with_optimizer=True):
    """RunError before the first step when out_dir's disk cannot take the run's checkpoints: one of
    checkpoint_bytes, or two from the second save on (ckpt/ stays until ckpt.tmp/ is complete), less what
    a ckpt/ already there holds. The message says how much is needed and how to need less."""
    one = checkpoint_bytes(
        sum(p.numel() for p in model.parameters() if p.requires_grad or scheme != "lora"),
        scheme,
        with_optimizer,
    )  # lora: the adapters are saved
    saves = len({s for s in range(start + 1, steps + 1) if s % save_every == 0 or s == steps})
    held = sum(f.stat().st_size for f in Path(out, "ckpt").glob("*") if f.is_file())
    need = one * (2 if saves > 1 or held else 1) - held
    free = shutil.disk_usage(out).free
    smaller = (
        ""
        if scheme != "adamw" or not with_optimizer
        else (
            f"a smaller optimizer state (--optimizer kahan: {checkpoint_bytes(1, 'kahan')} B/param, not "
            f"{checkpoint_bytes(1, scheme)}), "
        )
    )
    what = "weights + optimizer state" if with_optimizer else "weights"
    if saves and free < need:
        raise RunError(
            f"{out}: {gb(free)} free on its disk, but the checkpoints need about {gb(need)} "
            f"({gb(one)} each, {what}; from the second save ckpt/ and "
            f"ckpt.tmp/ coexist): choose another --out-dir, {smaller}or save once "
            f"(--save-every >= --steps)"
        )
