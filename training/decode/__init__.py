"""Rollouts: n sampled responses per prompt, each prompt read once. grpo.py's one call:
rollout.generate(model, tok, prompts, n, sampling, ...) -> Generations, sampling = rollout.Sampling.of(cfg).

    rollout.py         generate: the shared prefix, each prompt's suffix, then the CPU decoder (HF's sampling)
    engine.py          the CUDA decode engine generate uses there: a static KV cache, graphs, no host sync
    fused_step.py      the engine's decode step written out: merged projections, GQA attention over lengths
    decode_weights.py  the weights as it reads them: Q, K, V and gate, up merged; LoRA as low-rank pairs
    static_step.py     the sampler and the static cache of the engine's step (the model step's cache layer)
    cudagraph.py       one decode step as a CUDA graph, and a failure said in one line"""
