"""The run: what every step reads, made once, and what it writes. grpo.py's calls: setup.setup(cfg) -> Run,
then run.log.step(...) after each step, run.log.finish(...) at the end, heldout.evaluate(run) when due.

    setup.py       Run and setup: data, model, optimizer, the run directory, the step sized to the card
    log.py         the run's log: metrics, rollouts with their credit, curves, phase times, saves when due
    checkpoint.py  checkpoints, written atomically and read back for --resume
    directory.py   the run directory: its lock, the paths written there, metrics.jsonl opened
    tracking.py    --report-to tensorboard | wandb
    heldout.py     held-out greedy accuracy inside the run (--eval-every), and eval.py learn's"""
