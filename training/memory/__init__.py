"""The step sized to the card, and kept running on it. grpo.py's calls: backoff.generate(run, ...) and
backoff.update(run, ...), which redo a phase smaller when memory runs out; setup sizes the step once
(budget.size) and tries each GPU part once (preflight.try_parts).

    budget.py     gen_chunk and micro_batch chosen to fit the card, before the weights load
    phases.py     the estimate: what one step holds, phase by phase, from the model's config
    shapes.py     the step's shapes and byte widths, as the estimate reads them
    terms.py      the estimate's terms, op by op (a layer's saved tensors, the KV cache, the capture)
    backoff.py    out of memory: a smaller gen_chunk or micro_batch, the step redone, not lost
    preflight.py  each GPU part (kernel, optimizer step, the engine's graphs) tried once at setup"""
