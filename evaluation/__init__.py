"""What eval.py runs: credit probes, high-flow tokens, figures, learning grid, memory, statistics."""
