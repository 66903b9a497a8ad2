"""The presets of grpo.py's flags: the embedded run's, the paper models', --paper-batch's and LoRA's, each
with its source; and where the learning rate in force came from.

A preset is a {field: value} applied over grpo.Config's defaults when the flags ask for it; the presets in
force apply in the order of `table` (the last wins), then a --config file, then the flags given
(training/config/flags.py's parse, which also picks the presets in force: flags.in_force). grpo.py builds the
table once, from its Config (`PRESETS = presets.of(Config)`): LoRA's learning rate is a multiple of
Config.lr, whose default is written once, in grpo.Config. The departures are grpo.py's, by number:

  the embedded model  departure 5: SmolLM2-135M-Instruct (the default --model, named or not) runs on a CPU
                      in minutes, with one checkpoint of its weights alone (EMBEDDED)
  a paper model       departure 6: the paper's models (§4.1, PAPER_MODELS) get App. C.3's dynamic filter
  --paper-batch       departure 1: the paper's 64 prompts x 8 samples per step, accumulated
  --lora-rank         departure 9: LoRA's lr is ~10x full fine-tuning's ("LoRA Without Regret", Schulman et
                      al., Thinking Machines Lab, 2025): 10x the default's, or the embedded model's

`lr_lines` is what grpo.py prints first: the lr in force and where it came from.

Run: python grpo.py --help    (each flag's default says which preset sets it)
     python -m pytest -q tests/test_grpo_cli.py tests/config/test_help.py tests/model/test_lora.py
"""

# Departure 5: the embedded model runs on a CPU in minutes, one checkpoint of its weights alone; flags win.
EMBEDDED = dict(
    prompts_per_step=2,
    group_size=4,
    max_new_tokens=128,
    steps=6,
    lr=1e-5,
    warmup_steps=2,
    micro_batch=4,
    gen_chunk=8,
    rollouts_every=2,
    max_prompt_tokens=768,
    save_optimizer=False,
    grad_checkpointing=False,
    out_dir="runs/embedded",
)
PAPER_MODEL = dict(dynamic_filter=True)  # departure 6: the paper's models get App. C.3's dynamic filter
PAPER_MODELS = ("qwen3-4b", "qwen3-8b", "llama-3.1-8b", "llama-3.2-3b")  # §4.1, App. C.3
PAPER_BATCH = dict(prompts_per_step=64, group_size=8)  # departure 1: 64 prompts x 8, accumulated; flags win
LORA_LR_FACTOR = 10  # departure 9: LoRA's lr is ~10x full fine-tuning's ("LoRA Without Regret"); flags win


def of(cls) -> dict:
    """{label: preset} of `cls` (grpo.Config), in the order they apply: the embedded model, a paper model,
    --paper-batch, LoRA's lr (LORA_LR_FACTOR x cls.lr; on the embedded model, x its lr). Labels are what the
    help and the first lines print."""
    return {
        "the embedded model": EMBEDDED,
        "a paper model": PAPER_MODEL,
        "--paper-batch": PAPER_BATCH,
        "--lora-rank": dict(lr=round(LORA_LR_FACTOR * cls.lr, 15)),  # 1e-5 (round: not 9.999999999999999e-06)
        "--lora-rank on the embedded model": dict(lr=round(LORA_LR_FACTOR * EMBEDDED["lr"], 15)),
    }


def lr_lines(cfg, given, file, active, default) -> list:
    """The lines flags.parse prints about the learning rate in force: its value and where it came from (the
    default, a preset in force, --lr, the --config file, the resumed run's), and a notice when an lr from a
    --config file that does not set lora_rank meets --lora-rank on the command line: the file, written for
    full fine-tuning, then overrides LoRA's 10x preset. given: the flags on the command line; file: the
    --config file's; active: [(label, preset)] in force, in order; default: where the default comes from (the
    lr field's help)."""
    if cfg.resume:
        return [
            f"lr {cfg.lr:g}: "
            + ("--lr, given with --resume" if "lr" in given else "the resumed run's (its run_config.json)")
        ]
    values = [(type(cfg).lr, None)] + [(p["lr"], label) for label, p in active if "lr" in p]
    value, label = values[-1]  # what the defaults and presets give
    full = [v for v, k in values if not str(k).startswith("--lora-rank")][-1]  # full fine-tuning's
    if "lr" in given:
        where = "--lr"
    elif "lr" in file:
        where = f"--config {cfg.config}"
    elif label is None:
        where = f"the default ({default})"
    else:
        where = f"set by {label}" + (
            f": {cfg.lr / full:g} x {full:g}, full fine-tuning's" if value != full else ""
        )
    lines = [f"lr {cfg.lr:g}: {where}"]
    if "lr" in file and "lr" not in given and "lora_rank" not in file and given.get("lora_rank", 0) > 0:
        lines.append(
            f"notice: lr {cfg.lr:g} comes from --config {cfg.config}, which does not set lora_rank, "
            f"while --lora-rank {cfg.lora_rank} is given on the command line: the file's lr "
            f"replaces LoRA's preset ({value:g}); give --lr to choose"
        )
    return lines
