"""What a GRPO run writes, and the run directory while it writes: never lost, never split.

    log = RunLog(out, cfg, policy, metrics)                   # run.setup: the directory is locked already
    with log.clock.phase("credit"): ...                       # grpo's phases, timed (time/*)
    log.step(step, m, rollouts, bad, stopping)                # grpo.train, after every step
    log.finish(stop)                                          # the end of the run, however it ended

  step      the metrics line (metrics.jsonl; the tracker of --report-to), the rollouts with their per-token
            credit when due (rollouts/step_N.jsonl), the checkpoint when due (ckpt/, the last
            --keep-checkpoints of them) with curves.png redrawn. A first Ctrl-C / SIGTERM sets
            log.signals.signum (the step finishes within --stop-grace, is saved, the run stops with
            log.signals.status: 143 or 130); a second stops at once (training/usercode/guard.py's Stop).
  stopped   the step stopped before its update: by the user's code (a --reward that raised, returned a
            non-number, or ran past the grace or a second signal: guard.py; an --answer-pattern past its
            bound) or a second signal: the last completed step is saved as it ended (its weights, optimizer,
            RNG) where no optimizer step has begun since, then the run finishes.
  Clock, step_metrics, credit_stats   seconds per phase (time/*); one step's metrics; OAR App. A.3's credit.
Metric names (one name, one meaning): reward/*, acc (reward >= 1), frac_zero_std (groups whose rewards do not
vary), len/* (response tokens), entropy (over the trained response tokens), loss, grad_norm, clip/* (fraction
of trained tokens clipped), credit/* (weight statistics over the trained rows), time/*, mem/peak_gb, eval/*,
oom/backoffs (out-of-memory back-offs in the step: training/memory/backoff.py); under --precision fp16
scaler/scale (the GradScaler's) and scaler/skipped (1: it skipped the step).

The checkpoint is written (and read) by training/run/checkpoint.py, atomically: a kill at any point of a save
leaves one that --resume loads. metrics.jsonl gets one line per step, fsynced. The run directory is locked
(fcntl.flock on <out_dir>/.lock) while the process lives (training/run/directory.py). A full disk is one line
with the space needed, and the last complete checkpoint stands.

Run: python -c "from training.run import log; log.plot_curves('runs/embedded/metrics.jsonl', 'curves.png',
                'smollm2-135m', 'arithmetic', 'flow/topk')"
"""

import contextlib
import json
import math
import os
import resource
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from tasks.answers import find_answer_span
from training.run import directory
from training.run.checkpoint import MARK, complete, full_disk, rng_state, save_checkpoint
from training.run.directory import RunError
from training.usercode.guard import Interrupted, Stop


class Last(NamedTuple):
    """The last completed step as it ended (RunLog.step), what RunLog.stopped saves when it was not."""

    done: int  # the steps completed
    bad: int  # the non-finite streak after it
    saved: bool  # its checkpoint was written
    rng: dict  # the RNG states the next step started from (rng_state)


# ----------------------------------------------------------------------------- the run's log
class Rollouts(NamedTuple):
    """What a step hands the run's files (grpo.grpo_step -> RunLog.step -> save_rollouts): the B rows it
    trained on, of the N it sampled."""

    batch: object  # data.Batch of the kept rows, (B, T)
    gen: object  # rollout.Generations of every sampled row (N)
    kept: list  # batch row b is sampled row kept[b] (--dynamic-filter drops rows)
    rewards: torch.Tensor  # (N,) every sampled row's reward
    adv: torch.Tensor  # (B,) A_i, eq. 10
    scores: torch.Tensor  # (B, R) the credit's scores (flow: throughput tau)
    weight: torch.Tensor  # (B, R) gamma_it on each response token (eq. 6)


class RunLog:
    """The run directory while a run writes into it: the metrics file (open), the tracker (None: metrics.jsonl
    alone), and what a save needs (the policy.Policy: model, tokenizer, optimizer, schedule; the config)."""

    def __init__(self, out, cfg, policy, metrics, tracker=None):
        self.out, self.cfg, self.policy = Path(out), cfg, policy
        self.metrics, self.tracker, self.clock = metrics, tracker, Clock(policy.device)
        self.signals = Stop(getattr(cfg, "stop_grace", 30.0)).install()  # Ctrl-C, SIGTERM (guard.py):
        # signals.signum set at the first, the step finishes and is saved, and the run stops
        self.warned_answers = False  # the missing answer regions were said (once a run)
        self.last = None  # Last: the last step this process completed (None: none yet)
        self.lock = directory.held(self.out)  # the directory's open lock file (setup locked it), or None
        self.backoffs = 0  # out-of-memory back-offs this step (training/memory/backoff.py counts)

    def step(self, step, m, rollouts, bad, stopping=False):
        """The end of every step, skipped or not: its line, the tracker, the rollouts when due, the checkpoint
        when due or when the run stops here; one line, once a run, when more than half the responses have no
        answer region (answers/missing: their flow credit falls back to plain GRPO). Returns None, or the
        one-line reason when the disk is full: the loop stops on it, and the last complete checkpoint
        stands."""
        cfg, done, self.clock.seconds = self.cfg, step + 1, {}  # the next step's phases start at 0
        m["oom/backoffs"], self.backoffs = self.backoffs, 0  # training/memory/backoff.py's, this step
        missing, n = m.get("answers/missing", 0), len(rollouts.gen.texts) if rollouts is not None else 0
        if 2 * missing > n > 0 and not self.warned_answers:  # eq. 2's sink: said once a run
            self.warned_answers = True
            tqdm.write(answers_notice(done, missing, n, cfg.answer_pattern, rollouts.gen.texts))
        if "skipped" in m:
            tqdm.write(f"step {done}: {m['skipped']}; no update")
        elif bad:
            tqdm.write(
                f"step {done}: non-finite loss {m['loss']} / grad norm {m['grad_norm']}: "
                f"update skipped ({bad} in a row)"
            )
        else:
            held_out = f" eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
            held_out += (
                f" (fp16 overflow: step skipped, scale {m['scaler/scale']:g})"
                if m.get("scaler/skipped")
                else ""
            )
            mean = math.nan if m["reward/mean"] is None else m["reward/mean"]  # None: no reward scored
            tqdm.write(
                f"step {done}: reward {mean:.3f} acc {m['acc']:.2f} "
                f"len {m['len/mean']:.0f} "
                f"boosted {m['credit/boosted_frac']:.2f} trained {m['rows/trained']}{held_out} "
                f"{m['time/step']:.1f}s"
            )
        try:
            write_metrics(self.metrics, m)
            if self.tracker is not None:
                self.tracker.log(m, done)
            if rollouts is not None and done % cfg.rollouts_every == 0:
                save_rollouts(self.out / "rollouts" / f"step_{done:05d}.jsonl", self.policy.tok, rollouts)
            due = done % cfg.save_every == 0 or done == cfg.steps or stopping
            if due:
                self.save(done, bad)
        except RunError as e:
            return str(e)
        self.last, self.policy.moved = (
            Last(done, bad, due, rng_state()),
            False,
        )  # what the next step starts from
        return None

    def save(self, done, bad, rng=None):
        """The checkpoint of step `done` (ckpt/, atomically; rng: the RNG states to record, else the current
        ones), curves.png redrawn."""
        cfg, pol = self.cfg, self.policy
        save_checkpoint(
            self.out / "ckpt",
            pol.model,
            pol.tok,
            pol.opt,
            pol.sched,
            done,
            cfg,
            bad,
            keep=getattr(cfg, "keep_checkpoints", 1),
            rng=rng,
        )
        plot_curves(
            self.out / "metrics.jsonl",
            self.out / "curves.png",
            cfg.model,
            cfg.dataset,
            f"{cfg.credit}/{cfg.shaping}",
        )

    def save_last(self):
        """The checkpoint of the last completed step, as a save at its end would have written it (the RNG as
        it left it), where it was not saved and no optimizer step has begun since: a step stopped before its
        update stepped (your reward or pattern: `stopped`; out of memory: training/memory/backoff.py) loses
        nothing, and --resume is exact. Returns what stands, as words for the run's last line."""
        last, note = self.last, ""
        if last is not None and not last.saved and not self.policy.moved:
            try:
                self.save(last.done, last.bad, last.rng)
                self.last = last._replace(saved=True)
                return f"step {last.done} is saved ({self.out / 'ckpt'}): --resume continues from it"
            except RunError as full:
                note = f" ({full})"
        mark = self.out / "ckpt" / MARK
        return (
            f"the last checkpoint stands (step {mark.read_text().strip()}, {mark.parent})"
            if complete(mark.parent)
            else "no checkpoint was written yet"
        ) + note

    def stopped(self, e):
        """grpo.main's end of a run stopped mid-step (e: RewardError, PatternError, or Interrupted: a second
        signal, or the grace's end in a --reward): the last completed step saved (save_last). Returns
        (Outcome.stop, status): ("interrupted", the signal's status), or (e and what stands, 2)."""
        stands, interrupted = self.save_last(), isinstance(e, Interrupted)
        self.finish("interrupted" if interrupted else str(e))
        return ("interrupted", self.signals.status or 130) if interrupted else (f"{e}; {stands}", 2)

    def finish(self, stop=None):
        """The end of a run, however it ended (stop: grpo.Outcome.stop): close the metrics and the tracker,
        release the directory, say where everything is (curves.png was drawn at the last save)."""
        self.metrics.close()
        if self.tracker is not None:
            self.tracker.close()
        if threading.current_thread() is threading.main_thread():  # Python's handlers again (the
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Stop's watchdog, if any, sees it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # and ends)
        if self.lock is not None:
            self.lock.close()  # closing the lock file lets the directory go (directory.py)
        print(
            f"metrics: {self.out / 'metrics.jsonl'}\nplots:   {self.out / 'curves.png'}\n"
            f"rollouts: {self.out / 'rollouts'}"
        )
        if (self.out / "ckpt").is_dir():
            print(f"checkpoint: {self.out / 'ckpt'}")
        if stop == "interrupted":  # which of a finished step, the grace's end, a second signal
            print(
                f"interrupted ({self.signals.ended()}): checkpoint saved (step "
                f"{(self.out / 'ckpt' / MARK).read_text().strip()}); continue with --resume {self.out}"
                if complete(self.out / "ckpt")
                else f"interrupted ({self.signals.ended()}) before the first step completed: nothing saved"
            )


def answers_notice(step, missing, n, pattern, texts, head=60, tail=100):
    """The run's notice when more than half of a step's n responses have no answer region (eq. 2's sink):
    the rule they were matched against and one sampled reply without one, cut short (its first `head` and
    last `tail` characters: where an answer would be), so that one sees whether the model does not write the
    answer's form or the pattern does not match it."""
    rule = (
        f"--answer-pattern '{pattern}'"
        if pattern
        else "the default: the last \\boxed{...}, else <answer>...</answer> (--answer-pattern: none given)"
    )
    reply = next((t for t in texts if find_answer_span(t, pattern or None) is None), "")
    shown = repr(reply) if len(reply) <= head + tail + 5 else f"{reply[:head]!r} [...] {reply[-tail:]!r}"
    return (
        f"step {step}: {missing} of {n} responses have no answer region (eq. 2's sink), so their flow "
        f"credit falls back to plain GRPO\n  matched against: {rule}\n"
        f"  one reply ({len(reply)} characters): {shown}\n"
        "  if the model writes its answer in another form, give --answer-pattern REGEX for that form; "
        "if it writes none, ask for one in the prompt"
    )


class Clock:
    """Seconds per phase of a step: `with clock.phase("credit"): ...` adds the block's time to
    seconds["credit"]. On CUDA each mark first waits for the queued kernels (torch.cuda.synchronize): a phase
    is charged its own GPU time, not the time of the forward whose result its first host sync waits for."""

    def __init__(self, device, now=time.perf_counter, sync=None):
        cuda = torch.device(device).type == "cuda"
        self.sync = sync or (torch.cuda.synchronize if cuda else (lambda: None))
        self.now, self.seconds = now, {}

    @contextlib.contextmanager
    def phase(self, name):
        self.sync()
        t = self.now()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + self.now() - t


# ----------------------------------------------------------------------------- one step's metrics
def step_metrics(cfg, rewards, zero_std, gen, batch, adv, up, sec, bad, lr, device):
    """One step's metrics; up: grpo.Update; sec: Clock.seconds; bad: the non-finite streak; lr: the step's.
    time/credit is the credit after the forward (the capture runs inside the update's forward: time/update);
    time/credit_share is its share of the step (FlowTracer's Table 6: ~2%)."""
    loss_mask, weight, stats = batch.response_mask[:, batch.prompt_width :], up.weight, up.stats  # (B, R)
    trained = (adv != 0) if cfg.beta == 0 else torch.ones_like(adv, dtype=torch.bool)  # (B,)
    n_tok = loss_mask.sum().clamp_min(1).item() * cfg.num_iterations
    ent = torch.cat(stats["entropy"]) if stats["entropy"] else torch.zeros(0)
    on = loss_mask & trained[:, None]  # (B, R)
    update = sum(sec.get(k, 0.0) for k in ("update forward", "backward", "optimizer step"))
    step = sum(sec.values())
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if torch.device(device).type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )  # Linux: KiB -> GiB, peak RSS
    scored = rewards[~rewards.isnan()]  # NaN: no --reward function scored it (reward_code.py)
    some = len(scored) > 0
    return {
        "reward/mean": scored.mean().item() if some else None,
        "reward/std": scored.std(unbiased=False).item() if some else None,
        "reward/unscored": len(rewards) - len(scored),
        "acc": (rewards >= 1).float().mean().item(),
        "frac_zero_std": zero_std.float().mean().item(),
        "len/mean": loss_mask.sum(-1).float().mean().item(),
        "len/truncated_frac": sum(gen.truncated) / len(gen.truncated),
        "gen/tokens": sum(map(len, gen.response_ids)),
        "entropy": ent.float().mean().item() if ent.numel() else None,
        "loss": stats["loss"],
        "grad_norm": stats.get("grad_norm", 0.0),
        "lr": lr,
        "bad_steps": bad,
        **(
            {"scaler/scale": stats["scaler/scale"], "scaler/skipped": int(up.skipped)}  # fp16 alone
            if "scaler/scale" in stats
            else {}
        ),
        "rows/trained": int(trained.sum()),
        "credit/fallback": stats["credit/fallback"],
        **{k: stats[k] / n_tok for k in ("clip/low", "clip/high", "clip/dual")},
        "credit/boosted_frac": ((weight != 1) & on).sum().item() / max(1, on.sum().item()),
        **credit_stats(weight, adv, on),
        "time/generate": sec.get("generation", 0.0),
        "time/reward": sec.get("reward", 0.0),
        "time/credit": sec.get("credit", 0.0),
        "time/update": update,
        "time/step": step,
        "time/credit_share": sec.get("credit", 0.0) / step if step > 0 else 0.0,
        "mem/peak_gb": peak,
    }


def credit_stats(weight, adv, on):
    """OAR App. A.3 on the trained response tokens: mean ESS ratio of the weight gamma_it (B, R), and the
    top-10% mass of |A_t|."""
    ess, mass = [], []
    for b in range(weight.shape[0]):
        g, n = weight[b][on[b]].double(), int(on[b].sum())
        if n == 0:
            continue
        ess.append((g.sum() ** 2 / (n * (g**2).sum())).item())
        At = (g * adv[b].abs()).sort(descending=True).values
        if At.sum() > 0:
            mass.append((At[: max(1, n // 10)].sum() / At.sum()).item())
    mean = lambda x: sum(x) / len(x) if x else None  # noqa: E731
    return {"credit/ess_ratio": mean(ess), "credit/top10_adv_mass": mean(mass)}


# ----------------------------------------------------------------------------- files a step writes
CURVES = {
    "reward/mean": "mean reward",
    "acc": "accuracy (reward >= 1)",  # metric -> its y label
    "entropy": "policy entropy (nats/token)",
    "len/mean": "response length (tokens)",
}


def plot_curves(metrics_path, png_path, model, dataset, credit):
    """curves.png: reward, accuracy, entropy and length against the step (integer ticks), one panel each with
    its y label, under a title naming the run (model, dataset, credit). Returns the figure (closed), or None
    when no step has any of them."""
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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.5, 2.5
    fig.suptitle(f"{model} on {dataset}, credit {credit}")
    fig.tight_layout()
    with full_disk(png_path, "the curves"):
        fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return fig


def write_metrics(fh, record):
    """One JSON line, on disk before the next step starts; a full disk is a RunError naming the file."""
    with full_disk(fh.name, f"step {record.get('step')}'s metrics"):
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# ----------------------------------------------------------------------------- rollouts/step_N.jsonl
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
