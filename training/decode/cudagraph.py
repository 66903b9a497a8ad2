"""One decode step as a CUDA graph (training/decode/engine.py's idea 2): the step run once on a side stream
before its capture (warm_up), then recorded, not run (capture), and a failure said in one line (error_line).
torch.cuda.graph's steps, written out so that a failing capture still leaves the side stream and the error
raised is the first one; the engine decides what a failure turns off (Engine.run, fall_back, stop). An
out-of-memory error is not a graph fault (out_of_memory): the engine passes it on, to
training/memory/backoff.py. tests/decode/test_engine_fallbacks.py forces each failure on the CPU with a
fake of torch.cuda's streams and graphs.

Run: python -m pytest -q tests/decode/test_engine_fallbacks.py
"""

import torch
from accelerate.utils.memory import should_reduce_batch_size


def out_of_memory(error):
    """Whether `error` is the allocator running out of memory: torch.OutOfMemoryError (any device, so a CPU
    test can raise it), or what accelerate's should_reduce_batch_size reads as one (its messages: the CPU
    allocator's, cuDNN's unsupported size, other backends'). Not a fault of the graphs: the rows are too many
    for the memory, and training/memory/backoff.py makes them fewer."""
    return isinstance(error, torch.OutOfMemoryError) or should_reduce_batch_size(error)


def error_line(error):
    """An error as one line: its type and the first line of its message (CUDA's and Triton's run longer)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def warm_up(step, side):
    """`step` (no arguments) run once on the side stream before its capture (lazy inits, kernel choice), as
    torch's graph recipe does; it writes the engine's state like any step (Engine.run undoes it)."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)


def capture(step, side, pool):
    """`step`'s CUDA graph (in memory pool `pool`, None: a new one), recorded (not run) on the side stream:
    torch.cuda.graph's steps, written out so that a failing capture still leaves the side stream (the
    `with`: torch.cuda.graph's __exit__ raises from capture_end before it leaves the stream) and the error
    raised is the first one (an operation that synchronised, not capture_end's "invalidated" after it)."""
    g, first = torch.cuda.CUDAGraph(), None
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        g.capture_begin(pool=pool)
        try:
            step()  # recorded, not run
        except Exception as e:  # noqa: BLE001 (raised below)
            first = e
        try:
            g.capture_end()  # the capture always ends
        except Exception as e:  # noqa: BLE001
            first = first or e
    if first is not None:
        raise first
    return g
