"""What one grpo.py step is built from: the policy (policy.py) and seven rooms, each reached in one call.

    decode/    rollouts, each prompt read once; the CUDA engine    rollout.generate(..., prompts, n, sampling)
    credit/    every credit but the paper's default               baselines.OtherCredit(run, batch, ...)
    memory/    the step sized to the card; out of memory, smaller  backoff.generate, backoff.update
    model/     a model by name, at the run's precision; LoRA       trainable.load_policy (at setup)
    config/    grpo.Config as flags, presets, --config, --resume    flags.parse (grpo.parse_args)
    run/       setup, the run's files, checkpoints, held-out eval   setup(cfg) -> Run; run.log.step(...)
    usercode/  your --reward functions, bounded                     data.batch_reward(run.task.reward, ...)

Imports run down: config, run, memory, model, credit and usercode, decode; policy.py under model/
(tests/test_imports.py holds the order)."""
