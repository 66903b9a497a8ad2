"""Experiment tracking: grpo.py --report-to none | tensorboard | wandb.

metrics.jsonl stays the run's record (log.write_metrics); a tracker shows the same lines live in
TensorBoard or Weights & Biases. One call opens it, one call a step logs a metrics line, one call closes it:

  tracker = tracking.open(cfg.report_to, cfg.out_dir, dataclasses.asdict(cfg), resume_step=start or None)
  tracker.log(m, step=m["step"])          # every numeric metric of the line, under its own name
  tracker.close()

  none         log and close do nothing.
  tensorboard  torch.utils.tensorboard.SummaryWriter under <out_dir>/tensorboard: one scalar per metric
               (names keep their slash: "eval/accuracy" is the accuracy chart of the eval section), the run's
               config as text ("config", a JSON block) and as hparams (the HParams tab; lists and None as
               text). A resumed run (resume_step k) purges the events of steps > k that a killed process
               wrote, as open_metrics cuts metrics.jsonl back. View: tensorboard --logdir <out_dir>.
  wandb        wandb.init(dir=out_dir, config=config), offline unless WANDB_MODE says otherwise (this repo
               reaches no network; `wandb sync <out_dir>/wandb/offline-run-*` uploads a run later). The
               package is optional and not in requirements.txt.

A backend that is not installed is a ValueError naming its install command (grpo.py prints it as one line).

Departures (numbered):
 1. Non-numeric values (None, strings, the per-question lists of eval/right) are not logged: trackers take
    scalars; metrics.jsonl keeps them. Booleans are logged as 0 / 1.

Run: python -c "from training.run import tracking as t; r = t.open('tensorboard', '/tmp/tb', {'lr': 1e-6});
                r.log({'loss': 0.5, 'eval/accuracy': 0.25}, step=1); r.close()"
"""

import json
import math
import numbers
import os
from pathlib import Path

KINDS = ("none", "tensorboard", "wandb")
PROJECT = "flowtracer"  # the W&B project of every run
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}


class Tracker:
    """One run's live view. kind: one of KINDS; writer: the SummaryWriter or the wandb run (None for none)."""

    def __init__(self, kind, writer=None):
        self.kind, self.writer = kind, writer

    def log(self, metrics, step):
        """Every numeric value of `metrics` (one metrics.jsonl line) but its step, as a scalar at `step`."""
        scalars = numeric(metrics)
        if self.kind == "tensorboard":
            for name, x in scalars.items():
                self.writer.add_scalar(name, x, global_step=step)
        elif self.kind == "wandb" and scalars:
            self.writer.log(scalars, step=step)

    def close(self):
        """Flush and close; a closed tracker logs nothing more (a second close does nothing)."""
        if self.kind == "tensorboard":
            self.writer.close()
        elif self.kind == "wandb":
            self.writer.finish()
        self.kind, self.writer = "none", None


def numeric(metrics):
    """{name: float} of the numeric values (departure 1): None, strings, lists and dicts are left out, and
    "step", the x axis."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and k != "step"}


def open(kind, out_dir, config, resume_step=None):
    """A Tracker of `kind` for the run in `out_dir`; config: the run's flags (a flat dict)."""
    if kind not in KINDS:
        raise ValueError(f"--report-to {kind!r}: choose one of {', '.join(KINDS)}")
    if kind == "none":
        return Tracker("none")
    if kind == "tensorboard":
        return Tracker(kind, tensorboard_writer(Path(out_dir), config, resume_step))
    return Tracker(kind, wandb_run(Path(out_dir), config))


def tensorboard_writer(out, config, resume_step):
    """A SummaryWriter under <out>/tensorboard with the config as text and hparams."""
    try:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
    except ImportError:
        raise ValueError(
            f"--report-to tensorboard needs the tensorboard package: {INSTALL['tensorboard']}"
        ) from None
    purge = None if resume_step is None else resume_step + 1  # a killed run's later steps go
    w = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge)
    if resume_step is None:  # a resumed run: written once already
        w.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", global_step=0)
        flat = {
            k: v if isinstance(v, (bool, int, str)) or isinstance(v, float) and math.isfinite(v) else str(v)
            for k, v in config.items()
        }  # None, lists, NaN: as text
        for summary in hparams(flat, {"reward/mean": math.nan, "acc": math.nan, "eval/accuracy": math.nan}):
            w.file_writer.add_summary(summary)  # the HParams tab; metrics by tag
    return w


def wandb_run(out, config):
    """wandb.init in the run directory, offline unless WANDB_MODE is set."""
    try:
        import wandb
    except ImportError:
        raise ValueError(
            f"--report-to wandb needs the wandb package, which is not installed: {INSTALL['wandb']}"
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=PROJECT,
        name=out.name,
        dir=str(out),
        config=config,
        mode=os.environ.get("WANDB_MODE", "offline"),
    )
