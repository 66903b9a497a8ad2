"""Each prompt read once in the update (policy.response_states, share_prefix; policy.py dep. 1) against
one pass over every row's [prompt | response] (share_prefix=False): the same log-probs, entropies and
parameter gradients, the same captured attention and flow credit, the fallbacks, and one grpo.py step with
--share-prefix against --no-share-prefix. Tiny random Qwen3 / Llama in fp32, on each device present (cpu, and
cuda where there is one: conftest.DEVICES), inputs on model.device.

Tolerances: the two paths are two fp32 roundings of the same values, so each comparison is held to the error
scale of this computation on this machine, measured against the full pass in float64 (a copy of the model in
fp64): ||shared - full|| <= 4 ||full - fp64|| + 2 eps ||fp64|| (conftest.assert_to_rounding, which says why).
token_logprobs takes its log-softmax in fp32 by design (head(h).float()), so the "fp64" reference is fp64 up
to the logits and fp32 after them: its error there is one fp32 rounding of the log-softmax, which the 2 eps
term and the measured scale cover. The maps are fp32 by design too (flowtracer.add_head_mean casts Q and K):
their reference is the fp32 softmax of fp64 queries and keys."""

import copy

import pytest
import torch
from conftest import assert_to_rounding, flat, grpo_steps

import flowtracer
import grpo
from data import build_batch
from flowtracer import Capture, select_layers
from training import policy
from training.credit import attention, baselines, scoring
from training.model import trainable
from training.model.load import load_model

# Three prompts of different lengths (so different left padding); A and B twice, not adjacent; C alone.
PROMPTS = {"A": "Q: what is 12 + 30? Think, then answer.", "B": "Q: 7*8=?", "C": "Q: name 2+2."}
ROWS = [
    ("A", "so 12 + 30 = 42, answer \\boxed{42}"),
    ("B", "fifty-six: \\boxed{56}"),
    ("A", "forty-two \\boxed{42} done"),
    ("C", "\\boxed{4}"),
    ("B", "seven eights are \\boxed{56} ok"),
]


@pytest.fixture(params=["tiny-qwen3", "tiny-llama"])
def tiny(request, device):
    torch.manual_seed(0)
    return load_model(request.param, device=device, dtype=torch.float32)


def mixed_batch(tok, device="cpu"):
    return build_batch(
        tok,
        [tok(PROMPTS[p]).input_ids for p, _ in ROWS],
        [tok(r).input_ids + [tok.eos_token_id] for _, r in ROWS],
    ).to(device)


def fp64(model):
    """The reference: the same weights in float64 (RoPE's frequencies too), on the same device."""
    return copy.deepcopy(model).to(torch.float64)


def decoder_calls(model, training=None):
    """A list that records the (rows, columns) of each decoder call (only in training mode, or only in eval
    mode, when `training` says), and the hook's handle."""
    calls = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kw: (
            calls.append(
                tuple(
                    kw["input_ids"].shape
                    if kw.get("input_ids") is not None
                    else kw["inputs_embeds"].shape[:2]
                )
            )
            if training in (None, mod.training)
            else None
        ),
        with_kwargs=True,
    )
    return calls, handle


def forward(model, b, share, chunk=4, layers=None):
    """(log-probs, entropies, captured maps or None, capture calls) of token_logprobs, with grad."""
    if layers is None:
        lp, ent = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, chunk, share)
        return lp, ent, None, 0
    attention.use_capture_attention(model)  # as trainable.load_policy
    calls = []  # head-mean maps summed
    cap = Capture(
        select_layers(layers, model.config.num_hidden_layers),  # given to the forward
        head_mean=lambda *a: (calls.append(1), flowtracer.add_head_mean(*a))[1],
    )
    lp, ent = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, chunk, share, cap)
    return lp, ent, cap.maps(b.attention_mask), len(calls)


def test_logprobs_and_entropies_equal_one_full_pass(tiny):
    model, tok = tiny
    b = mixed_batch(tok, model.device)
    P, T = b.prompt_width, b.input_ids.shape[1]
    assert len(set(b.attention_mask[:, :P].sum(-1).tolist())) == 3  # three padding widths
    with torch.no_grad():
        lp64, ent64 = forward(fp64(model), b, False)[:2]
    calls, handle = decoder_calls(model)
    for mode in ("train", "eval"):  # the update; old / ref log-probs
        getattr(model, mode)()
        with torch.set_grad_enabled(mode == "train"):
            lp_full, ent_full = forward(model, b, False)[:2]
            lp, ent = forward(model, b, True)[:2]
        assert_to_rounding(lp, lp_full, lp64, what=f"log-probs, {mode}")
        assert_to_rounding(ent, ent_full, ent64, what=f"entropies, {mode}")
        assert lp.shape == (5, T - P)
    handle.remove()
    # full pass: one call over every row; shared: the 3 distinct prompts, then the 5 rows' responses
    assert calls == [(5, T), (3, P), (5, T - P)] * 2


def test_parameter_gradients_equal_one_full_pass(tiny):
    """A GRPO loss (grpo_loss, eq. 5, with unequal gamma and both signs of A): every parameter's gradient."""
    model, tok = tiny
    b = mixed_batch(tok, model.device)
    resp = b.response_mask[:, b.prompt_width :]  # (B, R)
    adv = torch.tensor([1.0, -0.5, -1.0, 0.7, 0.3], device=model.device)
    gamma = resp.float() * (1 + 0.5 * (torch.arange(resp.shape[1], device=model.device) % 3 == 0))  # (B, R)
    cfg = grpo.Config()
    grads = {}
    for share, m in ((False, model), (True, model), ("fp64", fp64(model))):
        m.train()
        m.zero_grad(set_to_none=True)
        lp = forward(m, b, share is True)[0]
        old = lp.detach() + 0.1 * torch.sin(torch.arange(lp.numel(), device=lp.device).view(lp.shape))  # != 1
        loss, _ = grpo.grpo_loss(lp, grpo.Experience(adv, gamma, resp, old, None, 5), cfg)  # clipped and not
        loss.backward()
        grads[share] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for n, g in grads[False].items():
        assert g.norm() > 0, n  # every weight gets a gradient
        assert_to_rounding(grads[True][n], g, grads["fp64"][n], what=n)


@pytest.mark.parametrize("layers", ["middle", "all"])
def test_capture_and_flow_credit_equal_one_full_pass(tiny, layers):
    model, tok = tiny
    b = mixed_batch(tok, model.device)
    model.train()
    n = len(select_layers(layers, model.config.num_hidden_layers))
    lp_f, ent_f, attn_f, calls_f = forward(model, b, False, layers=layers)
    lp_s, ent_s, attn_s, calls_s = forward(model, b, True, layers=layers)
    ref = fp64(model)
    with torch.no_grad():
        lp64, ent64, attn64, _ = forward(ref, b, False, layers=layers)
    assert calls_f == n and calls_s == 2 * n  # each chosen layer once in each pass
    assert_to_rounding(attn_s, attn_f, attn64, what="maps")
    alone = attention.attention_graph(model, b.input_ids, b.attention_mask, layers)  # its own pass
    assert_to_rounding(alone, attn_f, attn64, what="attention_graph's maps")
    cfg = grpo.Config(credit="flow", layers=layers)
    adv = torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5], device=model.device)
    with torch.no_grad():
        full = baselines.assign(model, tok, b, adv, cfg, scoring.ForwardOutputs(attn_f, ent_f))
        shared = baselines.assign(model, tok, b, adv, cfg, scoring.ForwardOutputs(attn_s, ent_s))
        exact = baselines.assign(ref, tok, b, adv, cfg, scoring.ForwardOutputs(attn64, ent64))
    assert not full.fallback.any() and (full.weight == cfg.gamma).any()  # not vacuous: flow reached answers
    assert_to_rounding(shared.scores, full.scores, exact.scores, what="flow scores")
    assert torch.equal(shared.weight, full.weight)


def test_a_layer_missing_from_a_pass_is_an_error(monkeypatch, device):
    """If a pass takes not every chosen layer (here: the first chosen layer is skipped), the capture says so,
    in the prompt pass (policy.response_states checks it) as in the response pass (Capture.maps)."""
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    b = mixed_batch(tok, model.device)
    real = flowtracer.Capture.take
    skip = min(select_layers("middle", model.config.num_hidden_layers))
    monkeypatch.setattr(
        flowtracer.Capture, "take", lambda cap, layer, *a: None if layer == skip else real(cap, layer, *a)
    )
    for share in (True, False):
        with pytest.raises(RuntimeError, match=r"captured (\d+) of (\d+) chosen layers"):
            forward(model, b, share, layers="middle")


def test_fallbacks_run_one_full_pass(tiny):
    """Reentrant gradient checkpointing (it passes no gradient to the prompt's keys, which a layer reads from
    outside its arguments), and a micro-batch whose rows all have their own prompt: one pass over every
    row, the same values."""
    model, tok = tiny
    b = mixed_batch(tok, model.device)
    T = b.input_ids.shape[1]
    model.train()
    ref = forward(model, b, False, layers="middle")
    with torch.no_grad():
        exact = forward(fp64(model), b, False, layers="middle")
    policy.checkpointing(model, reentrant=True)
    calls, handle = decoder_calls(model)
    got = forward(model, b, True, layers="middle")
    assert calls == [(5, T)] and got[3] == ref[3]  # one pass, each layer captured once
    for x, y, z, what in zip(got[:3], ref[:3], exact[:3], ("log-probs", "entropies", "maps")):
        assert_to_rounding(x, y, z, what=what)
    model.activation_checkpointing_disable()
    distinct = build_batch(
        tok, [tok(p).input_ids for p in PROMPTS.values()], [[65, 66], [67], [68, 69, 70]]
    ).to(model.device)
    calls.clear()
    forward(model, distinct, True)
    assert calls == [tuple(distinct.input_ids.shape)]
    handle.remove()


def test_one_grpo_step_equals_with_and_without_sharing(tmp_path, monkeypatch, device):
    """grpo.train, one step on tiny-qwen3 with the fused flow capture, --share-prefix against
    --no-share-prefix: the same loss, gradient norm and new weights, to rounding (conftest.grpo_steps: fp32,
    autocast off, the same rollouts and rewards in both; the --no-share-prefix step in fp64 is the error
    scale). The optimizer is plain SGD, so that the new weights read the gradient itself (AdamW's first step,
    g / (|g| + eps), magnifies float noise where |g| is near eps)."""
    sgd = lambda model, cfg, device: torch.optim.SGD(model.parameters(), lr=cfg.lr)  # noqa: E731
    monkeypatch.setattr(trainable, "make_optimizer", sgd)
    flags = [
        "--model",
        "tiny-qwen3",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--micro-batch",
        "4",
        "--max-new-tokens",
        "12",
        "--steps",
        "1",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "0",
        "--no-grad-checkpointing",
        "--save-every",
        "5",
        "--rollouts-every",
        "5",
    ]
    runs = grpo_steps(
        monkeypatch,
        device,
        [
            (name, [*flags, share, "--out-dir", str(tmp_path / name)], name == "fp64")
            for name, share in (
                ("shared", "--share-prefix"),
                ("full", "--no-share-prefix"),
                ("fp64", "--no-share-prefix"),
            )
        ],
        watch=lambda run: decoder_calls(run.policy.model, training=True)[0],
    )  # the update's forwards
    (a, da, calls_a), (b, db, calls_b), (x, dx, _) = runs["shared"], runs["full"], runs["fp64"]
    assert a["rows/trained"] == b["rows/trained"] == x["rows/trained"] > 0
    assert len(calls_a) > len(calls_b)  # a prompt pass of its own: shared
    for k in ("loss", "grad_norm"):
        assert_to_rounding(
            torch.tensor(a[k]), torch.tensor(b[k]), torch.tensor(x[k], dtype=torch.float64), what=k
        )
    assert_to_rounding(flat(da).float(), flat(db).float(), flat(dx), what="the update")
    assert max(d.abs().max() for d in da.values()) > 0


def test_update_benchmark_runs_and_both_paths_agree():
    """benchmarks/generate_speed.py --update end to end on tiny-qwen3: both forwards timed, same log-probs."""
    import importlib.util as iu
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "generate_speed.py"
    spec = iu.spec_from_file_location("generate_speed", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--model", "tiny-qwen3", "--rounds", "1", "--update"])
    assert out["same"] and all(v > 0 for k in ("wall", "cpu") for v in out[k].values())


def update_under_checkpointing(model, tok, b, share, gamma=None, checkpointed=True):
    """The fused update of one micro-batch with gradient checkpointing on (non-reentrant, as
    trainable.load_policy enables it): (log-probs, entropies, captured maps, flow credit, every parameter's
    gradient, the decoder calls) of token_logprobs under a capture, baselines.assign and a GRPO loss. `gamma`:
    weigh the loss with these instead of the credit's (the fp64 reference takes the fp32 run's, so that it
    computes the same loss); checkpointed=False: the same values, computed once (the reference)."""
    model.train()
    if checkpointed:
        policy.checkpointing(model)
    model.zero_grad(set_to_none=True)
    calls, handle = decoder_calls(model)
    lp, ent, attn, n = forward(model, b, share, layers="middle")
    adv = torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5], device=lp.device)
    with torch.no_grad():
        c = baselines.assign(
            model, tok, b, adv, grpo.Config(credit="flow"), scoring.ForwardOutputs(attn, ent)
        )
    old = lp.detach() + 0.1 * torch.sin(torch.arange(lp.numel(), device=lp.device).view(lp.shape))  # r != 1
    w = c.weight if gamma is None else gamma  # (B, R)
    loss, _ = grpo.grpo_loss(
        lp, grpo.Experience(adv, w, b.response_mask[:, b.prompt_width :], old, None, 5), grpo.Config()
    )
    loss.backward()
    handle.remove()
    if checkpointed:
        model.activation_checkpointing_disable()
    return lp, ent, attn, c, {k: p.grad.clone() for k, p in model.named_parameters()}, calls


@pytest.mark.parametrize("name", ["tiny-qwen3", pytest.param("smollm2-135m", marks=pytest.mark.smollm2)])
def test_checkpointed_update_shares_each_prompt_and_equals_one_full_pass(name, device):
    """Under gradient checkpointing the decoder layers read the shared prompt's keys and values on their
    replay in backward (PromptKV): each prompt read once, and the log-probs, entropies, captured maps, flow
    credit and every parameter's gradient equal one checkpointed full pass's, to rounding: held to
    4 x the fp32 error of the full pass, measured against the same update in float64 (computed once,
    without checkpointing, which changes no value), plus 2 eps of the value (conftest.assert_to_rounding).
    A trial-set bound (1e-5 of the norm) held on one CPU and not another's (SmolLM2's layer-20 norm weight:
    3.2e-6 against 2.1e-6): the rounding of 30 layers depends on the machine's kernels, the bound now too."""
    torch.manual_seed(0)
    model, tok = load_model(name, device=device, dtype=torch.float32)
    b = mixed_batch(tok, model.device)
    P, T = b.prompt_width, b.input_ids.shape[1]
    lp_f, ent_f, attn_f, c_f, g_f, calls_f = update_under_checkpointing(model, tok, b, False)
    lp_s, ent_s, attn_s, c_s, g_s, calls_s = update_under_checkpointing(model, tok, b, True)
    assert calls_f == [(5, T)] and calls_s == [(3, P), (5, T - P)]  # shared under checkpointing too
    lp_x, ent_x, attn_x, c_x, g_x, _ = update_under_checkpointing(
        fp64(model), tok, b, False, c_f.weight, checkpointed=False
    )
    del model
    assert_to_rounding(lp_s, lp_f, lp_x, what="log-probs")
    assert_to_rounding(ent_s, ent_f, ent_x, what="entropies")
    assert_to_rounding(attn_s, attn_f, attn_x, what="maps")
    assert not c_f.fallback.all() and (c_f.weight == 1.5).any()  # not vacuous: flow reached answers
    assert_to_rounding(c_s.scores, c_f.scores, c_x.scores, what="flow scores")
    assert torch.equal(c_s.weight, c_f.weight)
    for k, g in g_f.items():
        assert g.norm() > 0, k  # every weight gets a gradient
        assert_to_rounding(g_s[k], g, g_x[k], what=k)


def test_checkpointed_shared_update_holds_less_memory(device):
    """The peak live tensor bytes (memtrace.track_peak, which counts storages on any device) of a
    checkpointed update's forward + backward on 4 rows of one 120-token prompt: lower with each prompt read
    once than with one full pass (sharing keeps the prompt's layer inputs and keys once, not 4 times)."""
    from evaluation.memtrace import track_peak

    torch.manual_seed(0)
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    prompt = torch.randint(3, 200, (120,)).tolist()
    b = build_batch(tok, [prompt] * 4, [torch.randint(3, 200, (20 - j,)).tolist() for j in range(4)])
    b = b.to(model.device)
    model.train()
    policy.checkpointing(model)
    peak = {}
    for share in (False, True, False, True):
        model.zero_grad(set_to_none=True)
        with track_peak(model) as tr:
            tr.phase("update")
            lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 8, share)
            (lp * b.response_mask[:, b.prompt_width :]).sum().backward()
        peak[share] = tr.peak["update"]
        del lp
    assert peak[True] < peak[False]


def test_checkpointed_shared_update_peak_not_above_the_full_pass_with_tied_embeddings():
    """A tied embedding (Qwen3-4B's, SmolLM2's) gets a dense (V, D) gradient from each lookup, summed into
    its gradient late in backward. With each prompt read once, the update's peak (memtrace.track_peak,
    forward + backward, checkpointed) is not above one full pass's: prompts and responses are embedded in
    one lookup, whose sum runs after the prompt pass's kept tensors are freed (a lookup per pass put the
    response pass's sum beside them: here 23.6 MB against the full pass's 22.6, at SmolLM2's few-shot
    shape +5%)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from evaluation.memtrace import track_peak

    _, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=16384,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            pad_token_id=256,
            eos_token_id=259,
        )
    )
    prompt = torch.randint(3, 200, (160,)).tolist()
    b = build_batch(tok, [prompt] * 4, [torch.randint(3, 200, (12 - j,)).tolist() for j in range(4)])
    model.train()
    policy.checkpointing(model)
    peak = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        with track_peak(model) as tr:
            tr.phase("update")
            lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 8, share)
            (lp * b.response_mask[:, b.prompt_width :]).sum().backward()
            del lp
        peak[share] = tr.peak["update"]
    assert peak[True] <= peak[False]
