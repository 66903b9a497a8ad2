"""The fused credit pass and the one-pass on-policy update equal their two-pass references (one forward
for loss and credit). Tiny random Qwen3 / Llama in fp32 on each device present (cpu, and cuda where there is
one: conftest.DEVICES), gradient checkpointing on and off; inputs on model.device.

Tolerances, fp32: the fused and the separate pass compute the same maps and entropies with the same fp32
kernels from the same weights, once in a training forward and once in a no-grad one (on CUDA sdpa may pick
another kernel for each); the credit scores of the two are held to rounding against the scores of the
same batch in float64 (conftest.assert_to_rounding)."""

import copy
import zlib
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, assert_to_rounding

import flowtracer
import grpo
from data import build_batch
from flowtracer import Capture, select_layers
from training import policy
from training.credit import baselines, scoring
from training.credit.attention import attention_graph, capturing, use_capture_attention
from training.model.load import load_model
from training.run import log
from training.run.setup import load_for_update


def batch_with_answers(tok):
    """Four rows, each ending in a \\boxed{} answer, so that flow has a target (no fallback)."""
    prompts = ["Q: 2+2=?", "Q: what is 10-3?", "Q: 1+1?", "Q: 9*9?"]
    responses = [
        "so it is 4, answer \\boxed{4} ok",
        "ten minus three is seven: \\boxed{7}",
        "one and one: \\boxed{2}",
        "nine nines, eighty-one, so \\boxed{81}",
    ]
    return build_batch(
        tok, [tok(p).input_ids for p in prompts], [tok(r).input_ids + [tok.eos_token_id] for r in responses]
    )


@pytest.fixture(params=["tiny-qwen3", "tiny-llama"])
def tiny(request, device):
    torch.manual_seed(0)
    return load_model(request.param, device=device, dtype=torch.float32)


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("name", ["flow", "attention", "entropy"])
def test_fused_scores_equal_separate(tiny, name, ckpt):
    model, tok = tiny
    b = batch_with_answers(tok).to(model.device)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=model.device)
    cfg = grpo.Config(credit=name, layers="all" if name != "flow" else "middle")
    sep = baselines.assign(model, tok, b, adv, cfg)  # its own no-grad pass
    exact = baselines.assign(copy.deepcopy(model).double(), tok, b, adv, cfg)  # the same pass in fp64
    if ckpt:
        policy.checkpointing(model)
    model.train()
    calls = []
    real = flowtracer.add_head_mean
    flowtracer.add_head_mean = lambda *a: (calls.append(1), real(*a))[1]
    try:
        use_capture_attention(model)  # as trainable.load_policy
        cap = Capture(select_layers(cfg.layers, model.config.num_hidden_layers))  # as grpo.update
        logp, ent = grpo.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, capture=cap)
        with torch.no_grad():
            fused = baselines.assign(
                model, tok, b, adv, cfg, scoring.ForwardOutputs(cap.maps(b.attention_mask), ent)
            )
        (logp * b.response_mask[:, b.prompt_width :]).sum().backward()  # recomputation, if checkpointing
    finally:
        flowtracer.add_head_mean = real
    n_layers = len(select_layers(cfg.layers, model.config.num_hidden_layers))
    assert len(cap.seen) == n_layers and len(calls) == n_layers  # once per layer, not in backward
    assert not sep.fallback.any()
    assert_to_rounding(fused.scores, sep.scores, exact.scores, what=f"{name} scores")
    assert torch.equal(fused.weight, sep.weight) and torch.equal(fused.fallback, sep.fallback)
    assert (sep.weight == cfg.gamma).any()  # the comparison is not vacuous


@pytest.mark.parametrize("share", [True, False])
def test_update_own_flow_lines_equal_credit_assign(share):
    """grpo.update's own lines for the paper's credit (Capture -> token_logprobs -> trace_flow -> flow_credit,
    fused into the training forward) give the record the separate path gives (--credit-pass separate:
    baselines.OtherCredit -> baselines.assign, a no-grad attention_graph pass of its own): the same weight, to
    the bit;
    the same fallbacks; the throughput scores to fp32 rounding of the maps (atol 1e-6 on scores in [0, 2])."""
    flags = [
        "--model",
        "tiny-qwen3",
        "--device",
        "cpu",
        "--micro-batch",
        "2",
        "--no-grad-checkpointing",
        *([] if share else ["--no-share-prefix"]),
    ]
    out = {}
    for credit_pass in ("fused", "separate"):
        cfg = grpo.parse_args([*flags, "--credit-pass", credit_pass])
        run = load_for_update(cfg, torch.device("cpu"))  # the model as setup loads it (seeded)
        tok = run.policy.tok
        b = build_batch(
            tok,
            [tok("Q: 2+2=?").input_ids] * 2 + [tok("Q: 9*9?").input_ids] * 2,  # 2 groups
            [
                tok(r).input_ids
                for r in (
                    "so it is 4, answer \\boxed{4} ok",
                    "four: \\boxed{4}",
                    "nine nines, so \\boxed{81}",
                    "\\boxed{18} it is",
                )
            ],
        )
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        out[credit_pass] = grpo.update(run, b, [0, 1, 2, 3], adv, log.Clock("cpu"))
    fused, sep = out["fused"], out["separate"]
    assert torch.equal(fused.weight, sep.weight) and (sep.weight == 1.5).any()  # not vacuous
    assert fused.stats["credit/fallback"] == sep.stats["credit/fallback"] < 4
    torch.testing.assert_close(fused.scores, sep.scores, rtol=0, atol=1e-6)


def test_capture_equals_attention_graph_and_leaves_output_unchanged(tiny):
    """The capture (a pre-hook on the decoder) and attention_graph's own pass run the same forward: the same
    maps; and the capture leaves the model's output as sdpa gives it: equal logits (the same kernels)."""
    model, tok = tiny
    b = batch_with_answers(tok).to(model.device)
    ref = attention_graph(model, b.input_ids, b.attention_mask, "all")
    pos = (b.attention_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        plain = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
        with capturing(model, b.attention_mask, "all") as cap:
            captured = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    # 1e-6: the maps are means of probabilities in [0, 1]; the two passes run the same fp32 ops on the same
    # inputs (eval mode, no grad, both), so they differ at most by a few roundings of 1 (eps = 1.2e-7)
    torch.testing.assert_close(cap.attn, ref, rtol=0, atol=8 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(captured, plain, rtol=0, atol=1e-6)  # sdpa's output, unchanged


@pytest.mark.parametrize(
    "bad, match", [(torch.tensor([[0, 2, 1]]), "only 0 and 1"), (torch.tensor([[0, 0, 0]]), "no valid token")]
)
def test_attention_graph_rejects_bad_masks(bad, match):
    model, _ = load_model("tiny-qwen3", device="cpu")
    with pytest.raises(ValueError, match=match):
        attention_graph(model, torch.tensor([[5, 6, 7]]), bad)
    with pytest.raises(ValueError, match="chunk"):
        attention_graph(model, torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), chunk=0)


# ----------------------------------------------------------------------------- on-policy: one pass == two
SMOKE = [*TINY_RUN, "--max-new-tokens", "10", "--micro-batch", "3", "--steps", "1", "--seed", "5"]


def one_step(tmp_path, monkeypatch, two_pass, extra=()):
    """Loss and every gradient of the first epoch of one grpo.train step; two_pass runs --num-iterations 2,
    whose old-log-prob pass comes first, at an lr too small to move a weight between the two epochs: the
    first epoch is then on-policy's one pass, with old log pi from a pass of its own."""
    grads, real_clip = {}, torch.nn.utils.clip_grad_norm_

    def spy(params, *a, **k):  # the first clip of the step: the first epoch's gradients
        params = list(params)
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in zip(names, params)})
        return real_clip(params, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: zlib.crc32(txt.encode()) % 4 / 3)  # varies
    out = tmp_path / ("two" if two_pass else "one")
    cfg = grpo.parse_args(
        [*SMOKE, *extra, "--out-dir", str(out)]
        + (["--num-iterations", "2", "--lr", "1e-30"] if two_pass else [])
    )
    run = grpo.setup(cfg)
    names = [n for n, _ in run.policy.model.named_parameters()]
    m = grpo.train(cfg, run).history[0]
    return {**m, "loss": m["loss"] / cfg.num_iterations}, grads  # the epochs' mean: the first's, here


@pytest.mark.parametrize("extra", [("--credit", "none"), ("--credit", "flow", "--grad-checkpointing")])
def test_on_policy_one_pass_equals_two_pass(tmp_path, monkeypatch, extra):
    m1, g1 = one_step(tmp_path, monkeypatch, False, extra)
    m2, g2 = one_step(tmp_path, monkeypatch, True, extra)
    assert m1["rows/trained"] > 0 and m1["grad_norm"] > 0  # something was trained
    assert abs(m1["loss"] - m2["loss"]) <= 1e-6
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=0, atol=1e-6, msg=k)


def test_fused_and_separate_pass_train_the_same(tmp_path, monkeypatch):
    """End to end, with boxed answers forced into the rollouts: --credit-pass fused and separate give the
    same gamma, loss and gradients."""
    real_gen = grpo.generate

    def boxed(*a, **k):  # append an answer so that flow has a target
        g = real_gen(*a, **k)
        tok = a[1]
        extra = tok("\\boxed{7}").input_ids
        return g._replace(response_ids=[r[:-1] + extra + r[-1:] if r else extra for r in g.response_ids])

    monkeypatch.setattr(grpo, "generate", boxed)
    ma, ga = one_step(tmp_path / "a", monkeypatch, False, ("--credit", "flow", "--credit-pass", "fused"))
    mb, gb = one_step(tmp_path / "b", monkeypatch, False, ("--credit", "flow", "--credit-pass", "separate"))
    assert ma["credit/boosted_frac"] > 0 and ma["credit/fallback"] < ma["rows/trained"]
    for k in ("loss", "credit/boosted_frac", "credit/fallback", "grad_norm"):
        assert ma[k] == pytest.approx(mb[k], abs=1e-6), k
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=0, atol=1e-6, msg=k)


def test_credit_overhead_benchmark_runs_alternating(tmp_path, capsys):
    """The Table 6 tool end to end on the tiny model: every configuration timed, ratios against the first."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "credit_overhead", Path(grpo.__file__).parent / "benchmarks" / "credit_overhead.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    med = bench.main(
        [
            "--signals",
            "none",
            "flow",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--model",
            "tiny-qwen3",
            "--device",
            "cpu",
            "--max-new-tokens",
            "8",
            "--prompts-per-step",
            "2",
            "--json",
            str(tmp_path / "o.json"),
        ]
    )
    out = capsys.readouterr().out
    assert set(med) == {"none", "flow"} and out.count("round ") == 2 and "step ratio" in out
    assert all(d["time/step"] > 0 and d["tok/s"] > 0 for d in med.values())
    rows = __import__("json").loads((tmp_path / "o.json").read_text())["rows"]
    assert len(rows["flow"]) == 1  # 1 round x 1 counted step
