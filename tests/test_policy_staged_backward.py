"""The shared prompt's backward in two stages (policy.PromptStage, policy.py departure 3): the response pass
differentiated first, each weight's part added into .grad as it is made, then the prompt pass as a backward
of its own. Against one backward over both passes (PromptStage.split made the identity: the update as it
was) and one pass over every row's [prompt | response] (share_prefix=False):
  * every parameter's gradient, accumulated over two micro-batches (the second adds to .grad), with and
    without gradient checkpointing, fp32, tiny Qwen3 and Llama: held to conftest.assert_to_rounding (the
    fp32 error of the one-backward path, measured against the same update in float64);
  * what waits at the backward's peak (memtrace.track_peak's Grads): one backward keeps every decoder
    weight's response-pass gradient made and waiting for the prompt pass's part; two stages keep none;
  * torch.autograd.grad through the shared prompt is an error (it would miss the prompt pass).
And track_peak telling a parameter's gradient apart, on a weight used once and twice."""

import copy
import json
import sys

import pytest
import torch
from conftest import assert_to_rounding

from data import build_batch
from evaluation import memtrace
from training import policy
from training.model.load import load_model

PROMPTS = [list(range(3, 40)), list(range(60, 71))]  # two prompts, unequal widths (left padding)


def batch(tok, rows=4, R=9, seed=0, prompts=2):
    """`rows` rows of the first `prompts` PROMPTS taken in turn, random responses of R - j mod 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    resp = [torch.randint(3, 250, (R - j % 3,), generator=g).tolist() for j in range(rows)]
    return build_batch(tok, [PROMPTS[j % prompts] for j in range(rows)], resp)


def one_backward(monkeypatch):
    """The update as it was before the two stages: the response pass reads the prompt pass's own tensors."""
    monkeypatch.setattr(policy.PromptStage, "split", staticmethod(lambda held: held))


def grads(model, batches, share, checkpointed):
    """{name: .grad} after forward + backward of each batch in turn (the second adds to .grad)."""
    model.train()
    model.zero_grad(set_to_none=True)
    if checkpointed:
        policy.checkpointing(model)
    for b in batches:
        b = b.to(model.device)
        lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 4, share)
        w = torch.linspace(-1, 1, lp.shape[1], device=lp.device)  # (R,) both signs, unequal
        (lp * b.response_mask[:, b.prompt_width :] * w).sum().backward()
    if checkpointed:
        model.activation_checkpointing_disable()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointed", [True, False])
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_two_stages_give_the_gradients_of_one_backward_and_of_one_full_pass(
    name, checkpointed, device, monkeypatch
):
    torch.manual_seed(0)
    model, tok = load_model(name, device=device, dtype=torch.float32)
    bs = [batch(tok, seed=0), batch(tok, seed=1)]
    staged = grads(model, bs, True, checkpointed)
    full = grads(model, bs, False, checkpointed)
    ref64 = grads(copy.deepcopy(model).to(torch.float64), bs, False, False)
    with monkeypatch.context() as m:
        one_backward(m)
        one = grads(model, bs, True, checkpointed)
    for n, g in one.items():
        assert g.norm() > 0, n  # every weight gets a gradient
        assert_to_rounding(staged[n], g, ref64[n], what=f"{n}, two stages against one backward")
        assert_to_rounding(staged[n], full[n], ref64[n], what=f"{n}, two stages against one full pass")


def waiting_at_the_backward_peak(model, b):
    """memtrace.Grads at the peak of a checkpointed shared-prompt backward whose gradients exist (the
    second micro-batch on), and the peak's bytes."""
    model.train()
    policy.checkpointing(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with memtrace.track_peak(model) as tr:
        lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 8, True)
        loss = (lp * b.response_mask[:, b.prompt_width :]).sum()
        tr.phase("backward")
        loss.backward()
        tr.phase(None)
    model.activation_checkpointing_disable()
    return tr.grads["backward"], tr.peak["backward"]


def test_no_weight_gradient_waits_for_the_prompt_pass(monkeypatch):
    """With one backward over both passes, autograd keeps each decoder weight's response-pass gradient until
    the prompt pass has given its part: at the backward's peak every layer's weights wait (here the peak is
    there: a small batch, so the weights' gradients outweigh what the layers keep). In two stages none waits,
    and the peak is lower by most of those bytes."""
    torch.manual_seed(0)
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    b = batch(tok, rows=2, R=6, prompts=1)
    layers = {n for n, _ in model.named_parameters() if ".layers." in n}
    layer_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n in layers)
    staged, staged_peak = waiting_at_the_backward_peak(model, b)
    with monkeypatch.context() as m:
        one_backward(m)
        one, one_peak = waiting_at_the_backward_peak(model, b)
    assert set(one.params) >= {n for n in layers if ".layers.0." not in n}  # all but the last to finish
    assert one.waiting >= layer_bytes * (model.config.num_hidden_layers - 1) / model.config.num_hidden_layers
    assert not set(staged.params) & layers and staged.waiting < one.waiting / 10
    assert one_peak - staged_peak >= 0.75 * one.waiting  # here 516 of 625 KB: its own peak is elsewhere
    assert staged.grad == one.grad == sum(p.numel() * 4 for p in model.parameters())  # every .grad counted


def test_autograd_grad_through_the_shared_prompt_is_an_error():
    """torch.autograd.grad runs no PromptStage (none of its inputs lies behind one): it would return the
    response pass's part of the gradient as the whole; it raises. Without sharing it runs."""
    torch.manual_seed(0)
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    b = batch(tok)
    w = model.model.layers[0].mlp.up_proj.weight
    model.train()
    lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 4, True)
    with pytest.raises(RuntimeError, match="share_prefix=False"):
        torch.autograd.grad(lp.sum(), [w])
    lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 4, False)
    (g,) = torch.autograd.grad(lp.sum(), [w])
    assert g.norm() > 0


def test_track_peak_tells_a_waiting_gradient_from_grad():
    """A weight read twice: its first part waits in autograd's sum until the second is made, and at the peak
    both are there before their sum (Grads.waiting: two weights' bytes, by its name); read once, nothing
    waits. .grad, resident, is counted apart."""
    lin = torch.nn.Linear(64, 64, bias=False)
    lin.weight.grad = torch.zeros_like(lin.weight)
    x = torch.randn(8, 64)
    for twice, waiting in ((True, 2 * 64 * 64 * 4), (False, 0)):
        with memtrace.track_peak(lin) as tr:
            y = lin(torch.tanh(lin(x))) if twice else lin(torch.tanh(x @ torch.eye(64)))
            tr.phase("backward")
            y.square().sum().backward()
            tr.phase(None)
        g = tr.grads["backward"]
        assert (g.waiting, g.params, g.grad) == (waiting, ("weight",) * bool(waiting), 64 * 64 * 4)


def test_the_gpu_reports_backward_part_reads_the_table_and_the_snapshots_sums(tmp_path):
    """benchmarks/gpu_report.py's backward parts (eval.py memory --measure --snapshot on a GPU) read on the
    CPU: the table's measured lines, as memory.report prints them, and the sums memtrace.save_snapshot
    writes beside the pickle; the goal is met within 3% and short outside it."""
    from conftest import ROOT, SMALL_STEP

    import grpo
    from evaluation import memory
    from training.memory import phases

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_figures

    cfg = grpo.parse_args(SMALL_STEP)
    est = {
        ph: sum(c.values())
        for ph, c in phases.estimate(cfg, phases.model_config(cfg.model), "cpu", 32).items()
    }
    for ratio, met in ((0.98, True), (0.913, False)):  # 0.913: the H200's backward before the two stages
        measured = {ph: v / (ratio if ph == "backward" else 1.0) for ph, v in est.items()}
        log = memory.report(cfg, 32, measured, "cpu")
        summary = {"peak": 62.59e9, "before": 50e9, "rows": [[7.3e9, 252, "MmBackward0 | at::mm | -"]]}
        (tmp_path / "backward.pickle.json").write_text(json.dumps(summary))
        f = gpu_figures.backward_figures("backward")(tmp_path, log)
        assert f["memory"]["backward"]["ratio"] == round(ratio, 3) and f["memory"]["credit"]["ratio"] == 1.0
        assert f["peak_gb"] == 62.59 and f["sites"][0]["site"].startswith("MmBackward0")
        assert gpu_figures.backward_check(f)[1] is met
