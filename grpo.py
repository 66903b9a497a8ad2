"""GRPO with FlowTracer token credit, on one device: rollout -> reward -> credit -> update -> log.

Implements the training loop of the FlowTracer paper ("How Does Reasoning Flow?", §3.3, eq. 5-6, App. A.2
eq. 10-11, App. C):
  rollout   G samples per prompt, T = 0.99, top-p 1.0, top-k 100 (App. C.3): rollout.generate, one call
  reward    a verifier from data.py (or --reward: reward_code.py); group advantages A_i = (r_i - mean) / std
            (eq. 10), clipped to +-2
  update    per micro-batch: the forward gives log pi and, on its way, the middle layers' attention (eq. 1,
            a flowtracer.Capture); trace_flow gives the flow (eq. 2-4); flow_credit puts gamma = 1.5 on the
            top 40% response tokens by throughput (eq. 6); the PPO clipped surrogate with gamma on each token
            term, for both signs of A (eq. 5), then backward:
              J = 1/G sum_i 1/N_i sum_t gamma_it * min(ratio_it A_i, clip(ratio_it, 1-eps_lo, 1+eps_hi) A_i)
            plus dual-clip (c = 3) for A < 0 and an optional k3 KL term (beta = 0 by default: no reference)
  log       one JSONL line of metrics per step, rollouts with their per-token credit, a PNG of the curves

Read one step in four files: this one top to bottom (train, grpo_step, update, the GRPO math), flowtracer.py
(Capture, trace_flow, flow_credit), data.py (reward), and the signature of training/decode/rollout.py's
`generate`. A forward fills a Capture because training/model/load.py's load_model runs every model under the
attention "sdpa_capture" (a model transformers runs without SDPA, Gemma-2 or GPT-OSS: "eager_capture", its own
eager attention; one call, flowtracer.register_attention; an import registers nothing). Behind one
call each (README, "The layout"): every other credit, the shared-prompt update, the optimizer, the run's
files, setup; the rollout, update and evaluation run through training/memory/backoff.py: out of memory, they
go on smaller.

Departures from the paper (numbered):
 1. One device and HF-style sampling instead of ROLL + vLLM + Megatron (App. C.1); gradient accumulation
    over micro-batches stands in for data parallelism: --paper-batch is the paper's 64 x 8 (presets.py).
 2. Per-token log-probs come from a chunked selective log-softmax, recomputed in backward: the (B, T, V)
    fp32 logits of the whole batch never exist (training/policy.py).
 3. On CUDA (--optimizer auto = kahan) weights, gradients and AdamW states are bf16 with a bf16 Kahan
    compensation of each weight (torch-optimi), so lr 1e-6 updates are kept and Qwen3-4B's 1K step fits one
    80 GB GPU (training/model/trainable.py; `python eval.py memory`); the paper's Megatron keeps fp32 master
    weights. A card without bf16 (a T4) gets fp32 AdamW, or LoRA in fp16 with a GradScaler (--precision,
    trainable.py).
 4. The paper's "value clip 0.5" (App. C.3) has no value network to act on in GRPO and is omitted.
 5. The embedded SmolLM2-135M-Instruct (the default --model) trains on the offline arithmetic dataset with a
    small batch and a larger lr, so that it finishes on a CPU, and keeps its weights alone (presets.py).
 6. App. C.3 filters samples "by difficulty (0.1-0.95) and by response length" without a length rule:
    --dynamic-filter adds DAPO's overlong filter (grpo.py); on for the paper's models (presets.py).
 7. Rows with A = 0 (and beta = 0) add exactly nothing to the loss: they get no forward, no backward and no
    credit. The logged entropy is therefore over the rows that were trained.
 8. PPO epochs beyond the first (--num-iterations > 1) keep the first epoch's credit: gamma is part of the
    advantage, fixed by the rollout policy, as A is.
 9. --lora-rank R > 0 trains peft's LoRA adapters on every linear layer (attention and MLP), not every weight,
    so Qwen3-4B's step fits a 24 GB GPU; "LoRA Without Regret" (Schulman et al., Thinking Machines Lab, 2025)
    finds RL with LoRA on all layers matching full fine-tuning at small ranks with ~10x its lr (presets.py).
    The base stays frozen; rollouts, credit and update read the adapted model (training/model/lora.py).
10. --load-in-4bit (with --lora-rank; QLoRA, Dettmers et al., 2023) stores the frozen base's linear layers in
    4 bits (NF4, an fp32 absmax per 64 weights: 4.5 bits a weight), so Qwen3-4B's 1K step fits a 12 GB card;
    the adapters and AdamW stay fp32, the compute the run's precision, and rollouts, credit and update read
    the 4-bit base (training/model/quantize.py).

Run:  python grpo.py                                                    # embedded default, CPU, ~2 min
      python grpo.py --model Qwen/Qwen3-4B-Base --dataset dapo-math-17k # the paper's setting, one 80 GB GPU
      python grpo.py --resume runs/grpo                                 # continue exactly where it stopped
      python grpo.py --lora-rank 8                                      # LoRA on the embedded model, CPU
      python grpo.py --model Qwen/Qwen3-4B-Base --dataset dapo-math-17k --lora-rank 16   # a 24 GB GPU
      python grpo.py --model Qwen/Qwen3-4B-Base --dataset dapo-math-17k --lora-rank 16 --load-in-4bit  # 12 GB

Exit status: 0 finished; 2 a user error (one line: grpo.py: error: ...); 1 a non-finite streak or out of
memory at size 1; 143 after SIGTERM, 130 after Ctrl-C (the shell's 128 + the signal): the step finishes (a
--reward still running gets --stop-grace seconds, then is stopped), is saved, and the --resume line is
printed; a second signal stops at once, the last completed step saved, with the same status.
"""

import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm import tqdm

import data
from flowtracer import Capture, flow_credit, trace_flow
from tasks.answers import PatternError, find_answer_span
from training.config import flags, presets
from training.credit import baselines
from training.decode.rollout import Sampling, generate
from training.memory import backoff
from training.model.lora import AdapterConfig
from training.policy import fixed_logprobs, token_logprobs
from training.run import heldout, log
from training.run.setup import setup
from training.usercode.reward_code import RewardError, TaskConfig


# One flat set of flags: the paper's here, with those of the baselines (--credit-pass, --soft-mass, ...:
# baselines.py), of your own task (--reward, --answer-pattern, ...: reward_code.py) and of LoRA (--lora-rank,
# ...: lora.py) inherited.
@dataclass
class Config(baselines.BaselineConfig, TaskConfig, AdapterConfig):
    # model and dataset
    model: str = "smollm2-135m"  # hub name, local dir, .gguf file or alias (load.py); sets the preset
    dataset: str = "arithmetic"  # a data.py dataset (dapo-math-17k: the paper's); custom: your own file
    data_path: str = ""  # local JSONL/parquet of the dataset ("": offline copy, generator, hub)
    prompt_style: str = "auto"  # how a question becomes a prompt; auto: by model and task (data.py)
    max_prompt_tokens: int = 1024  # longer prompts are skipped with a warning and counted
    # rollout (App. C.3)
    prompts_per_step: int = 16  # prompts per step (the paper: 64 on 8 GPUs, App. C.3; 16 fit one GPU)
    paper_batch: bool = False  # the paper's 64 x 8 samples per step, accumulated (presets.py)
    group_size: int = 8  # G, samples per prompt for the group advantage (the paper's, App. C.3)
    max_new_tokens: int = 1024  # response budget in tokens (the paper's; 8,192 in long runs; App. C.3)
    temperature: float = 0.99  # sampling temperature of the rollouts (the paper's, §4.1, App. C.3)
    top_p: float = 1.0  # nucleus sampling: the top tokens of this mass (the paper's, App. C.3)
    top_k: int = 100  # sample among the k most likely tokens only (the paper's, App. C.3)
    gen_chunk: int = 0  # rows per generate call (the KV cache); 0: sized to the card, CPU: 64
    share_prefix: bool = True  # read each prompt once: rollouts (rollout.py), update (policy.py)
    # reward and advantages
    scale_std: bool = True  # divide by the group std (eq. 10); off = Dr. GRPO style mean-centering
    adv_clip: float = 2.0  # clip each advantage A_i to [-x, x] (the paper's, App. C.3)
    dynamic_filter: bool = False  # train groups with accuracy in [low, high], uncut responses (App. C.3)
    filter_low: float = 0.1  # --dynamic-filter: drop groups less accurate (the paper's, App. C.3)
    filter_high: float = 0.95  # --dynamic-filter: drop groups more accurate (the paper's, App. C.3)
    # credit (eq. 1-6; the baselines' own knobs: training/credit/baselines.py's BaselineConfig)
    credit: str = "flow"  # what ranks the tokens: flow (eq. 1-4, the paper's) or a baseline (scoring.py)
    shaping: str = "topk"  # how the scores become gamma: topk (eq. 6, the paper's) or another rule
    top_frac: float = 0.4  # eq. 6: the fraction of response tokens boosted (the paper's, Table 5)
    gamma: float = 1.5  # eq. 6: gamma_flow, the weight of a boosted token's term (the paper's, Table 7)
    layers: str = "middle"  # eq. 1: W's layers: middle (L/3..2L/3, App. C.2), early|late|all|fig6-*|A:B
    # update
    lr: float = 1e-6  # AdamW learning rate (the paper's, §4.1, App. C.3)
    optimizer: str = "auto"  # auto: kahan (bf16 + Kahan AdamW) under bf16, adamw (fp32) under fp32
    precision: str = "auto"  # auto: bf16 from capability 8.0 (Ampere), below fp16 LoRA / fp32 AdamW
    precision_resolved: str = ""  # set by the run: what --precision resolved to (bf16, fp16, fp32)
    warmup_steps: int = 20  # steps of linear learning-rate warmup (the paper's, App. C.3)
    weight_decay: float = 0.0  # AdamW weight decay (not given in the paper)
    num_iterations: int = 1  # PPO epochs per batch; > 1 runs an old-log-prob pass first
    micro_batch: int = 0  # rows per forward/backward (accumulated); 0: sized to the card, CPU: 8
    eps_low: float = 0.2  # PPO clip: the ratio's floor is 1 - eps_low (eq. 5; paper: no value)
    eps_high: float = 0.2  # clip-higher: the ratio's ceiling is 1 + eps_high (DAPO uses 0.28)
    dual_clip: float = 3.0  # dual-clip c: an A < 0 token's loss is at most c |A| (App. C.3; no c)
    beta: float = 0.0  # k3 KL weight; 0 = no reference model loaded (§4.1: no KL)
    loss_agg: str = "seq-mean"  # per response, then over responses (eq. 5) | over all tokens (DAPO)
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this (not given in the paper)
    grad_checkpointing: bool = True  # recompute activations in backward (less memory, ~1/3 more compute)
    logprob_chunk: int = 128  # positions per selective log-softmax chunk
    # evaluation (held-out greedy accuracy inside the run: training/run/heldout.py)
    eval_every: int = 0  # evaluate every N steps and at the last (0: off); eval/* metrics
    eval_dataset: str = ""  # the held-out dataset ("": the training dataset's test split)
    eval_size: int = 200  # held-out questions (the first N of the test split)
    # run
    seed: int = 0  # the run's seed (prompts, sampling); also seeds --credit random and OAR-G's noise
    steps: int = 500  # training steps (the paper: 500 for 3B/4B models, 600 for 8B; §4.1)
    device: str = "auto"  # where to train; auto: the GPU when one is visible, else the CPU
    gpu_gb: float = 0.0  # the GPU's memory in GB the step is sized to (0: the card's own total)
    out_dir: str = "runs/grpo"  # the run directory: metrics.jsonl, rollouts/, ckpt/, curves.png
    overwrite: bool = False  # start afresh in an out_dir that holds a run (else: an error)
    save_every: int = 50  # checkpoint every N steps (and at the end, on Ctrl-C / SIGTERM)
    stop_grace: float = 30.0  # seconds a --reward gets after Ctrl-C / SIGTERM (Slurm's and Kubernetes' grace)
    keep_checkpoints: int = 1  # keep the last K checkpoints (ckpt/ and ckpt-<step>/ before it)
    save_optimizer: bool = True  # save AdamW's state (2x weights): exact --resume; off: AdamW restarts
    rollouts_every: int = 10  # save rollouts with per-token credit every N steps
    report_to: str = "none"  # experiment tracker: none | tensorboard (in out_dir) | wandb (offline)
    max_bad_steps: int = 3  # stop after this many consecutive NaN/inf steps
    config: str = ""  # a YAML or JSON file of these flags (a run's run_config.json too)
    resume: str = ""  # a run directory (or its ckpt/) to continue from, in that directory
    allow_config_change: bool = False  # let --resume change flags that change the run (--model, --lr, ...)


PRESETS = presets.of(Config)  # the embedded run's, the paper's, LoRA's: training/config/presets.py


# ----------------------------------------------------------------------------- the loop
class Outcome(NamedTuple):
    history: list  # one metrics dict per step run
    stop: str | None  # why the run ended early: "interrupted", a non-finite streak, a full disk
    status: int  # main's exit status: 0 (finished), 1 (non-finite, OOM), 2 (disk), 128 + the signal
    # (interrupted: 143 SIGTERM, 130 Ctrl-C, the shell's convention; the step saved)


def train(cfg: Config, run=None) -> Outcome:
    run = run or setup(cfg)  # data, model, optimizer, run directory; sized to a GPU
    history, stop, status, bad = [], None, 0, run.bad_steps  # bad: consecutive non-finite steps
    for step in tqdm(range(run.start, cfg.steps), desc="grpo", initial=run.start, total=cfg.steps):
        m, rollouts, bad = grpo_step(run, step, bad)  # rollout -> reward -> credit -> update
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):  # eval/*
            m.update(heldout.evaluate(run))  # greedy accuracy on the held-out set, backed off
        history.append(m)
        if bad >= cfg.max_bad_steps:
            stop, status = f"{bad} consecutive steps with a non-finite loss or gradient (lower --lr?)", 1
        elif run.log.signals.signum:  # a first Ctrl-C / SIGTERM: this step is saved, the run stops
            stop, status = "interrupted", run.log.signals.status  # 143, 130
        full = run.log.step(step, m, rollouts, bad, stopping=stop is not None)  # metrics, saves when due
        if full:  # a full disk: the message, and the last checkpoint stands
            stop, status = full, 2
        if stop:
            break
    run.log.finish(stop)
    return Outcome(history, stop, status)


class Step(NamedTuple):
    metrics: dict  # the step's metrics line (log.step_metrics), or why it was skipped
    rollouts: log.Rollouts | None  # what rollouts/step_N.jsonl shows (save_rollouts); None: skipped
    bad: int  # consecutive steps with a non-finite loss or gradient, this one included


def grpo_step(run, step, bad) -> Step:
    """One GRPO step: rollout -> reward -> credit -> update (bad: the non-finite streak before it)."""
    cfg, pol, task, G, clock = run.cfg, run.policy, run.task, run.cfg.group_size, run.log.clock  # phases
    n, prompts, limit = cfg.prompts_per_step, task.prompt_ids, task.prompt_limit  # {record: token ids}
    ids = [i for i in task.order[step * n : (step + 1) * n] if len(prompts[i]) <= limit]  # setup's limit:
    m = {"step": step + 1, "prompts/skipped_long": n - len(ids)}  # --max-prompt-tokens, the model's length
    if len(ids) < n:
        tqdm.write(f"step {step + 1}: {n - len(ids)} prompt(s) longer than {task.limit_words} skipped")
    if not ids:
        return Step({**m, "skipped": f"every prompt is longer than {task.limit_words}"}, None, bad)
    # ---------------------------------------------------------- rollout
    todo, sampling = [prompts[i] for i in ids], Sampling.of(cfg)  # G responses each, App. C.3's sampling
    with clock.phase("generation"), torch.no_grad(), pol.autocast:  # out of memory: smaller chunks, again
        gen = backoff.generate(
            run, "rollout", generate, pol.model, pol.tok, todo, G, sampling, share_prefix=cfg.share_prefix
        )  # on the run's decode engine (CUDA; the CPU decoder elsewhere)
    # ---------------------------------------------------------- reward
    with clock.phase("reward"):
        rows = [task.records[i] for i in ids for _ in range(G)]  # row j: prompt j // G
        rewards = torch.tensor(data.batch_reward(task.reward, gen.texts, rows, gen.response_ids))  # (B,)
        m["answers/missing"] = sum(find_answer_span(t, cfg.answer_pattern) is None for t in gen.texts)
        adv, zero_std = compute_advantages(rewards, G, cfg.scale_std, cfg.adv_clip)  # (B,) eq. 10
        kept, dropped = (
            kept_rows(rewards, gen.truncated, cfg) if cfg.dynamic_filter else (list(range(len(rewards))), {})
        )  # departure 6
    m.update(dropped)
    if not kept:
        return Step({**m, "skipped": "the dynamic filter dropped every group"}, None, bad)
    batch = data.build_batch(
        pol.tok,
        [gen.prompt_ids[j] for j in kept],
        [gen.response_ids[j] for j in kept],
        device=pol.device,
        answer_pattern=cfg.answer_pattern,
    )  # (B, T) masks
    adv = adv[kept].to(pol.device)  # (B,)
    trained = (adv != 0).nonzero().flatten().tolist() if cfg.beta == 0 else list(range(len(kept)))  # dep. 7
    # ---------------------------------------------------------- credit and update, micro-batch by micro-batch
    up = backoff.update(run, update, batch, trained, adv, clock)  # out of memory: a smaller micro_batch
    bad = 0 if up.stepped or up.skipped else bad + 1  # non-finite loss or gradient: no step (train stops)
    lr = pol.next_lr(up.stepped)  # the warmup schedule: once a GRPO step that stepped
    m |= log.step_metrics(cfg, rewards, zero_std, gen, batch, adv, up, clock.seconds, bad, lr, pol.device)
    return Step(m, log.Rollouts(batch, gen, kept, rewards, adv, up.scores, up.weight), bad)


# ----------------------------------------------------------------------------- policy math
class Update(NamedTuple):
    weight: torch.Tensor  # (B, R) gamma_it of every row: eq. 1-6 on the trained rows, 1 elsewhere
    scores: torch.Tensor  # (B, R) the credit's scores (flow: throughput) on trained rows, 0 elsewhere
    stats: dict  # loss, grad_norm, clip counts, entropies, credit fallbacks
    stepped: bool  # False: a non-finite loss or gradient, and the optimizer did not step
    skipped: bool = False  # fp16: the GradScaler skipped the step at an overflow (not a non-finite one)


class Experience(NamedTuple):
    """One micro-batch's inputs to the loss besides the log-probs (tiny-grpo's Experience), b rows."""

    adv: torch.Tensor  # (b,) A_i, eq. 10
    weight: torch.Tensor  # (b, R) gamma_it, the credit (eq. 6)
    loss_mask: torch.Tensor  # (b, R) bool: the response tokens among the response columns
    old_logp: torch.Tensor  # (b, R) PPO's old log pi (on-policy: the forward's own, detached)
    ref_logp: torch.Tensor | None  # (b, R) the reference's log pi for the k3 KL term; None when beta = 0
    denom: float  # the whole batch's normaliser: B rows (seq-mean) or its response tokens


def update(run, batch, trained, adv, clock) -> Update:
    """The update on the `trained` rows of `batch` (A != 0); each micro-batch in the paper's order:
      forward    log pi(y_t) and the entropy; FlowTracer's Capture takes eq. 1's attention maps on the way
      credit     trace_flow (eq. 2-4) on the maps, flow_credit (eq. 6): gamma; any other credit, one call
      loss       the clipped surrogate with gamma on each token term (eq. 5); backward accumulates
    then clip and one optimizer step, per PPO epoch (--num-iterations; departure 8). `clock` times the
    phases (log.Clock, or memtrace's tracker: what runs is what is measured)."""
    cfg, pol, model, P = run.cfg, run.policy, run.policy.model, batch.prompt_width
    loss_mask = batch.response_mask[:, P:]  # (B, R)
    weight = loss_mask.float()  # (B, R) gamma_it; untrained rows: 1
    scores = torch.zeros(loss_mask.shape, device=loss_mask.device)  # (B, R) untrained rows: 0
    stats = {"loss": 0.0, "clip/low": 0, "clip/high": 0, "clip/dual": 0, "entropy": [], "credit/fallback": 0}
    denom = loss_mask.shape[0] if cfg.loss_agg == "seq-mean" else loss_mask.sum().clamp_min(1).item()  # 1/G
    paper = (cfg.credit, cfg.shaping, cfg.token_class or "", cfg.credit_pass) == baselines.PAPER  # eq. 1-6
    with clock.phase("credit"):  # every other credit: training/credit/baselines.py, one object, the same
        other = None if paper else baselines.OtherCredit(run, batch, trained, adv)  # call shape and record
    with clock.phase("update forward"), pol.autocast:
        old = ref = None  # (B, R) on-policy: the forward's own log pi, detached (tests/test_grpo_update.py)
        if cfg.num_iterations > 1:  # PPO's old log pi (B, R): the pre-update policy's
            model.eval()
            old = fixed_logprobs(model, batch, trained, cfg.micro_batch, cfg.logprob_chunk, cfg.share_prefix)
        if pol.ref is not None:  # the reference's log pi (B, R), for the k3 KL term (beta > 0)
            ref = pol.ref_logprobs(batch, trained, cfg.micro_batch, cfg.logprob_chunk, cfg.share_prefix)
    model.train()
    for epoch in range(cfg.num_iterations):
        first = epoch == 0  # the first epoch's forward gives the credit (dep. 8)
        for i in range(0, len(trained), cfg.micro_batch):
            mb = trained[i : i + cfg.micro_batch]
            sub = data.take(batch, mb)  # b rows
            cap = Capture(run.layers, head_mean=run.head_mean) if first and run.layers else None  # eq. 1
            with clock.phase("update forward"), pol.autocast:
                logp, ent = token_logprobs(
                    model,
                    sub.input_ids,
                    sub.attention_mask,
                    P,
                    cfg.logprob_chunk,
                    cfg.share_prefix,
                    capture=cap,
                )  # (b, R)
            if first:
                with clock.phase("credit"), torch.no_grad():
                    if other is None:  # FlowTracer's credit of this forward, eq. 1-4 then 6
                        flow = trace_flow(
                            cap.maps(sub.attention_mask),  # W (b, T, T), eq. 1
                            sub.question_mask,
                            sub.answer_mask,
                            sub.attention_mask,
                        )
                        c = flow_credit(
                            flow.throughput, sub.response_mask, cfg.top_frac, cfg.gamma, prompt_width=P
                        )  # (b, R) eq. 6
                    else:  # another credit (Tables 2, 5, 7; OAR): the same record
                        c = other(mb, sub, cap, ent)
                weight[mb], scores[mb] = c.weight, c.scores  # (b, R)
                stats["credit/fallback"] += int(c.fallback.sum())
            with clock.phase("backward"):
                exp = Experience(
                    adv=adv[mb],
                    weight=weight[mb],
                    loss_mask=loss_mask[mb],
                    old_logp=logp.detach() if old is None else old[mb],
                    ref_logp=None if ref is None else ref[mb],
                    denom=denom,
                )
                loss, st = grpo_loss(logp, exp, cfg)  # eq. 5
                pol.backward(loss)  # fp16: times the GradScaler's scale
            stats["loss"] += loss.item()
            stats["entropy"].append(ent[loss_mask[mb]])
            stats.update({k: stats[k] + v for k, v in st.items()})
            del cap, logp, ent, loss  # the next micro-batch's forward starts empty
        with clock.phase("optimizer step"):  # clip, then step; a non-finite loss or gradient: no step
            opt = pol.step(stats["loss"], cfg.max_grad_norm)  # clip, step, zero (LoRA: the adapters)
        stats.update({"grad_norm": opt.grad_norm, **({"scaler/scale": opt.scale} if opt.scale else {})})
        if not opt.stepped:  # train counts the streak of non-finite steps
            break
    return Update(weight, scores, stats, opt.stepped, opt.skipped)


def compute_advantages(rewards, G, scale_std=True, clip=2.0):
    """Group-relative advantages (eq. 10): A_i = (r_i - mean_g) / std_g, clipped to [-clip, clip]. Returns
    (adv (B,), zero_std (B/G,) bool); a group without variation gets A = 0, a NaN (unscored) reward too."""
    r = rewards.view(-1, G)  # (B/G, G)
    adv = r - r.nanmean(-1, keepdim=True)  # over the scored rewards
    std = r.std(-1, unbiased=False, keepdim=True)  # population std, as in OAR eq. 2
    if r.isnan().any():  # over the scored rewards
        std = adv.double().pow(2).nanmean(-1, keepdim=True).sqrt().float()
    if scale_std:
        adv = adv / (std + 1e-6)
    return adv.nan_to_num(0.0).clamp(-clip, clip).view(-1), ~(std.squeeze(-1) >= 1e-8)


def kept_rows(rewards, truncated, cfg):
    """(row indices for the update, {metric: count dropped}) under --dynamic-filter (App. C.3, departure 6).
    The paper filters "by difficulty (0.1-0.95) and by response length" without a length rule: a group is
    trained when its accuracy is in [filter_low, filter_high], and in it the responses that ended before
    max_new_tokens (DAPO's overlong filter)."""
    acc = (rewards.view(-1, cfg.group_size) >= 1).float().mean(-1)  # (B/G,)
    ok = (acc >= cfg.filter_low) & (acc <= cfg.filter_high)
    kept = [j for j in range(len(rewards)) if ok[j // cfg.group_size] and not truncated[j]]
    return kept, {"groups/filtered": int((~ok).sum()), "rows/truncated_dropped": int(sum(truncated))}


def grpo_loss(logp, exp: Experience, cfg):
    """Eq. 5 with dual-clip, summed over this micro-batch and divided by the whole batch's exp.denom (B rows
    for seq-mean, its response tokens for token-mean). logp: (b, R), the policy's log pi with grad.
    Returns (loss, stats of summed counts)."""
    A, mask = exp.adv.unsqueeze(-1), exp.loss_mask  # (b, 1), (b, R)
    ratio = torch.exp(logp - exp.old_logp)  # (b, R)
    obj = torch.min(ratio * A, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * A)
    obj = torch.where(A < 0, torch.max(obj, cfg.dual_clip * A), obj)  # dual-clip for A < 0
    per_tok = -exp.weight * obj  # (b, R) eq. 5-6: gamma on each term
    if cfg.beta > 0:  # k3 estimator of KL(pi || ref)
        d = exp.ref_logp - logp
        per_tok = per_tok + cfg.beta * (torch.exp(d) - d - 1)
    m = mask.float()
    if cfg.loss_agg == "seq-mean":  # 1/G sum_i 1/N_i sum_t
        loss = ((per_tok * m).sum(-1) / m.sum(-1).clamp_min(1)).sum() / exp.denom
    else:  # token-mean: sum_it / sum_i N_i
        loss = (per_tok * m).sum() / exp.denom
    with torch.no_grad():
        stats = {
            "clip/low": ((ratio < 1 - cfg.eps_low) & (A < 0) & mask).sum().item(),
            "clip/high": ((ratio > 1 + cfg.eps_high) & (A > 0) & mask).sum().item(),
            "clip/dual": ((ratio > cfg.dual_clip) & (A < 0) & mask).sum().item(),
        }
    return loss, stats


# ----------------------------------------------------------------------------- command line
def parse_args(argv=None, for_gpu=False, say=False) -> Config:
    """The Config of a command line, resolved once (training/config/flags.py's parse): the defaults, the
    presets in force, a --config file, then the flags given; or, with --resume, the saved run's config (it
    continues in place). for_gpu: the flags are judged as for a GPU whatever this machine has (eval.py
    memory); say: print
    where the learning rate came from (main)."""
    return flags.parse(Config, argv, __doc__, PRESETS, "grpo.py", for_gpu, say)  # argv None: sys.argv[1:]


def main(argv=None):
    cfg = parse_args(argv, say=True)
    try:
        run = setup(cfg)  # on CUDA: sized to the card before the weights load
    except (ValueError, OSError, ImportError) as e:  # the user's files, model, checkpoint, out_dir
        print(f"grpo.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the run's handler (setup's last lines install it)
        print("grpo.py: interrupted during setup: nothing was trained", file=sys.stderr)
        sys.exit(130)
    try:
        out = train(cfg, run)
    except (RewardError, PatternError, log.Interrupted) as e:  # your reward or pattern; a second signal
        out = Outcome([], *run.log.stopped(e))  # the last completed step saved, the run finished
    except backoff.OutOfMemory as e:  # out of memory at gen_chunk or micro_batch 1
        run.log.finish(str(e))
        out = Outcome([], str(e), 1)
    if out.stop == "interrupted":  # the step saved, the --resume line said (RunLog.finish)
        sys.exit(out.status)  # 128 + the signal: 143 SIGTERM, 130 Ctrl-C
    if out.status:  # a non-finite streak (1), a full disk (2)
        print(f"grpo.py: {'error' if out.status == 2 else 'stopping'}: {out.stop}", file=sys.stderr)
        sys.exit(out.status)
    return out


if __name__ == "__main__":
    main()
