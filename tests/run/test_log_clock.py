"""The run log's phase clock (training/run/log.py) on a GPU, faked: queued GPU work is charged to the phase
that queued it, the clock synchronizes on CUDA, and time/credit_share is the credit's part of the step."""

from types import SimpleNamespace

import torch


# ----------------------------------------------------------------------------- phase timing on a GPU
def fake_gpu():
    """A fake device clock: kernels queue (`queue(s)` returns at once), a synchronize or any host sync
    (`.item()` in the credit) waits until the queue is done."""
    now, queued = [0.0], [0.0]

    def sync():
        now[0] += queued[0]
        queued[0] = 0.0

    return now, queued, sync


def test_clock_charges_queued_gpu_work_to_the_phase_that_queued_it():
    """The forward queues 5 s of kernels and returns; the fused credit's first host sync waits for them, then
    runs 1 s of its own. Synchronizing at each mark charges update forward 5 s and credit 1 s; without it
    (the clock before, host time alone) the forward's 5 s land in credit."""
    from training.run import log

    for synced, expect in (
        (True, {"update forward": 5.0, "credit": 1.0}),
        (False, {"update forward": 0.0, "credit": 6.0}),
    ):
        now, queued, sync = fake_gpu()
        clock = log.Clock(torch.device("cpu"), now=lambda: now[0], sync=sync if synced else lambda: None)
        with clock.phase("update forward"):
            queued[0] += 5.0  # the training forward, queued
        with clock.phase("credit"):
            sync()  # credit's first .item(): waits for the forward
            now[0] += 1.0  # the credit's own second
        assert clock.seconds == expect


def test_clock_synchronizes_on_cuda(monkeypatch):
    from training.run import log

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    clock = log.Clock(torch.device("cuda"))
    with clock.phase("generation"):
        pass
    assert len(calls) == 2 and set(clock.seconds) == {"generation"}


def test_credit_share_is_the_credits_part_of_the_step():
    """time/credit_share = time/credit / time/step, time/update = forward + backward + optimizer step."""
    from data import Batch
    from training.run import log

    resp = torch.tensor([[False, True, True], [False, True, False]])  # (B, T), P = 1
    batch = Batch(torch.zeros(2, 3, dtype=torch.long), resp.long(), ~resp, resp, resp & False, 1)
    up = SimpleNamespace(
        weight=resp[:, 1:].float(),
        stats={
            "entropy": [],
            "loss": 0.0,
            "credit/fallback": 0,
            "clip/low": 0,
            "clip/high": 0,
            "clip/dual": 0,
        },
    )
    gen = SimpleNamespace(truncated=[False, False], response_ids=[[1, 2], [3]])
    cfg = SimpleNamespace(beta=0.0, num_iterations=1)
    m = log.step_metrics(
        cfg,
        torch.tensor([1.0, 0.0]),
        torch.tensor([False]),
        gen,
        batch,
        torch.tensor([1.0, -1.0]),
        up,
        {"generation": 2.0, "credit": 1.0, "backward": 1.0, "update forward": 0.5},
        0,
        1e-6,
        "cpu",
    )
    assert m["time/credit_share"] == 1.0 / 4.5 and m["time/update"] == 1.5 and m["time/step"] == 4.5
