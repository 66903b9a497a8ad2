"""GRPO with FlowTracer token credit, on one device: rollout -> reward -> credit -> update -> log.

Implements the training loop of the FlowTracer paper ("How Does Reasoning Flow?", §3.3, eq. 5-6, App. A.2
eq. 10-11, App. C):
  rollout   G samples per prompt, T = 0.99, top-p 1.0, top-k 100 (App. C.3); each prompt read once
  reward    a verifier from data.py; group advantages A_i = (r_i - mean) / std (eq. 10), clipped to +-2
  credit    credit.assign: a signal (signals.py) and a shaping rule (credit.py) give gamma (B, R); the
            default is FlowTracer: top 40% response tokens by flow throughput get gamma = 1.5 (eq. 6)
  update    PPO clipped surrogate with gamma_{i,t} on every token term, for both signs of A (eq. 5):
              J = 1/G sum_i 1/N_i sum_t gamma_it * min(ratio_it A_i, clip(ratio_it, 1-eps_lo, 1+eps_hi) A_i)
            plus dual-clip (c = 3) for A < 0 and an optional k3 KL term (beta = 0 by default: no reference)
  log       one JSONL line of metrics per step, rollouts with their per-token credit, a PNG of the curves

The update runs each micro-batch in the paper's order (`update`): forward -> credit -> loss -> backward.
Signals with a forward of their own (fai, gradient, correlation, OAR) and the batch-wide 80-20 rule run as a
separate credit pass before it (--credit-pass separate: any signal).

Reading path (7 files): this file top to bottom (train, grpo_step, update, the GRPO math), then what the
step calls, in order: training/rollout.py (generate, build_batch), data.py (score), training/credit.py
(assign) and training/signals.py, flowtracer.py (Capture, trace_flow, flow_credit), training/policy.py
(token_logprobs, optimizer_step). Setup and logging: training/checkpoint.py, training/runlog.py.

Departures from the paper (numbered):
 1. One device and HF `generate` instead of ROLL + vLLM + Megatron (App. C.1); gradient accumulation over
    micro-batches stands in for data parallelism: --paper-batch (PAPER_BATCH) is the paper's 64 prompts x 8.
 2. Per-token log-probs come from a chunked selective log-softmax, recomputed in backward: the (B, T, V)
    fp32 logits of the whole batch never exist.
 3. On CUDA (--optimizer auto = kahan) weights, gradients and AdamW states are bf16 with a bf16 Kahan
    compensation of each weight (torch-optimi), so lr 1e-6 updates are kept and Qwen3-4B's 1K step fits in
    ~48 GB (policy.py; `python eval.py memory`); the paper's Megatron keeps fp32 master weights. CPU: fp32.
 4. The paper's "value clip 0.5" (App. C.3) has no value network to act on in GRPO and is omitted.
 5. The embedded SmolLM2-135M-Instruct (the default --model, named or not) trains on the offline arithmetic
    task with a small batch and a larger lr (EMBEDDED below) so that it finishes on a CPU, and keeps one
    checkpoint without the optimizer's state (--no-save-optimizer): ~540 MB on disk.
 6. App. C.3 filters samples "by difficulty (0.1-0.95) and by response length" without defining the length
    rule. --dynamic-filter drops groups with accuracy outside [0.1, 0.95] and, as DAPO's overlong filter,
    responses cut at max_new_tokens. Off for the embedded run (its tiny batch would often be empty), on for
    the paper's models (PAPER below).
 7. Rows with A = 0 (and beta = 0) add exactly nothing to the loss: they get no forward, no backward and no
    credit. The logged entropy is therefore over the rows that were trained.

Run:  python grpo.py                                                    # embedded default, CPU, ~2 min
      python grpo.py --model Qwen/Qwen3-4B-Base --dataset dapo-math-17k # the paper's setting, one 80 GB GPU
      python grpo.py --resume runs/grpo                                 # continue exactly where it stopped
"""
import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
from tqdm import tqdm

import data
from training import checkpoint as ckpt_io
from training import credit, flags, models, policy, runlog, signals
from training.policy import old_logprobs, optimizer_step, ref_logprobs, token_logprobs
from training.rollout import build_batch, generate, take


@dataclass
class Config(credit.CreditConfig):   # inherits the credit knobs: --credit, --shaping, --top-frac, --gamma
    # model and task
    model: str = "smollm2-135m"        # hub name, local dir, .gguf file or alias (models.py); sets the preset
    dataset: str = "arithmetic"        # a data.py task name (dapo-math-17k for the paper's math runs)
    data_path: str = ""                # local JSONL/parquet of the dataset ("": offline copy, generator, hub)
    prompt_style: str = "auto"         # how a question becomes a prompt; auto: by model and task (data.py)
    max_prompt_tokens: int = 1024      # longer prompts are skipped with a warning and counted
    # rollout (App. C.3)
    prompts_per_step: int = 16         # prompts per step (the paper: 64 on 8 GPUs, App. C.3; 16 fit one GPU)
    paper_batch: bool = False          # the paper's 64 x 8 samples per step, accumulated (PAPER_BATCH)
    group_size: int = 8                # G, samples per prompt for the group advantage (the paper's, App. C.3)
    max_new_tokens: int = 1024         # response budget in tokens (the paper's; 8,192 in long runs; App. C.3)
    temperature: float = 0.99          # sampling temperature of the rollouts (the paper's, §4.1, App. C.3)
    top_p: float = 1.0                 # nucleus sampling: the top tokens of this mass (the paper's, App. C.3)
    top_k: int = 100                   # sample among the k most likely tokens only (the paper's, App. C.3)
    gen_chunk: int = 64                # rows per generate call (bounds the KV cache)
    share_prefix: bool = True          # read each prompt once: rollouts (rollout.py), update (policy.py)
    # reward and advantages
    scale_std: bool = True             # divide by the group std (eq. 10); off = Dr. GRPO style mean-centering
    adv_clip: float = 2.0              # clip each advantage A_i to [-x, x] (the paper's, App. C.3)
    dynamic_filter: bool = False       # train groups with accuracy in [low, high], uncut responses (App. C.3)
    filter_low: float = 0.1            # --dynamic-filter: drop groups less accurate (the paper's, App. C.3)
    filter_high: float = 0.95          # --dynamic-filter: drop groups more accurate (the paper's, App. C.3)
    # credit (inherited from training/credit.py's CreditConfig)
    # update
    lr: float = 1e-6                   # AdamW learning rate (the paper's, §4.1, App. C.3)
    optimizer: str = "auto"            # auto: kahan (bf16 + Kahan AdamW) on CUDA, adamw (fp32) on CPU
    warmup_steps: int = 20             # steps of linear learning-rate warmup (the paper's, App. C.3)
    weight_decay: float = 0.0          # AdamW weight decay (not given in the paper)
    num_iterations: int = 1            # updates per batch; > 1 runs an old-log-prob pass first
    micro_batch: int = 8               # rows per forward/backward (gradient accumulation)
    eps_low: float = 0.2               # PPO clip: the ratio's floor is 1 - eps_low (eq. 5; paper: no value)
    eps_high: float = 0.2              # clip-higher: the ratio's ceiling is 1 + eps_high (DAPO uses 0.28)
    dual_clip: float = 3.0             # dual-clip c: an A < 0 token's loss is at most c |A| (App. C.3; no c)
    beta: float = 0.0                  # k3 KL weight; 0 = no reference model loaded (§4.1: no KL)
    loss_agg: str = "seq-mean"         # per response, then over responses (eq. 5) | over all tokens (DAPO)
    max_grad_norm: float = 1.0         # clip the gradient's global norm to this (not given in the paper)
    grad_checkpointing: bool = True    # recompute activations in backward (less memory, ~1/3 more compute)
    logprob_chunk: int = 128           # positions per selective log-softmax chunk
    # run
    steps: int = 500                   # training steps (the paper: 500 for 3B/4B models, 600 for 8B; §4.1)
    device: str = "auto"               # where to train; auto: the GPU when one is visible, else the CPU
    out_dir: str = "runs/grpo"         # the run directory: metrics.jsonl, rollouts/, ckpt/, curves.png
    overwrite: bool = False            # start afresh in an out_dir that holds a run (else: an error)
    save_every: int = 50               # checkpoint every N steps (and at the end, on Ctrl-C / SIGTERM)
    save_optimizer: bool = True        # save AdamW's state (2x weights): exact --resume; off: AdamW restarts
    rollouts_every: int = 10           # save rollouts with per-token credit every N steps
    max_bad_steps: int = 3             # stop after this many consecutive NaN/inf steps
    resume: str = ""                   # a run directory (or its ckpt/) to continue from
    allow_config_change: bool = False  # let --resume change flags that change the run (--model, --lr, ...)


# Departure 5: the embedded model (the default --model, named or not) runs on a CPU in minutes and keeps one
# checkpoint, its weights alone (~540 MB: saved at the end, without AdamW's state). Flags given win.
EMBEDDED = dict(prompts_per_step=2, group_size=4, max_new_tokens=128, steps=6, lr=1e-5, warmup_steps=2,
                micro_batch=4, gen_chunk=8, rollouts_every=2, max_prompt_tokens=768, save_optimizer=False,
                grad_checkpointing=False, out_dir="runs/embedded")
PAPER = dict(dynamic_filter=True)   # departure 6: the paper's models get App. C.3's dynamic filter
PAPER_BATCH = dict(prompts_per_step=64, group_size=8, micro_batch=8, gen_chunk=64)   # departure 1; flags win
PRESETS = {"the embedded model": EMBEDDED, "a paper model": PAPER, "--paper-batch": PAPER_BATCH}


# ----------------------------------------------------------------------------- the loop
class Outcome(NamedTuple):
    history: list               # one metrics dict per step run
    stop: str | None            # why the run ended early: "interrupted", a non-finite streak, a full disk
    status: int                 # main's exit status: 0 (finished, interrupted), 1 (non-finite), 2 (disk)


def train(cfg: Config, run=None) -> Outcome:
    run = run or setup(cfg)                  # data, model, optimizer, run directory (setup, below)
    history, stop, status = [], None, 0
    bad = run.bad_steps                      # consecutive non-finite steps, as the checkpoint left them
    bar = tqdm(desc="grpo", initial=run.start, total=cfg.steps)
    with runlog.Interrupt() as interrupt:    # first Ctrl-C / SIGTERM: finish this step, save, stop
        for step in range(run.start, cfg.steps):
            m, rollout, bad = grpo_step(run, step, bad)    # rollout -> reward -> credit -> update -> log
            bar.update(1)
            history.append(m)
            if bad >= cfg.max_bad_steps:
                stop, status = f"{bad} consecutive steps with a non-finite loss or gradient (lower --lr?)", 1
            elif interrupt.requested:
                stop = "interrupted"
            full = runlog.end_step(run, step, m, rollout, bad, stopping=stop is not None)   # save when due
            if full:                         # a full disk: the message, and the last checkpoint stands
                stop, status = full, 2
            if stop:
                break
    bar.close()
    runlog.finish(run, stop)
    return Outcome(history, stop, status)


def grpo_step(run, step, bad):
    """One GRPO step. Returns (its metrics, what the rollouts file shows or None, the non-finite streak)."""
    cfg, model, tok, G = run.cfg, run.model, run.tok, run.cfg.group_size
    m = {"step": step + 1}
    run.clock.reset()
    # ---------------------------------------------------------- rollout
    run.clock.phase("generation")
    recs, prompts, m["prompts/skipped_long"] = step_prompts(run, step)       # drops prompts too long
    if not recs:
        return {**m, "skipped": "every prompt is longer than --max-prompt-tokens"}, None, bad
    model.eval()
    with torch.no_grad(), run.autocast:
        gen = generate(model, tok, prompts, n=G, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                       chunk_size=cfg.gen_chunk, share_prefix=cfg.share_prefix)
    # ---------------------------------------------------------- reward
    run.clock.phase("reward")
    rewards = torch.tensor([data.score(recs[j // G], txt) for j, txt in enumerate(gen.texts)])    # (B,)
    adv, zero_std = compute_advantages(rewards, G, cfg.scale_std, cfg.adv_clip)                  # (B,)
    rows, dropped = kept_rows(rewards, gen.truncated, cfg)                                        # filter
    m.update(dropped)
    if not rows:
        return {**m, "skipped": "the dynamic filter dropped every group"}, None, bad
    batch = build_batch(tok, [gen.prompt_ids[j] for j in rows], [gen.response_ids[j] for j in rows])
    batch = batch.to(run.device)
    adv = adv[rows].to(run.device)                                                                # (B,)
    trained = (adv != 0).nonzero().flatten().tolist() if cfg.beta == 0 else list(range(len(rows)))  # dep. 7
    # ---------------------------------------------------------- credit (its own pass, when it needs one)
    run.clock.phase("credit")
    given = None                       # the fused credit (the default) comes from the update's forward
    if credit.separate_pass(cfg) and trained:
        with torch.no_grad(), run.autocast:
            given = credit.assign(model, tok, take(batch, trained), adv[trained], cfg)            # (b, R)
    # ---------------------------------------------------------- update: forward, credit, loss, backward
    up = update(run, batch, trained, adv, given)
    bad = 0 if up.stepped else bad + 1          # a non-finite loss or gradient: no step (train stops a run)
    if up.stepped:
        run.sched.step()
    # ---------------------------------------------------------- log
    m.update(runlog.step_metrics(run, rewards, zero_std, gen, batch, adv, up, run.clock.seconds, bad))
    return m, (batch, gen, rows, rewards, adv, up.scores, up.gamma), bad


# ----------------------------------------------------------------------------- policy math
class Update(NamedTuple):
    gamma: torch.Tensor         # (B, R) gamma_it of every row: eq. 1-6 on the trained rows, 1 elsewhere
    scores: torch.Tensor        # (B, R) the credit signal's scores on the trained rows, 0 elsewhere
    stats: dict                 # loss, grad_norm, clip counts, entropies, credit fallbacks
    stepped: bool               # False: a non-finite loss or gradient, and the optimizer did not step


def update(run, batch, rows, adv, given=None) -> Update:
    """The update phase on the trained `rows` of `batch`; per micro-batch, in the paper's order:
      forward    log pi(y_t), the entropy, and the chosen layers' attention maps when the credit reads them
                 (eq. 1: the forward fills the flowtracer.Capture it is given); on-policy old log pi = log pi
      credit     gamma from those maps (flow: eq. 1-4, then eq. 6), or the rows of `given` (a separate pass)
      loss       the clipped surrogate with gamma on each token term (eq. 5); backward accumulates
    then clip and one optimizer step (per --num-iterations; the credit of the first is kept). run.clock marks
    the phases: grpo.train's Clock, or evaluation/memtrace's tracker: what runs is what is measured."""
    cfg, model, P, clock = run.cfg, run.model, batch.prompt_width, run.clock
    resp = batch.response_mask[:, P:]                                                          # (B, R)
    stats = {"loss": 0.0, "clip/low": 0, "clip/high": 0, "clip/dual": 0, "entropy": []}
    parts = []                                   # each micro-batch's credit.Assignment (b, R)
    clock.phase("update forward")
    old_logp = old_logprobs(run, batch, rows)    # (B, R); None on-policy: the detached logp below
    model.train()
    for it in range(cfg.num_iterations):
        for i, s in enumerate(range(0, len(rows), cfg.micro_batch)):
            mb = rows[s:s + cfg.micro_batch]
            sub = take(batch, mb)
            # forward
            clock.phase("update forward")
            cap = credit.new_capture(model, cfg) if it == 0 and given is None else None   # None: no maps
            with run.autocast:
                logp, ent = token_logprobs(model, sub.input_ids, sub.attention_mask, P, cfg.logprob_chunk,
                                           cfg.share_prefix, capture=cap)                     # (b, R)
            maps = cap.maps(sub.attention_mask) if cap is not None else None                  # (b, T, T)
            # credit
            if it == 0:
                clock.phase("credit")
                if given is None:
                    with torch.no_grad():
                        c = credit.assign(model, run.tok, sub, adv[mb], cfg, signals.Captured(maps, ent))
                else:
                    c = credit.Assignment(*(x[s:s + len(mb)] for x in given))
                parts.append(c)
            gamma = parts[i].gamma                                                             # (b, R)
            # loss
            clock.phase("backward")
            old = logp.detach() if old_logp is None else old_logp[mb]                         # on-policy: 1
            loss, st = grpo_loss(logp, old, adv[mb], gamma, resp[mb], cfg, denominator(cfg, resp),
                                 ref_logprobs(run, sub))                                       # eq. 5
            # backward
            loss.backward()
            stats["loss"] += loss.item()
            stats["entropy"].append(ent[resp[mb]])
            stats.update({k: stats[k] + v for k, v in st.items()})
            del cap, maps, logp, ent, loss, old            # the next micro-batch's forward starts empty
        clock.phase("optimizer step")
        stepped, stats["grad_norm"] = optimizer_step(model, run.opt, cfg.max_grad_norm, stats["loss"])
        if not stepped:
            break
    clock.phase(None)
    stats["credit/fallback"] = sum(int(c.fallback.sum()) for c in parts)
    gamma, scores = resp.float(), torch.zeros(resp.shape, device=resp.device)     # (B, R): untrained rows
    if parts:                                                                      # the trained rows' credit
        idx = torch.tensor(rows, dtype=torch.long, device=resp.device)             # (b,)
        gamma = gamma.index_copy(0, idx, torch.cat([c.gamma.float() for c in parts]))
        scores = scores.index_copy(0, idx, torch.cat([c.scores.float() for c in parts]))
    return Update(gamma, scores, stats, stepped)


def compute_advantages(rewards, G, scale_std=True, clip=2.0):
    """Group-relative advantages (eq. 10): A_i = (r_i - mean_g) / std_g, clipped to [-clip, clip].
    Returns (adv (B,), zero_std (B/G,) bool). A group whose rewards do not vary gets A = 0."""
    r = rewards.view(-1, G)                                               # (B/G, G)
    std = r.std(-1, unbiased=False, keepdim=True)                         # population std, as in OAR eq. 2
    adv = r - r.mean(-1, keepdim=True)
    if scale_std:
        adv = adv / (std + 1e-6)
    return adv.clamp(-clip, clip).view(-1), std.squeeze(-1) < 1e-8


def grpo_loss(logp, old_logp, adv, gamma, mask, cfg, denom, ref_logp=None):
    """Eq. 5 with dual-clip, summed over this micro-batch and divided by the whole batch's `denom`.
    logp, old_logp, gamma, mask: (b, R); adv: (b,). Returns (loss, stats of summed counts)."""
    A = adv.unsqueeze(-1)                                                 # (b, 1)
    ratio = torch.exp(logp - old_logp)                                    # (b, R)
    obj = torch.min(ratio * A, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * A)
    obj = torch.where(A < 0, torch.max(obj, cfg.dual_clip * A), obj)      # dual-clip for A < 0
    per_tok = -gamma * obj                                                # (b, R) eq. 5-6: gamma on each term
    if cfg.beta > 0:                                                      # k3 estimator of KL(pi || ref)
        d = ref_logp - logp
        per_tok = per_tok + cfg.beta * (torch.exp(d) - d - 1)
    m = mask.float()
    if cfg.loss_agg == "seq-mean":                                        # 1/G sum_i 1/N_i sum_t
        loss = ((per_tok * m).sum(-1) / m.sum(-1).clamp_min(1)).sum() / denom
    else:                                                                 # token-mean: sum_it / sum_i N_i
        loss = (per_tok * m).sum() / denom
    with torch.no_grad():
        stats = {"clip/low": ((ratio < 1 - cfg.eps_low) & (A < 0) & mask).sum().item(),
                 "clip/high": ((ratio > 1 + cfg.eps_high) & (A > 0) & mask).sum().item(),
                 "clip/dual": ((ratio > cfg.dual_clip) & (A < 0) & mask).sum().item()}
    return loss, stats


def denominator(cfg, resp):
    """The loss divisor of the whole batch: B rows (seq-mean) or its response tokens (token-mean). B counts
    the rows of the update batch: with --dynamic-filter the rows kept, without it every row (A = 0 too)."""
    return resp.shape[0] if cfg.loss_agg == "seq-mean" else resp.sum().clamp_min(1).item()


def kept_rows(rewards, truncated, cfg):
    """(row indices for the update, {metric: count dropped}). --dynamic-filter (App. C.3, departure 6): groups
    with accuracy in [filter_low, filter_high], and in them the responses that ended before max_new_tokens."""
    if not cfg.dynamic_filter:
        return list(range(len(rewards))), {}
    acc = (rewards.view(-1, cfg.group_size) >= 1).float().mean(-1)        # (B/G,)
    ok = (acc >= cfg.filter_low) & (acc <= cfg.filter_high)
    rows = [j for j in range(len(rewards)) if ok[j // cfg.group_size] and not truncated[j]]
    return rows, {"groups/filtered": int((~ok).sum()), "rows/truncated_dropped": int(sum(truncated))}


# ----------------------------------------------------------------------------- setup and bookkeeping
def setup(cfg):
    """Everything before the first step, cheapest checks first: the run directory is checked and the data read
    before the model loads, so a bad --data-path fails in a second, not after loading 4B weights; the run
    directory is created (and locked) once the model has loaded, so a model that fails leaves nothing."""
    ckpt = ckpt_io.find_checkpoint(cfg.resume) if cfg.resume else None
    out = Path(cfg.out_dir)
    ckpt_io.check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite, claim=False)   # no mkdir
    records = data.load_task(cfg.dataset, split="train", path=cfg.data_path or None, seed=cfg.seed)
    style = cfg.prompt_style if cfg.prompt_style != "auto" else data.default_style(cfg.model,
                                                                                  records[0]["task"])
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = policy.device_of(cfg.device)                        # CUDA: expandable segments, before it starts
    model, tok, ref, opt = policy.load_policy(cfg, device, str(ckpt) if ckpt else None)   # departure 3
    ckpt_io.check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite)          # created, locked
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    start, bad = ckpt_io.load_checkpoint(ckpt, opt, sched) if ckpt else (0, 0)
    ckpt_io.check_disk(out, model, policy.scheme(cfg, device), start, cfg.steps, cfg.save_every,  # 2 ckpts
                       cfg.save_optimizer)
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    run = SimpleNamespace(cfg=cfg, model=model, tok=tok, ref=ref, opt=opt, sched=sched, device=device,
                          autocast=policy.autocast(device), order=order, records=records, style=style,
                          out=out, start=start, bad_steps=bad, clock=runlog.Clock(device),
                          metrics=ckpt_io.open_metrics(out, start if ckpt else None))
    print(f"GRPO: {cfg.model} on {cfg.dataset} ({style} prompts), credit={cfg.credit}/{cfg.shaping} "
          f"({'separate' if credit.separate_pass(cfg) else 'fused'} pass), "
          f"{cfg.prompts_per_step}x{cfg.group_size} rollouts/step, device={device}, out={out}")
    return run


def step_prompts(run, step):
    """(records, prompts, how many were skipped) of this step: a function of (seed, step) alone, so --resume
    lines up; prompts over --max-prompt-tokens are skipped and counted."""
    cfg, n = run.cfg, run.cfg.prompts_per_step
    recs = [run.records[run.order[(step * n + j) % len(run.records)]] for j in range(n)]
    prompts = [data.make_prompt(r, run.tok, run.style) for r in recs]
    keep = [len(run.tok(p).input_ids) <= cfg.max_prompt_tokens for p in prompts]
    if not all(keep):
        tqdm.write(f"step {step + 1}: {keep.count(False)} prompt(s) longer than --max-prompt-tokens "
                   f"{cfg.max_prompt_tokens} skipped")
    return [r for r, k in zip(recs, keep) if k], [p for p, k in zip(prompts, keep) if k], keep.count(False)


# ----------------------------------------------------------------------------- command line
def presets(model, paper_batch) -> list:
    """The PRESETS in force, by what the flags mean: the embedded model (named or not), a paper model (§4.1),
    --paper-batch; applied in this order, and the flags given win over them."""
    paper = any(k in str(model).lower() for k in PAPER_MODELS)
    return [k for k, on in zip(PRESETS, (models.is_embedded(model), paper, paper_batch)) if on]


def parse_args(argv=None) -> Config:
    argv = sys.argv[1:] if argv is None else list(argv)
    active = presets(flags.value_in(argv, "model", Config.model), flags.value_in(argv, "paper_batch", False))
    head = __doc__.split("\n\n")[0] + (f"\n\nPresets in force: {', '.join(active) or 'none'}; each default "
                                        f"below says what it sets, and the flags given win.")
    p = argparse.ArgumentParser(prog="grpo.py", usage="%(prog)s [--flag VALUE ...]", allow_abbrev=False,
                                description=head, epilog=__doc__[__doc__.index("Run:"):],
                                formatter_class=flags.Formatter)
    flags.add_fields(p, Config, CHOICES, suppress=True, presets=PRESETS, active=active)
    given = vars(p.parse_args(argv))                     # unknown flags are errors
    try:
        if given.get("resume"):                          # the saved run's config, then the flags given now
            saved = ckpt_io.saved_config(ckpt_io.find_checkpoint(given["resume"]))
            ckpt_io.check_resume_config(saved, given)    # another --model, --credit ...: refused
            cfg = Config(**{**{k: v for k, v in saved.items() if k in Config.__dataclass_fields__}, **given})
        else:                                            # the presets in force, then the flags given
            base = presets(given.get("model", Config.model), given.get("paper_batch", False))
            cfg = Config(**{k: v for name in base for k, v in PRESETS[name].items()} | given)
    except ValueError as e:
        p.error(str(e))
    problem = flags.check(cfg)
    if problem:
        p.error(problem)
    return cfg


CHOICES = {**credit.CHOICES, "dataset": data.TASKS, "prompt_style": ("auto", *data.STYLES),   # closed sets
           "device": ("auto", "cpu", "cuda"), "loss_agg": ("seq-mean", "token-mean"),
           "optimizer": ("auto", "kahan", "adamw")}
PAPER_MODELS = ("qwen3-4b", "qwen3-8b", "llama-3.1-8b", "llama-3.2-3b")   # §4.1, App. C.3


def main(argv=None):
    cfg = parse_args(argv)
    try:
        run = setup(cfg)
    except (ValueError, OSError, ImportError) as e:   # the user's files, model, checkpoint, out_dir
        print(f"grpo.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    out = train(cfg, run)
    if out.status:                                    # a non-finite streak (1), a full disk (2)
        print(f"grpo.py: {'error' if out.status == 2 else 'stopping'}: {out.stop}", file=sys.stderr)
        sys.exit(out.status)
    return out


if __name__ == "__main__":
    main()
