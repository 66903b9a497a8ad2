"""LoRA's update against full fine-tuning's on the same work (grpo.py departure 9), and their generation.

One process builds both policies as run.setup does (training/run/setup.py's load_for_update: full fine-tuning,
and --lora-rank R on the same base), generates one rollout batch with the full policy (at initialisation the
adapted model is the same function) and gives it rewards that vary in every group (row j: j mod 4 / 3), so
every row is trained in both arms. Then, in `--rounds` alternating rounds (a shared machine's noise spread
over both arms alike), each arm runs grpo.update on that batch (grpo.py's own micro-batch loop: forward with
FlowTracer's capture, credit, backward, optimizer step) and generates the same prompts once. Printed per arm,
medians over the rounds (the first round is warm-up, not counted): the update (update forward + backward +
optimizer step, grpo.py's time/update), credit, the generation, and LoRA's ratio to full fine-tuning.

Run:  python benchmarks/lora_speed.py                              # the embedded model, 2 prompts x 4, CPU
      python benchmarks/lora_speed.py --rounds 3 -- --model tiny-qwen3 --max-new-tokens 32   # a quick check
      python benchmarks/lora_speed.py --lora-rank 16 -- --model Qwen/Qwen3-4B-Base --prompts-per-step 4
Flags after `--` are grpo.py's (both arms get them; the LoRA arm also --lora-rank and its lr preset).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data  # noqa: E402
import grpo  # noqa: E402
from data import build_batch  # noqa: E402
from training.decode.rollout import Sampling, generate, prompt_ids  # noqa: E402
from training.memory import budget  # noqa: E402
from training.model import trainable
from training.run import log
from training.run.setup import load_for_update  # noqa: E402

UPDATE = ("update forward", "backward", "optimizer step")  # grpo.py's time/update (log.step_metrics)


def rollouts(run, cfg, prompts):
    """grpo.grpo_step's rollout call on run's policy; returns (its seconds, the generation)."""
    clock = log.Clock(run.policy.device)
    with clock.phase("generation"), torch.no_grad(), run.policy.autocast:
        run.policy.model.eval()
        gen = generate(
            run.policy.model,
            run.policy.tok,
            prompts,
            cfg.group_size,
            Sampling.of(cfg),
            chunk_size=cfg.gen_chunk,
            share_prefix=cfg.share_prefix,
        )
    return clock.seconds["generation"], gen


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(
        prog="lora_speed.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    ap.add_argument("--lora-rank", type=int, default=8, help="the LoRA arm's rank")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds; the first is not counted")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = ap.parse_args(argv[:cut])
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the first is warm-up)")
    torch.set_num_threads(args.threads)
    flags = argv[cut + 1 :]
    cfgs = {
        "full": grpo.parse_args(flags),
        f"lora-{args.lora_rank}": grpo.parse_args([*flags, "--lora-rank", str(args.lora_rank)]),
    }
    cfgs = {k: budget.largest(c) for k, c in cfgs.items()}  # a size left at 0: the CPU's, as setup's
    full = cfgs["full"]
    device = trainable.device_of(full.device)
    torch.manual_seed(full.seed)
    runs = {k: load_for_update(c, device) for k, c in cfgs.items()}
    records = data.load_task(full.dataset, split="train", path=full.data_path or None, seed=full.seed)
    style = (
        full.prompt_style
        if full.prompt_style != "auto"
        else data.default_style(full.model, records[0]["task"])
    )
    tok = runs["full"].policy.tok
    prompts = prompt_ids(tok, [data.make_prompt(r, tok, style) for r in records[: full.prompts_per_step]])
    _, gen = rollouts(runs["full"], full, prompts)
    batch = build_batch(tok, gen.prompt_ids, gen.response_ids, device=device)
    rewards = torch.tensor([(j % 4) / 3 for j in range(len(gen.texts))])  # (B,)
    adv, _ = grpo.compute_advantages(rewards, full.group_size, full.scale_std, full.adv_clip)
    adv = adv.to(device)
    trained = (adv != 0).nonzero().flatten().tolist()
    times = {k: {"update": [], "credit": [], "generation": []} for k in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            clock = log.Clock(device)
            up = grpo.update(run, batch, trained, adv, clock)
            assert up.stepped and up.stats["grad_norm"] > 0, f"{name}: nothing trained"
            gen_s, _ = rollouts(run, cfgs[name], prompts)
            if r:  # the first round warms both arms up
                times[name]["update"].append(sum(clock.seconds.get(k, 0.0) for k in UPDATE))
                times[name]["credit"].append(clock.seconds.get("credit", 0.0))
                times[name]["generation"].append(gen_s)
    med = {k: {p: statistics.median(v) for p, v in t.items()} for k, t in times.items()}
    lora = f"lora-{args.lora_rank}"
    print(
        f"{full.model}, {device}: {len(trained)} of {len(adv)} rows trained, {full.max_new_tokens} new "
        f"tokens, micro_batch {full.micro_batch}, {args.rounds - 1} counted rounds (medians, s)"
    )
    print(f"{'arm':10s} {'update':>9s} {'credit':>9s} {'generation':>11s}")
    for name, m in med.items():
        print(f"{name:10s} {m['update']:9.3f} {m['credit']:9.3f} {m['generation']:11.3f}")
    print(
        f"{lora} / full: update {med[lora]['update'] / med['full']['update']:.3f}, generation "
        f"{med[lora]['generation'] / med['full']['generation']:.3f}"
    )
    return med


if __name__ == "__main__":
    main()
