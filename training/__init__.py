"""What one grpo.py step is built from: models, rollouts and the batch, credit, the policy, checkpoints."""
