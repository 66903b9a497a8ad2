"""Rollouts: n sampled responses per prompt, each prompt read once. grpo.py's one call:
rollout.generate(model, tok, prompts, n, sampling, ...) -> Generations, sampling = rollout.Sampling.of(cfg).

    rollout.py      generate: the shared prefix, each prompt's suffix, then the CPU decoder (HF's sampling)
    engine.py       the CUDA decode engine generate uses there: a static KV cache, graphs, no host sync
    static_step.py  the parts of the engine's decode step a CUDA graph can hold
    cudagraph.py    one decode step as a CUDA graph, and a failure said in one line"""
