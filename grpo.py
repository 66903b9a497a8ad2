"""GRPO with FlowTracer token credit, on one device: rollout -> reward -> credit -> update -> log.

Implements the training loop of the paper (flowtracer.txt §3.3, eq. 5-6, App. A.2 eq. 10-11, App. C):
  rollout   G samples per prompt, T = 0.99, top-p 1.0, top-k 100 (App. C.3), left-padded, in chunks
  reward    a verifier from data.py; group advantages A_i = (r_i - mean) / std (eq. 10), clipped to +-2
  credit    a signal (batch -> scores (B, T)) and a shaping rule (scores -> gamma (B, T)) from credit.py;
            the default is FlowTracer: top 40% response tokens by flow throughput get gamma = 1.5 (eq. 6)
  update    PPO clipped surrogate with gamma_{i,t} on every token term, for both signs of A (eq. 5):
              J = 1/G sum_i 1/N_i sum_t gamma_it * min(ratio_it A_i, clip(ratio_it, 1-eps_lo, 1+eps_hi) A_i)
            plus dual-clip (c = 3) for A < 0 and an optional k3 KL term (beta = 0 by default: no reference model)
  log       one JSONL line of metrics per step, rollouts with their per-token credit, a PNG of the curves

Departures from the paper (numbered):
 1. One device and HF `generate` instead of ROLL + vLLM + Megatron (App. C.1); gradient accumulation over
    micro-batches stands in for data parallelism. The paper's global batch (64 prompts x 8) is a flag.
 2. Per-token log-probs come from a chunked selective log-softmax, recomputed in backward: the (B, T, V)
    fp32 logits of the whole batch never exist.
 3. On CUDA the weights stay fp32 (master copy; lr 1e-6 steps vanish in bf16) and the forward runs under bf16
    autocast. On the CPU everything is fp32.
 4. The paper's "value clip 0.5" (App. C.3) has no value network to act on in GRPO and is omitted.
 5. Running `python grpo.py` with no model named trains the embedded SmolLM2-135M-Instruct on the offline
    arithmetic task with a small batch and a larger lr (EMBEDDED below) so that it finishes on a CPU.

Run:  python grpo.py                                                    # embedded default, CPU, < 10 min
      python grpo.py --model Qwen/Qwen3-4B-Base --dataset dapo-math-17k # the paper's setting, one 80 GB GPU
      python grpo.py --resume runs/grpo                                 # continue exactly where it stopped
"""
import argparse
import dataclasses
import json
import math
import random
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import credit
import data
from checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from flowtracer import build_regions
from models import generate, load_model


@dataclass
class Config:
    # model and task
    model: str = "smollm2-135m"        # hub name, local dir, .gguf file, or alias (models.py)
    dataset: str = "arithmetic"        # a data.py task name (dapo-math-17k for the paper's math runs)
    data_path: str = ""                # local JSONL/parquet for the dataset ("" = offline copy / generator / hub)
    prompt_style: str = "auto"         # chat | plain | fewshot | countdown; auto picks by model and task
    max_prompt_tokens: int = 1024      # longer prompts are skipped with a warning and counted
    # rollout (App. C.3)
    prompts_per_step: int = 16         # paper: 64 prompts per step on 8 GPUs; 16 x 8 rollouts fit one 80 GB GPU
    group_size: int = 8                # G samples per prompt (App. C.3)
    max_new_tokens: int = 1024         # response budget: 1K context (8K in the paper's long runs)
    temperature: float = 0.99          # App. C.3
    top_p: float = 1.0                 # App. C.3
    top_k: int = 100                   # App. C.3
    gen_chunk: int = 64                # rows per generate call (bounds the KV cache)
    # reward and advantages
    scale_std: bool = True             # divide by the group std (eq. 10); off = Dr. GRPO style mean-centering
    adv_clip: float = 2.0              # advantage clip (App. C.3)
    dynamic_filter: bool = False       # drop groups whose accuracy is outside [filter_low, filter_high] (App. C.3)
    filter_low: float = 0.1            # App. C.3
    filter_high: float = 0.95          # App. C.3
    # credit (credit.py)
    credit: str = "flow"               # signal: none | flow | random | ... (credit.SIGNALS)
    shaping: str = "topk"              # rule: topk | bottomk | ... (credit.SHAPINGS)
    top_frac: float = 0.4              # fraction of response tokens boosted (eq. 6, Table 5)
    gamma: float = 1.5                 # gamma_flow (eq. 6, Table 7)
    layers: str = "middle"             # attention layers for the graph: early|middle|late|all|A:B (Fig. 6)
    token_class: str = ""              # "" | structural | semantic: select only within one class (Table 11b)
    soft_mass: float = 0.4             # --shaping soft: cumulative score mass to cover (Table 7)
    entropy_frac: float = 0.2          # --shaping 80-20: top fraction by entropy over the batch (Wang et al.)
    entropy_alpha: float = 0.4         # --shaping entropy-adv: bonus min(alpha H, |A|/kappa) (OAR eq. 6)
    entropy_kappa: float = 2.0         # --shaping entropy-adv (OAR eq. 6)
    attn_window: str = "10:100"        # --credit attention: FAI reads queries t with s+10 <= t <= s+100
    attn_global_frac: float = 0.3      # --credit attention: top 30% heads by mean attention distance
    oar_outcome: str = "lt-logits"     # OAR outcome distribution: lt-logits | as-mean (OAR §6.2)
    oar_sigma: float = 1e-3            # OAR-G embedding noise (OAR §3.2)
    oar_chunk: int = 64                # OAR-P masked copies per forward pass
    oar_prefix_cache: bool = True      # OAR-P/G: reuse the cached keys/values of the unchanged prefix
    bilevel_tau: float = 0.4           # --shaping bilevel: percentile threshold (OAR §4.1)
    bilevel_beta: float = 2.0          # --shaping bilevel: boost coefficient (OAR §4.1)
    # update
    lr: float = 1e-6                   # App. C.3
    warmup_steps: int = 20             # linear warmup (App. C.3)
    weight_decay: float = 0.0          # not given in the paper
    num_iterations: int = 1            # updates per batch (old log-probs come from the pre-update policy)
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
    seed: int = 0                      # python / torch seeds and the data order
    device: str = "auto"               # auto | cpu | cuda
    out_dir: str = "runs/grpo"         # metrics.jsonl, rollouts/, ckpt/, curves.png
    save_every: int = 50               # checkpoint every N steps (and at the end, and on Ctrl-C)
    rollouts_every: int = 10           # save rollouts with per-token credit every N steps
    max_bad_steps: int = 3             # stop after this many consecutive NaN/inf steps
    resume: str = ""                   # a run directory (or its ckpt/) to continue from


# Departure 5: the embedded default runs on a CPU in minutes. Applied when --model is not given;
# any flag given on the command line wins.
EMBEDDED = dict(prompts_per_step=2, group_size=4, max_new_tokens=128, steps=6, lr=1e-5, warmup_steps=2,
                micro_batch=4, gen_chunk=8, save_every=3, rollouts_every=2, max_prompt_tokens=768,
                grad_checkpointing=False, out_dir="runs/embedded")


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description="GRPO with FlowTracer credit", allow_abbrev=False)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        else:
            p.add_argument(flag, type=type(f.default), default=argparse.SUPPRESS)
    given = vars(p.parse_args(argv))                     # unknown flags are errors
    if given.get("resume"):                              # the saved run's config, then the flags given now
        return Config(**{**torch.load(find_checkpoint(given["resume"]) / "trainer_state.pt",
                                      weights_only=False)["config"], **given})
    base = EMBEDDED if given.get("model", Config.model) == Config.model else {}
    return Config(**{**base, **given})


# ----------------------------------------------------------------------------- policy math
def token_logprobs(model, input_ids, attention_mask, prompt_width, chunk=128, with_entropy=False):
    """log pi(y_t | x, y_<t) for the response columns P..T-1: (B, T-P). Optionally the entropy too.

    Hidden states come from the decoder; the LM head and log-softmax run on `chunk` positions at a time and
    are recomputed in backward (departure 2), so at most (B, chunk, V) logits exist at once.
    """
    pos = (attention_mask.cumsum(-1) - 1).clamp_min(0)                    # (B, T) as HF generate numbers them
    hid = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                              use_cache=False).last_hidden_state          # (B, T, D)
    head = model.get_output_embeddings()
    hid, tgt = hid[:, prompt_width - 1:-1], input_ids[:, prompt_width:]   # (B, R, D), (B, R): h_{t-1} -> y_t

    def piece(h, y):
        logp = F.log_softmax(head(h).float(), dim=-1)                     # (B, c, V) fp32
        lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)                 # (B, c)
        ent = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros_like(lp)
        return lp, ent

    outs = [checkpoint(piece, hid[:, s:s + chunk], tgt[:, s:s + chunk], use_reentrant=False)
            if torch.is_grad_enabled() else piece(hid[:, s:s + chunk], tgt[:, s:s + chunk])
            for s in range(0, tgt.shape[1], chunk)]
    lp, ent = (torch.cat(x, dim=1) for x in zip(*outs))                   # (B, R)
    return (lp, ent) if with_entropy else lp


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
    per_tok = -gamma * obj                                                # (b, R) eq. 5-6: gamma on every term
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


def credit_stats(w, adv, resp):
    """OAR App. A.3 on the response tokens: mean ESS ratio of the weights, and the top-10% mass of |A_t|."""
    ess, mass = [], []
    for b in range(w.shape[0]):
        wt, n = w[b][resp[b]].double(), int(resp[b].sum())
        if n == 0:
            continue
        ess.append((wt.sum() ** 2 / (n * (wt ** 2).sum())).item())
        At = (wt * adv[b].abs()).sort(descending=True).values
        if At.sum() > 0:
            mass.append((At[:max(1, n // 10)].sum() / At.sum()).item())
    mean = lambda x: sum(x) / len(x) if x else float("nan")  # noqa: E731
    return {"credit/ess_ratio": mean(ess), "credit/top10_adv_mass": mean(mass)}


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # Linux: KiB -> GiB (process peak RSS)


# ----------------------------------------------------------------------------- the loop
def train(cfg: Config) -> list:
    ckpt = find_checkpoint(cfg.resume) if cfg.resume else None
    if cfg.credit not in credit.SIGNALS or cfg.shaping not in credit.SHAPINGS:
        raise ValueError(f"--credit must be one of {sorted(credit.SIGNALS)}; --shaping one of {sorted(credit.SHAPINGS)}")
    if cfg.shaping == "entropy-adv" and cfg.credit != "entropy":
        raise ValueError("--shaping entropy-adv adds an entropy bonus to the advantage: use it with --credit entropy")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(cfg.out_dir)
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    model, tok = load_model(str(ckpt) if ckpt else cfg.model, device=device, dtype=torch.float32)
    ref = load_model(cfg.model, device=device, dtype=torch.float32)[0].eval() if cfg.beta > 0 else None
    if cfg.grad_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    start, bad = load_checkpoint(ckpt, opt, sched) if ckpt else (0, 0)
    records = data.load_task(cfg.dataset, split="train", path=cfg.data_path or None, seed=cfg.seed)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    style = cfg.prompt_style if cfg.prompt_style != "auto" else data.default_style(cfg.model, records[0]["task"])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    stop = {"now": False}

    def on_ctrl_c(*_):  # first Ctrl-C: finish this step, save, exit; a second one interrupts at once
        stop["now"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_ctrl_c)
    metrics_file = open(out / "metrics.jsonl", "a" if ckpt else "w")
    history = []
    print(f"GRPO: {cfg.model} on {cfg.dataset} ({style} prompts), credit={cfg.credit}/{cfg.shaping}, "
          f"{cfg.prompts_per_step}x{cfg.group_size} rollouts/step, device={device}, out={out}")

    for step in tqdm(range(start, cfg.steps), desc="grpo", initial=start, total=cfg.steps):
        t0, m = time.perf_counter(), {"step": step + 1}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # ---------------------------------------------------------- rollout
        batch_recs = [records[order[(step * cfg.prompts_per_step + j) % len(records)]] for j in range(cfg.prompts_per_step)]
        prompts = [data.make_prompt(r, tok, style) for r in batch_recs]
        keep = [len(tok(p).input_ids) <= cfg.max_prompt_tokens for p in prompts]
        m["prompts/skipped_long"] = keep.count(False)
        if not all(keep):
            tqdm.write(f"step {step + 1}: {keep.count(False)} prompt(s) longer than --max-prompt-tokens {cfg.max_prompt_tokens} skipped")
        if not any(keep):
            continue
        batch_recs, prompts = [r for r, k in zip(batch_recs, keep) if k], [p for p, k in zip(prompts, keep) if k]
        model.eval()
        with torch.no_grad(), autocast:
            gen = generate(model, tok, prompts, n=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, chunk_size=cfg.gen_chunk)
        t1 = time.perf_counter()
        # ---------------------------------------------------------- reward
        G = cfg.group_size
        rewards = torch.tensor([data.score(batch_recs[j // G], txt) for j, txt in enumerate(gen.texts)])  # (B,)
        adv, zero_std = compute_advantages(rewards, G, cfg.scale_std, cfg.adv_clip)                     # (B,)
        rows = list(range(len(gen.texts)))
        if cfg.dynamic_filter:
            acc = (rewards.view(-1, G) >= 1).float().mean(-1)
            rows = [j for j in rows if cfg.filter_low <= acc[j // G] <= cfg.filter_high]
            m["groups/filtered"] = int(((acc < cfg.filter_low) | (acc > cfg.filter_high)).sum())
            if not rows:
                tqdm.write(f"step {step + 1}: the dynamic filter dropped every group; no update")
                continue
        batch = build_regions(tok, [gen.prompt_ids[j] for j in rows], [gen.response_ids[j] for j in rows])
        batch = type(batch)(*(x.to(device) if torch.is_tensor(x) else x for x in batch))
        adv = adv[rows].to(device)
        t2 = time.perf_counter()
        # ---------------------------------------------------------- credit
        with torch.no_grad(), autocast:
            scores = credit.SIGNALS[cfg.credit](model, batch, cfg)                                    # (B, T)
            only = credit.token_class_mask(tok, batch.input_ids, cfg.token_class) if cfg.token_class else None
            w, fallback = credit.SHAPINGS[cfg.shaping](scores, batch, cfg, only)                        # (B, T)
        P = batch.prompt_width
        gamma, resp = w[:, P:].float(), batch.response_mask[:, P:]                                     # (B, R)
        if cfg.shaping == "entropy-adv":   # Cheng et al.: additive bonus; gamma_t = A_t / A (scores = entropy)
            A_t = credit.entropy_bonus(adv, scores, batch.response_mask & ~fallback[:, None],
                                       cfg.entropy_alpha, cfg.entropy_kappa)[:, P:]                    # (B, R)
            gamma = torch.where(adv[:, None] != 0, A_t / adv[:, None], gamma)                          # (B, R)
        t3 = time.perf_counter()
        # ---------------------------------------------------------- update
        with torch.no_grad(), autocast:
            old_logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, P, cfg.logprob_chunk, True)
            ref_logp = token_logprobs(ref, batch.input_ids, batch.attention_mask, P, cfg.logprob_chunk) if ref else None
        B = len(rows)
        denom = B if cfg.loss_agg == "seq-mean" else resp.sum().clamp_min(1).item()
        # With beta = 0 a row with A = 0 adds exactly 0 to the loss and its gradient: skip its forward/backward.
        live = (adv != 0).nonzero().squeeze(-1).tolist() if cfg.beta == 0 else list(range(B))
        model.train()
        clip = {"clip/low": 0, "clip/high": 0, "clip/dual": 0}
        for _ in range(cfg.num_iterations):
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for s in range(0, len(live), cfg.micro_batch):
                mb = live[s:s + cfg.micro_batch]
                with autocast:
                    logp = token_logprobs(model, batch.input_ids[mb], batch.attention_mask[mb], P, cfg.logprob_chunk)
                loss, st = grpo_loss(logp, old_logp[mb], adv[mb], gamma[mb], resp[mb], cfg, denom,
                                     ref_logp[mb] if ref_logp is not None else None)
                loss.backward()
                loss_sum += loss.item()
                clip = {k: clip[k] + st[k] for k in clip}
            for p in model.parameters():                     # AdamW still steps on a zero gradient, as GRPO would
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item()
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                bad += 1
                opt.zero_grad(set_to_none=True)
                tqdm.write(f"step {step + 1}: non-finite loss {loss_sum} / grad norm {grad_norm}: update skipped ({bad} in a row)")
                break
            bad = 0
            opt.step()
        if bad == 0:
            sched.step()
        t4 = time.perf_counter()
        # ---------------------------------------------------------- log
        n_tok = resp.sum().clamp_min(1).item() * cfg.num_iterations
        lens = resp.sum(-1).float()
        m.update({"reward/mean": rewards.mean().item(), "reward/std": rewards.std(unbiased=False).item(),
                  "acc": (rewards >= 1).float().mean().item(), "frac_zero_std": zero_std.float().mean().item(),
                  "len/mean": lens.mean().item(), "len/truncated_frac": sum(gen.truncated) / len(gen.truncated),
                  "entropy": (ent[resp].mean().item() if resp.any() else 0.0), "loss": loss_sum,
                  "grad_norm": grad_norm, "lr": sched.get_last_lr()[0], "bad_steps": bad,
                  **{k: v / n_tok for k, v in clip.items()},
                  "credit/boosted_frac": ((gamma != 1) & resp).sum().item() / resp.sum().clamp_min(1).item(),
                  "credit/fallback": int(fallback.sum()), **credit_stats(gamma, adv, resp),
                  "time/generate": t1 - t0, "time/reward": t2 - t1, "time/credit": t3 - t2,
                  "time/update": t4 - t3, "time/step": time.perf_counter() - t0, "mem/peak_gb": peak_memory_gb(device)})
        metrics_file.write(json.dumps(m) + "\n")
        metrics_file.flush()
        history.append(m)
        tqdm.write(f"step {m['step']}: reward {m['reward/mean']:.3f} acc {m['acc']:.2f} len {m['len/mean']:.0f} "
                   f"boosted {m['credit/boosted_frac']:.2f} fallback {m['credit/fallback']} {m['time/step']:.1f}s")
        if (step + 1) % cfg.rollouts_every == 0:
            save_rollouts(out / "rollouts" / f"step_{step + 1:05d}.jsonl", tok, batch, gen, rows, rewards, adv, scores, gamma)
        last = step + 1 == cfg.steps
        if bad >= cfg.max_bad_steps:
            save_checkpoint(out / "ckpt", model, tok, opt, sched, step + 1, cfg, bad)
            sys.exit(f"stopping: {bad} consecutive steps with a non-finite loss or gradient (lower --lr?)")
        if (step + 1) % cfg.save_every == 0 or last or stop["now"]:
            save_checkpoint(out / "ckpt", model, tok, opt, sched, step + 1, cfg, bad)
        if stop["now"]:
            print(f"interrupted: checkpoint saved after step {step + 1}; continue with --resume {out}")
            break
    metrics_file.close()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    plot_curves(out / "metrics.jsonl", out / "curves.png")
    print(f"metrics: {out / 'metrics.jsonl'}\nplots:   {out / 'curves.png'}\nrollouts: {out / 'rollouts'}\ncheckpoint: {out / 'ckpt'}")
    return history


def save_rollouts(path, tok, batch, gen, rows, rewards, adv, scores, gamma):
    """One JSON line per rollout: text, reward, advantage, and per response token its text, score and gamma."""
    P = batch.prompt_width
    with open(path, "w") as fh:
        for b, j in enumerate(rows):
            n = int(batch.response_mask[b].sum())
            ids = batch.input_ids[b, P:P + n].tolist()
            fh.write(json.dumps({"prompt": tok.decode(gen.prompt_ids[j]), "response": gen.texts[j],
                                 "reward": rewards[j].item(), "adv": adv[b].item(),
                                 "tokens": [tok.decode([t]) for t in ids],
                                 "answer": batch.answer_mask[b, P:P + n].tolist(),
                                 "score": scores[b, P:P + n].float().tolist(), "gamma": gamma[b, :n].tolist()}) + "\n")


def plot_curves(metrics_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    if not rows:
        return
    keys = ["reward/mean", "acc", "entropy", "len/mean"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
    for ax, k in zip(axes, keys):
        ax.plot([r["step"] for r in rows], [r[k] for r in rows], marker="o")
        ax.set_title(k)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    train(parse_args())
