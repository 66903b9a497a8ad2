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

One forward per micro-batch (--credit-pass fused): it gives the log-probs, the entropy, and the middle
layers' attention captured on the way (flowtracer.capture); then flow -> gamma -> loss -> backward. On-policy
the old log-probs are the detached current ones. Signals with a forward of their own (fai, gradient,
correlation, OAR) and the batch-wide 80-20 rule run as a separate pass before the update.

Reading path: this file top to bottom (train's loop, then update and the GRPO math), then what the loop calls,
in order: training/rollout.py (generate, build_batch), data.py (score), training/credit.py (assign) and
training/signals.py, flowtracer.py (capture, trace_flow, flow_credit), training/policy.py (token_logprobs
under gradient checkpointing, optimizer_step). Setup and logging: training/checkpoint.py, training/runlog.py.

Departures from the paper (numbered):
 1. One device and HF `generate` instead of ROLL + vLLM + Megatron (App. C.1); gradient accumulation over
    micro-batches stands in for data parallelism: --paper-batch (PAPER_BATCH) is the paper's 64 prompts x 8.
 2. Per-token log-probs come from a chunked selective log-softmax, recomputed in backward: the (B, T, V)
    fp32 logits of the whole batch never exist.
 3. On CUDA (--optimizer auto = kahan) weights, gradients and AdamW states are bf16 with a bf16 Kahan
    compensation of each weight (torch-optimi), so lr 1e-6 updates are kept and Qwen3-4B's 1K step fits in
    ~48 GB (policy.py; `python eval.py memory`); the paper's Megatron keeps fp32 master weights. CPU: fp32.
 4. The paper's "value clip 0.5" (App. C.3) has no value network to act on in GRPO and is omitted.
 5. Running `python grpo.py` with no model named trains the embedded SmolLM2-135M-Instruct on the offline
    arithmetic task with a small batch and a larger lr (EMBEDDED below) so that it finishes on a CPU.
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
import dataclasses
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

import data
from training import checkpoint as ckpt_io
from training import credit, flags, policy, runlog, signals
from training.policy import old_logprobs, optimizer_step, ref_logprobs, token_logprobs
from training.rollout import build_batch, generate, take


@dataclass
class Config(credit.CreditConfig):   # inherits the credit knobs: --credit, --shaping, --top-frac, --gamma
    # model and task
    model: str = "smollm2-135m"        # hub name, local dir, .gguf file, or alias (models.py)
    dataset: str = "arithmetic"        # a data.py task name (dapo-math-17k for the paper's math runs)
    data_path: str = ""                # local JSONL/parquet of the dataset ("": offline copy, generator, hub)
    prompt_style: str = "auto"         # chat | plain | fewshot | fewshot3 | countdown; auto: by model, task
    max_prompt_tokens: int = 1024      # longer prompts are skipped with a warning and counted
    # rollout (App. C.3)
    prompts_per_step: int = 16         # paper: 64 prompts per step on 8 GPUs; 16 x 8 fit one 80 GB GPU
    paper_batch: bool = False          # the paper's 64 x 8 rows per step, accumulated (PAPER_BATCH)
    group_size: int = 8                # G samples per prompt (App. C.3)
    max_new_tokens: int = 1024         # response budget: 1K context (8K in the paper's long runs)
    temperature: float = 0.99          # App. C.3
    top_p: float = 1.0                 # App. C.3
    top_k: int = 100                   # App. C.3
    gen_chunk: int = 64                # rows per generate call (bounds the KV cache)
    share_prefix: bool = True          # read each prompt once: rollouts (rollout.py), update (policy.py)
    # reward and advantages
    scale_std: bool = True             # divide by the group std (eq. 10); off = Dr. GRPO style mean-centering
    adv_clip: float = 2.0              # advantage clip (App. C.3)
    dynamic_filter: bool = False       # App. C.3: groups with accuracy in [low, high], no cut-off responses
    filter_low: float = 0.1            # App. C.3
    filter_high: float = 0.95          # App. C.3
    # credit (inherited from training/credit.py's CreditConfig)
    # update
    lr: float = 1e-6                   # App. C.3
    optimizer: str = "auto"            # auto: kahan (bf16 + Kahan AdamW) on CUDA, adamw (fp32) on CPU
    warmup_steps: int = 20             # linear warmup (App. C.3)
    weight_decay: float = 0.0          # not given in the paper
    num_iterations: int = 1            # updates per batch; > 1 runs an old-log-prob pass first
    micro_batch: int = 8               # rows per forward/backward (gradient accumulation)
    eps_low: float = 0.2               # PPO clip 1 - eps_low (eq. 5)
    eps_high: float = 0.2              # clip-higher: 1 + eps_high (DAPO uses 0.28)
    dual_clip: float = 3.0             # dual-clip c for A < 0 (App. C.3)
    beta: float = 0.0                  # k3 KL weight; 0 = no reference model loaded (§4.1: no KL)
    loss_agg: str = "seq-mean"         # seq-mean: 1/G sum_i 1/N_i sum_t (eq. 5) | token-mean (DAPO)
    max_grad_norm: float = 1.0         # gradient clipping
    grad_checkpointing: bool = True    # recompute activations in backward
    logprob_chunk: int = 128           # positions per selective log-softmax chunk
    # run
    steps: int = 500                   # 4B models: 500 steps (App. C.3)
    device: str = "auto"               # auto | cpu | cuda
    out_dir: str = "runs/grpo"         # metrics.jsonl, rollouts/, ckpt/, curves.png
    overwrite: bool = False            # start afresh in an out_dir that holds a run (else: an error)
    save_every: int = 50               # checkpoint every N steps (and at the end, on Ctrl-C / SIGTERM)
    rollouts_every: int = 10           # save rollouts with per-token credit every N steps
    max_bad_steps: int = 3             # stop after this many consecutive NaN/inf steps
    resume: str = ""                   # a run directory (or its ckpt/) to continue from
    allow_config_change: bool = False  # let --resume change flags that change the run (--model, --lr, ...)


# Departure 5: the embedded default runs on a CPU in minutes. Applied when --model is not given;
# any flag given on the command line wins.
EMBEDDED = dict(prompts_per_step=2, group_size=4, max_new_tokens=128, steps=6, lr=1e-5, warmup_steps=2,
                micro_batch=4, gen_chunk=8, save_every=3, rollouts_every=2, max_prompt_tokens=768,
                grad_checkpointing=False, out_dir="runs/embedded")
PAPER = dict(dynamic_filter=True)   # departure 6: the paper's models get App. C.3's dynamic filter
PAPER_BATCH = dict(prompts_per_step=64, group_size=8, micro_batch=8, gen_chunk=64)   # departure 1; flags win


# ----------------------------------------------------------------------------- the loop
def train(cfg: Config, run=None) -> list:
    run = run or setup(cfg)           # data, model, optimizer, run directory, Ctrl-C / SIGTERM (below)
    model, tok, G = run.model, run.tok, cfg.group_size
    for step in tqdm(range(run.start, cfg.steps), desc="grpo", initial=run.start, total=cfg.steps):
        clock, m = runlog.Clock(run.device), {"step": step + 1}   # seconds per phase; CUDA: synchronized
        # ---------------------------------------------------------- rollout
        clock.phase("generation")
        recs, prompts = step_prompts(run, step, m)                    # drops prompts over max_prompt_tokens
        if not recs:
            runlog.bookkeep(run, step, m, skipped="every prompt is longer than --max-prompt-tokens")
            continue
        model.eval()
        with torch.no_grad(), run.autocast:
            gen = generate(model, tok, prompts, n=G, max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k,
                           temperature=cfg.temperature, top_p=cfg.top_p, chunk_size=cfg.gen_chunk,
                           share_prefix=cfg.share_prefix)
        # ---------------------------------------------------------- reward
        clock.phase("reward")
        rewards = torch.tensor([data.score(recs[j // G], txt) for j, txt in enumerate(gen.texts)])    # (B,)
        adv, zero_std = compute_advantages(rewards, G, cfg.scale_std, cfg.adv_clip)                  # (B,)
        rows = kept_rows(rewards, gen.truncated, cfg, m)                                             # filter
        if not rows:
            runlog.bookkeep(run, step, m, skipped="the dynamic filter dropped every group")
            continue
        batch = build_batch(tok, [gen.prompt_ids[j] for j in rows], [gen.response_ids[j] for j in rows])
        batch = batch.to(run.device)
        adv, B = adv[rows].to(run.device), len(rows)
        resp = batch.response_mask[:, batch.prompt_width:]                                           # (B, R)
        trained = (adv != 0).nonzero().flatten().tolist() if cfg.beta == 0 else list(range(B))  # departure 7
        gamma, scores = resp.float(), torch.zeros(resp.shape, device=run.device)                    # (B, R)
        fallback = 0                                                  # rows whose credit fell back to 1
        # ---------------------------------------------------------- credit (a separate pass, if needed)
        clock.phase("credit")
        if credit.separate_pass(cfg) and trained:
            with torch.no_grad(), run.autocast:
                c = credit.assign(model, tok, take(batch, trained), adv[trained], cfg)                # (b, R)
            gamma[trained], scores[trained] = c.gamma, c.scores
            fallback = int(c.fallback.sum())
        # ---------------------------------------------------------- update (fused credit inside, eq. 1-6)
        stats = update(run, batch, trained, adv, gamma, scores, clock.phase, fallback)
        if run.bad == 0:
            run.sched.step()
        clock.phase(None)
        # ---------------------------------------------------------- log
        m.update(runlog.step_metrics(run, rewards, zero_std, gen, resp, adv, gamma, stats, clock.seconds))
        runlog.bookkeep(run, step, m, (batch, gen, rows, rewards, adv, scores, gamma))
        if run.stop:
            break
    return runlog.finish(run)


# ----------------------------------------------------------------------------- policy math
def update(run, batch, trained, adv, gamma, scores, phase=lambda name: None, fallback=0):
    """The update phase: micro-batches of the trained rows, each one forward (the fused credit reads its
    attention: flow -> gamma, eq. 1-6), the loss (eq. 5), backward; then the optimizer step. gamma, scores
    (B, R) are filled in place by the fused credit. `phase(name)` marks where each part begins (grpo.train's
    clock; evaluation/memtrace.measure's memory tracker): what grpo.py runs is what is measured. Returns
    the step's stats: loss, clip counts, entropies, credit fallbacks (+ `fallback`, of a separate pass)."""
    stats = {"loss": 0.0, "clip/low": 0, "clip/high": 0, "clip/dual": 0, "entropy": [],
             "credit/fallback": fallback}
    cfg, model, P = run.cfg, run.model, batch.prompt_width
    resp = batch.response_mask[:, P:]                                                            # (B, R)
    phase("update forward")
    old_logp = old_logprobs(run, batch, trained)        # (B, R); None on-policy: logp.detach() below
    model.train()
    for it in range(cfg.num_iterations):
        run.opt.zero_grad(set_to_none=True)
        for s in range(0, len(trained), cfg.micro_batch):
            mb = trained[s:s + cfg.micro_batch]
            sub = take(batch, mb)
            phase("update forward")
            with run.autocast, credit.capturing(model, cfg, sub, it == 0) as cap:    # the forward
                logp, ent = token_logprobs(model, sub.input_ids, sub.attention_mask, P, cfg.logprob_chunk,
                                           cfg.share_prefix)
            if it == 0 and not credit.separate_pass(cfg):                      # fused: flow -> gamma, eq. 1-6
                phase("credit")
                with torch.no_grad():
                    c = credit.assign(model, run.tok, sub, adv[mb], cfg, signals.Captured(cap.attn, ent))
                gamma[mb], scores[mb] = c.gamma, c.scores
                stats["credit/fallback"] += int(c.fallback.sum())
                del c
            phase("backward")
            old = logp.detach() if old_logp is None else old_logp[mb]                  # on-policy: ratio = 1
            loss, st = grpo_loss(logp, old, adv[mb], gamma[mb], resp[mb], cfg, denominator(cfg, resp),
                                 ref_logprobs(run, sub))                      # eq. 5
            loss.backward()
            stats["loss"] += loss.item()
            stats["entropy"].append(ent[resp[mb]])
            stats.update({k: stats[k] + v for k, v in st.items()})
            del cap, logp, ent, loss, old                     # the next micro-batch's forward starts empty
        phase("optimizer step")
        if not optimizer_step(run, stats):                 # clip; a non-finite step is skipped
            break
    phase(None)
    return stats


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


def kept_rows(rewards, truncated, cfg, m):
    """Row indices for the update. --dynamic-filter (App. C.3, departure 6): groups with accuracy in
    [filter_low, filter_high], and within them the responses that ended before max_new_tokens."""
    if not cfg.dynamic_filter:
        return list(range(len(rewards)))
    acc = (rewards.view(-1, cfg.group_size) >= 1).float().mean(-1)        # (B/G,)
    ok = (acc >= cfg.filter_low) & (acc <= cfg.filter_high)
    m["groups/filtered"], m["rows/truncated_dropped"] = int((~ok).sum()), int(sum(truncated))
    return [j for j in range(len(rewards)) if ok[j // cfg.group_size] and not truncated[j]]


# ----------------------------------------------------------------------------- setup and bookkeeping
def setup(cfg):
    """Everything before the first step, cheapest checks first: the run directory and the data are read
    before the model loads, so a bad --data-path fails in a second, not after loading 4B weights."""
    ckpt = ckpt_io.find_checkpoint(cfg.resume) if cfg.resume else None
    out = Path(cfg.out_dir)
    ckpt_io.check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite)
    records = data.load_task(cfg.dataset, split="train", path=cfg.data_path or None, seed=cfg.seed)
    style = cfg.prompt_style if cfg.prompt_style != "auto" else data.default_style(cfg.model,
                                                                                  records[0]["task"])
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = policy.device_of(cfg.device)                        # CUDA: expandable segments, before it starts
    model, tok, ref, opt = policy.load_policy(cfg, device, str(ckpt) if ckpt else None)   # departure 3
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    start, bad = ckpt_io.load_checkpoint(ckpt, opt, sched) if ckpt else (0, 0)
    ckpt_io.check_disk(out, model, policy.scheme(cfg, device), start, cfg.steps, cfg.save_every)   # 2 ckpts
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    run = SimpleNamespace(cfg=cfg, model=model, tok=tok, ref=ref, opt=opt, sched=sched, device=device,
                          autocast=policy.autocast(device), order=order, records=records, style=style,
                          out=out, start=start, bad=bad, stop=False, history=[],
                          metrics=ckpt_io.open_metrics(out, start if ckpt else None))
    runlog.stop_on_signals(run)      # first Ctrl-C / SIGTERM: finish this step, save, exit; a second: now
    print(f"GRPO: {cfg.model} on {cfg.dataset} ({style} prompts), credit={cfg.credit}/{cfg.shaping} "
          f"({'separate' if credit.separate_pass(cfg) else 'fused'} pass), "
          f"{cfg.prompts_per_step}x{cfg.group_size} rollouts/step, device={device}, out={out}")
    return run


def step_prompts(run, step, m):
    """This step's records and prompts: a function of (seed, step) alone, so --resume lines up; prompts over
    --max-prompt-tokens are skipped and counted."""
    cfg, n = run.cfg, run.cfg.prompts_per_step
    recs = [run.records[run.order[(step * n + j) % len(run.records)]] for j in range(n)]
    prompts = [data.make_prompt(r, run.tok, run.style) for r in recs]
    keep = [len(run.tok(p).input_ids) <= cfg.max_prompt_tokens for p in prompts]
    m["prompts/skipped_long"] = keep.count(False)
    if not all(keep):
        tqdm.write(f"step {step + 1}: {keep.count(False)} prompt(s) longer than --max-prompt-tokens "
                   f"{cfg.max_prompt_tokens} skipped")
    return [r for r, k in zip(recs, keep) if k], [p for p, k in zip(prompts, keep) if k]


# ----------------------------------------------------------------------------- command line
def check(cfg):
    """The first bad flag as one sentence naming it, or None. Runs before anything loads (argparse's
    choices have checked the closed sets: --dataset, --prompt-style, --device, --optimizer, --credit, ...)."""
    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
    rules = [("--group-size", cfg.group_size >= 2, "must be >= 2: a group of one has no advantage (eq. 10)"),
             *[(f"--{k.replace('_', '-')}", getattr(cfg, k) >= 1, "must be >= 1")
               for k in ("prompts_per_step", "max_new_tokens", "gen_chunk", "micro_batch", "num_iterations",
                         "steps", "save_every", "rollouts_every", "max_bad_steps", "logprob_chunk",
                         "max_prompt_tokens", "top_k")],
             *[(f"--{k.replace('_', '-')}", finite(getattr(cfg, k)), "must be a finite number")
               for k in ("temperature", "top_p", "adv_clip", "lr", "eps_low", "eps_high", "dual_clip", "beta",
                         "max_grad_norm", "weight_decay", "filter_low", "filter_high")],
             ("--weight-decay", cfg.weight_decay >= 0, "must be >= 0"),
             *[(f"--{f.name.replace('_', '-')}", abs(getattr(cfg, f.name)) < 2 ** 63, "must fit in int64")
               for f in dataclasses.fields(cfg) if f.type in (int, "int")],             # torch's integers
             ("--temperature", cfg.temperature > 0, "must be > 0"),
             ("--top-p", 0 < cfg.top_p <= 1, "must be in (0, 1]"),
             ("--adv-clip", cfg.adv_clip > 0, "must be > 0"), ("--lr", cfg.lr > 0, "must be > 0"),
             ("--eps-low", 0 <= cfg.eps_low < 1, "must be in [0, 1)"),
             ("--eps-high", cfg.eps_high >= 0, "must be >= 0"),
             ("--dual-clip", cfg.dual_clip > 1, "must be > 1"), ("--beta", cfg.beta >= 0, "must be >= 0"),
             ("--max-grad-norm", cfg.max_grad_norm > 0, "must be > 0"),
             ("--warmup-steps", cfg.warmup_steps >= 0, "must be >= 0"),
             ("--filter-low", 0 <= cfg.filter_low <= cfg.filter_high <= 1, "needs 0 <= low <= high <= 1"),
             ("--prompt-style", data.style_fits(cfg.prompt_style, cfg.dataset.lower()),
              f"{cfg.prompt_style} does not fit --dataset {cfg.dataset} (data.style_fits)"),
             ("--device", cfg.device != "cuda" or torch.cuda.is_available(), "cuda: no GPU is visible")]
    for flag, ok, why in rules:
        if not ok:
            return f"{flag} {why}"
    return credit.check(cfg)


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(prog="grpo.py", usage="%(prog)s [--flag VALUE ...]", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0], epilog=__doc__[__doc__.index("Run:"):],
                                formatter_class=flags.Formatter)
    flags.add_fields(p, Config, CHOICES, suppress=True,
                     presets={"no --model": EMBEDDED, "paper models": PAPER, "--paper-batch": PAPER_BATCH})
    given = vars(p.parse_args(argv))                     # unknown flags are errors
    try:
        if given.get("resume"):                          # the saved run's config, then the flags given now
            saved = ckpt_io.saved_config(ckpt_io.find_checkpoint(given["resume"]))
            ckpt_io.check_resume_config(saved, given)    # another --model, --credit ...: refused
            cfg = Config(**{**{k: v for k, v in saved.items() if k in Config.__dataclass_fields__}, **given})
        else:
            name = str(given.get("model", Config.model)).lower()
            base = EMBEDDED if name == Config.model else PAPER if any(k in name for k in PAPER_MODELS) else {}
            cfg = Config(**{**base, **(PAPER_BATCH if given.get("paper_batch") else {}), **given})
    except ValueError as e:
        p.error(str(e))
    problem = check(cfg)
    if problem:
        p.error(problem)
    return cfg


CHOICES = {**credit.CHOICES, "dataset": data.TASKS, "prompt_style": ("auto", *data.STYLES),   # closed sets
           "device": ("auto", "cpu", "cuda"), "loss_agg": ("seq-mean", "token-mean"),
           "optimizer": ("auto", "kahan", "adamw")}
PAPER_MODELS = ("qwen3-4b", "qwen3-8b", "llama-3.1-8b", "llama-3.2-3b")   # §4.1, App. C.3


def main(argv=None):
    cfg, run = parse_args(argv), None
    try:
        run = setup(cfg)
        return train(cfg, run)
    except (ValueError, OSError, ImportError) as e:   # setup: the user's files, model, checkpoint, out_dir;
        if run is not None and not isinstance(e, ckpt_io.RunError):   # train: a full disk (RunError)
            raise
        print(f"grpo.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
