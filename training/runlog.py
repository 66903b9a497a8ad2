"""The log phase of grpo.py: what one GRPO step reports and keeps.

  step_metrics   one JSONL line of metrics per step (checkpoint.write_metrics appends it to metrics.jsonl)
  Clock          seconds per phase of a step, synchronized on CUDA (time/*)
  credit_stats   OAR App. A.3's diagnostics of the credit: ESS ratio of gamma, top-10% mass of |A_t|
  save_rollouts  every rollout with its per-token text, answer mask, score and gamma (rollouts/step_N.jsonl)
  plot_curves    reward, accuracy, entropy and length against the step (curves.png)
  metric_series  [step, value] of one metric from metrics.jsonl (learn.py's training curves)
  peak_ema       the paper's peak-tracking EMA of a curve (App. C.3, "Plot Settings"; eval.py departure 1)
  end_step       the end of every grpo.py step: the metrics line, rollouts, the checkpoint when due
  Interrupt      Ctrl-C / SIGTERM as a value the loop reads: finish the step, save, stop
  finish         the end of a run: metrics closed, the out-dir released, curves.png

Metric names (one name, one meaning): reward/*, acc (reward >= 1), frac_zero_std (groups whose rewards do
not vary), len/* (response tokens), entropy (mean policy entropy over the trained response tokens),
loss, grad_norm, clip/* (fraction of trained tokens clipped), credit/* (gamma statistics over the trained
rows), time/* (seconds per phase), mem/peak_gb.

Run: python -c "from training import runlog as r; r.plot_curves('runs/embedded/metrics.jsonl', 'curves.png',
                'smollm2-135m', 'arithmetic', 'flow/topk')"
"""
import json
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from training import checkpoint as ckpt_io


def step_metrics(run, rewards, zero_std, gen, batch, adv, up, sec, bad):
    """One step's metrics; up: grpo.Update; sec: Clock.seconds; bad: the non-finite streak. time/credit = the
    separate pass + the fused flow/shaping (the capture itself runs inside the update's forward and is
    counted in time/update)."""
    resp, gamma, stats = batch.response_mask[:, batch.prompt_width:], up.gamma, up.stats          # (B, R)
    trained = (adv != 0) if run.cfg.beta == 0 else torch.ones_like(adv, dtype=torch.bool)   # (B,)
    n_tok = resp.sum().clamp_min(1).item() * run.cfg.num_iterations
    ent = torch.cat(stats["entropy"]) if stats["entropy"] else torch.zeros(0)
    on = resp & trained[:, None]                                                             # (B, R)
    return {"reward/mean": rewards.mean().item(), "reward/std": rewards.std(unbiased=False).item(),
            "acc": (rewards >= 1).float().mean().item(), "frac_zero_std": zero_std.float().mean().item(),
            "len/mean": resp.sum(-1).float().mean().item(),
            "len/truncated_frac": sum(gen.truncated) / len(gen.truncated),
            "gen/tokens": sum(map(len, gen.response_ids)),
            "entropy": ent.float().mean().item() if ent.numel() else None, "loss": stats["loss"],
            "grad_norm": stats.get("grad_norm", 0.0), "lr": run.sched.get_last_lr()[0], "bad_steps": bad,
            "rows/trained": int(trained.sum()), "credit/fallback": stats["credit/fallback"],
            **{k: stats[k] / n_tok for k in ("clip/low", "clip/high", "clip/dual")},
            "credit/boosted_frac": ((gamma != 1) & on).sum().item() / max(1, on.sum().item()),
            **credit_stats(gamma, adv, on),
            **phase_times(sec), "mem/peak_gb": peak_memory_gb(run.device)}


def phase_times(sec):
    """time/* of a step from the clock's seconds per phase (grpo.update's phases make up time/update), and
    the credit's share of the step (the paper's Table 6 puts FlowTracer at ~2% of a step)."""
    update = sum(sec.get(k, 0.0) for k in ("update forward", "backward", "optimizer step"))
    step = sum(sec.values())
    return {"time/generate": sec.get("generation", 0.0), "time/reward": sec.get("reward", 0.0),
            "time/credit": sec.get("credit", 0.0), "time/update": update, "time/step": step,
            "time/credit_share": sec.get("credit", 0.0) / step if step > 0 else 0.0}


class Clock:
    """Seconds per phase of a step. `phase(name)` ends the running phase and starts `name` (None: stop);
    `reset()` starts a new step. On CUDA each mark first waits for the queued kernels
    (torch.cuda.synchronize): a phase is charged its own GPU time, not the time of the forward whose result
    its first host sync waits for. The run holds one (run.clock); grpo.update marks its phases on it."""
    def __init__(self, device, now=time.perf_counter, sync=None):
        self.sync = sync or (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))
        self.now, self.seconds, self.name, self.t = now, {}, None, None

    def reset(self):
        self.seconds, self.name, self.t = {}, None, None

    def phase(self, name):
        self.sync()
        t = self.now()
        if self.name is not None:
            self.seconds[self.name] = self.seconds.get(self.name, 0.0) + t - self.t
        self.name, self.t = name, t


def credit_stats(gamma, adv, on):
    """OAR App. A.3 on the trained response tokens: mean ESS ratio of gamma, and the top-10% mass of |A_t|."""
    ess, mass = [], []
    for b in range(gamma.shape[0]):
        g, n = gamma[b][on[b]].double(), int(on[b].sum())
        if n == 0:
            continue
        ess.append((g.sum() ** 2 / (n * (g ** 2).sum())).item())
        At = (g * adv[b].abs()).sort(descending=True).values
        if At.sum() > 0:
            mass.append((At[:max(1, n // 10)].sum() / At.sum()).item())
    mean = lambda x: sum(x) / len(x) if x else None  # noqa: E731
    return {"credit/ess_ratio": mean(ess), "credit/top10_adv_mass": mean(mass)}


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # Linux: KiB -> GiB, peak RSS


def save_rollouts(path, tok, batch, gen, rows, rewards, adv, scores, gamma):
    """One JSON line per rollout: text, reward, advantage, and per response token: text, score, gamma."""
    P = batch.prompt_width
    with ckpt_io.full_disk(path, "the rollouts"), open(path, "w") as fh:
        for b, j in enumerate(rows):
            n = int(batch.response_mask[b].sum())
            ids = batch.input_ids[b, P:P + n].tolist()
            fh.write(json.dumps({"prompt": tok.decode(gen.prompt_ids[j]), "response": gen.texts[j],
                                 "reward": rewards[j].item(), "adv": adv[b].item(),
                                 "tokens": [tok.decode([t]) for t in ids],
                                 "answer": batch.answer_mask[b, P:P + n].tolist(),
                                 "score": scores[b, :n].float().tolist(),
                                 "gamma": gamma[b, :n].tolist()}) + "\n")


CURVES = {"reward/mean": "mean reward", "acc": "accuracy (reward >= 1)",      # metric -> its y label
          "entropy": "policy entropy (nats/token)", "len/mean": "response length (tokens)"}


def plot_curves(metrics_path, png_path, model, task, credit):
    """curves.png: reward, accuracy, entropy and length against the step (integer ticks), one panel each with
    its y label, under a title naming the run (model, task, credit). Returns the figure (closed), or None when
    no step has any of them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    rows = [json.loads(line) for line in open(metrics_path)]
    if not any(r.get(k) is not None for r in rows for k in CURVES):
        return None
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.3))
    for ax, (k, label) in zip(axes, CURVES.items()):
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o")
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))             # steps are whole: no 1.5, 2.5
    fig.suptitle(f"{model} on {task}, credit {credit}")
    fig.tight_layout()
    with ckpt_io.full_disk(png_path, "the curves"):
        fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return fig


def metric_series(path, key):
    """[[step, value], ...] of one numeric metric of a metrics.jsonl, by step; the last line of a step wins,
    a line cut by a kill is skipped, a missing file gives []."""
    rows, path = {}, Path(path)
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get(key), (int, float)) and "step" in row:
            rows[row["step"]] = row[key]
    return [[s, v] for s, v in sorted(rows.items())]


def peak_ema(xs, alpha=0.2):
    """Peak-tracking EMA (App. C.3): EMA_t = alpha max(x_t, EMA_{t-1}) + (1 - alpha) EMA_{t-1},
    EMA_0 = x_0."""
    out = []
    for x in xs:
        out.append(x if not out else alpha * max(x, out[-1]) + (1 - alpha) * out[-1])
    return out


# ----------------------------------------------------------------------------- the end of a step, of a run
def end_step(run, step, m, rollout, bad, stopping=False):
    """The end of every step, skipped or not: the metrics line, the rollouts when due, the checkpoint when due
    or when the run stops here. Returns None, or the one-line reason when the disk is full (checkpoint.py's
    RunError): the loop stops on it, and the last complete checkpoint stands."""
    cfg = run.cfg
    if "skipped" in m:
        tqdm.write(f"step {step + 1}: {m['skipped']}; no update")
    elif bad:
        tqdm.write(f"step {step + 1}: non-finite loss {m['loss']} / grad norm {m['grad_norm']}: "
                   f"update skipped ({bad} in a row)")
    else:
        tqdm.write(f"step {m['step']}: reward {m['reward/mean']:.3f} acc {m['acc']:.2f} "
                   f"len {m['len/mean']:.0f} boosted {m['credit/boosted_frac']:.2f} "
                   f"trained {m['rows/trained']} {m['time/step']:.1f}s")
    try:
        ckpt_io.write_metrics(run.metrics, m)
        if rollout is not None and (step + 1) % cfg.rollouts_every == 0:
            save_rollouts(run.out / "rollouts" / f"step_{step + 1:05d}.jsonl", run.tok, *rollout)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or stopping:
            ckpt_io.save_checkpoint(run.out / "ckpt", run.model, run.tok, run.opt, run.sched, step + 1, cfg,
                                    bad)
    except ckpt_io.RunError as e:
        return str(e)
    return None


class Interrupt:
    """Ctrl-C and SIGTERM as a value the loop reads: the first sets `requested` (the step finishes, is saved,
    and the loop stops); a second stops at once (the default handler). A context manager: the default
    handlers are back after the block. Outside the main thread (a test's thread) nothing is installed."""
    def __init__(self):
        self.requested = False

    def on_signal(self, signum, _frame):
        self.requested = True
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, self.on_signal)
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return False


def finish(run, stop=None):
    """The end of a run, however it ended (stop: grpo.Outcome.stop): close the metrics, release the
    out-dir, plot, say where everything is. A plot that a full disk refuses is a warning: the run's data is
    saved already."""
    run.metrics.close()
    ckpt_io.unlock_out_dir(run.out)
    try:
        plot_curves(run.out / "metrics.jsonl", run.out / "curves.png", run.cfg.model, run.cfg.dataset,
                    f"{run.cfg.credit}/{run.cfg.shaping}")
    except ckpt_io.RunError as e:
        print(f"warning: {e}", file=sys.stderr)
    print(f"metrics: {run.out / 'metrics.jsonl'}\nplots:   {run.out / 'curves.png'}\n"
          f"rollouts: {run.out / 'rollouts'}")
    if (run.out / "ckpt").is_dir():
        print(f"checkpoint: {run.out / 'ckpt'}")
    if stop == "interrupted":
        print(f"interrupted: checkpoint saved; continue with --resume {run.out}")
