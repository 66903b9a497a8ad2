"""Each prompt read once in the update (policy.response_states, share_prompt; policy.py departure 1) against
one pass over every row's [prompt | response] (share_prompt=False): the same log-probs, entropies and
parameter gradients, the same captured attention and flow credit, the fallbacks, and one grpo.py step with
--share-prefix against --no-share-prefix. Tiny random Qwen3 / Llama in fp32 on the CPU."""
import zlib

import pytest
import torch

import flowtracer
import grpo
from flowtracer import capture, select_layers
from training import credit, policy, signals
from training.models import load_model
from training.rollout import build_batch

# Three prompts of different lengths (so different left padding); A and B twice, not adjacent; C alone.
PROMPTS = {"A": "Q: what is 12 + 30? Think, then answer.", "B": "Q: 7*8=?", "C": "Q: name 2+2."}
ROWS = [("A", "so 12 + 30 = 42, answer \\boxed{42}"), ("B", "fifty-six: \\boxed{56}"),
        ("A", "forty-two \\boxed{42} done"), ("C", "\\boxed{4}"), ("B", "seven eights are \\boxed{56} ok")]


@pytest.fixture(params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    torch.manual_seed(0)
    return load_model(request.param, dtype=torch.float32)


def mixed_batch(tok):
    return build_batch(tok, [tok(PROMPTS[p]).input_ids for p, _ in ROWS],
                       [tok(r).input_ids + [tok.eos_token_id] for _, r in ROWS])


def decoder_calls(model, training=None):
    """A list that records the (rows, columns) of each decoder call (only in training mode, or only in eval
    mode, when `training` says), and the hook's handle."""
    calls = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kw: calls.append(tuple(kw["input_ids"].shape if kw.get("input_ids") is not None
                                                 else kw["inputs_embeds"].shape[:2]))
        if training in (None, mod.training) else None, with_kwargs=True)
    return calls, handle


def forward(model, b, share, chunk=4, layers=None):
    """(log-probs, entropies, captured maps or None, capture calls) of token_logprobs, with grad."""
    if layers is None:
        lp, ent = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, chunk, share)
        return lp, ent, None, 0
    with capture(model, b.attention_mask, layers) as cap:
        lp, ent = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, chunk, share)
    return lp, ent, cap.attn, cap.calls


def test_logprobs_and_entropies_equal_one_full_pass(tiny):
    model, tok = tiny
    b = mixed_batch(tok)
    P, T = b.prompt_width, b.input_ids.shape[1]
    assert len(set(b.attention_mask[:, :P].sum(-1).tolist())) == 3             # three padding widths
    calls, handle = decoder_calls(model)
    for mode in ("train", "eval"):                                   # the update; old / ref log-probs
        getattr(model, mode)()
        with torch.set_grad_enabled(mode == "train"):
            lp_full, ent_full = forward(model, b, False)[:2]
            lp, ent = forward(model, b, True)[:2]
        torch.testing.assert_close(lp, lp_full, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, ent_full, rtol=0, atol=1e-5)
        assert lp.shape == (5, T - P)
    handle.remove()
    # full pass: one call over every row; shared: the 3 distinct prompts, then the 5 rows' responses
    assert calls == [(5, T), (3, P), (5, T - P)] * 2


def test_parameter_gradients_equal_one_full_pass(tiny):
    """A GRPO loss (grpo_loss, eq. 5, with unequal gamma and both signs of A): every parameter's gradient."""
    model, tok = tiny
    b = mixed_batch(tok)
    model.train()
    resp = b.response_mask[:, b.prompt_width:]                               # (B, R)
    adv = torch.tensor([1.0, -0.5, -1.0, 0.7, 0.3])
    gamma = resp.float() * (1 + 0.5 * (torch.arange(resp.shape[1]) % 3 == 0))  # (B, R)
    cfg = grpo.Config()
    grads = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        lp = forward(model, b, share)[0]
        old = lp.detach() + 0.1 * torch.sin(torch.arange(lp.numel()).view(lp.shape))  # ratios != 1, clipped
        loss, _ = grpo.grpo_loss(lp, old, adv, gamma, resp, cfg, 5)
        loss.backward()
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, g in grads[False].items():
        assert g.norm() > 0, n                                               # every weight gets a gradient
        assert (grads[True][n] - g).norm() <= 1e-5 * g.norm(), n


@pytest.mark.parametrize("layers", ["middle", "all"])
def test_capture_and_flow_credit_equal_one_full_pass(tiny, layers):
    model, tok = tiny
    b = mixed_batch(tok)
    model.train()
    n = len(select_layers(layers, model.config.num_hidden_layers))
    lp_f, ent_f, attn_f, calls_f = forward(model, b, False, layers=layers)
    lp_s, ent_s, attn_s, calls_s = forward(model, b, True, layers=layers)
    assert calls_f == n and calls_s == 2 * n                          # each chosen layer once in each pass
    torch.testing.assert_close(attn_s, attn_f, rtol=0, atol=1e-6)
    alone = flowtracer.attention_graph(model, b.input_ids, b.attention_mask, layers)   # its own pass
    torch.testing.assert_close(attn_f, alone, rtol=0, atol=1e-6)
    cfg = credit.CreditConfig(credit="flow", layers=layers)
    adv = torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5])
    with torch.no_grad():
        full = credit.assign(model, tok, b, adv, cfg, signals.Captured(attn_f, ent_f))
        shared = credit.assign(model, tok, b, adv, cfg, signals.Captured(attn_s, ent_s))
    assert not full.fallback.any() and (full.gamma == cfg.gamma).any()   # not vacuous: flow reached answers
    torch.testing.assert_close(shared.scores, full.scores, rtol=1e-5, atol=1e-6)
    assert torch.equal(shared.gamma, full.gamma)


def test_a_layer_missing_from_a_pass_is_an_error(monkeypatch):
    """If the response pass took no layer (here: its `seen` set is not reset), the capture says so."""
    model, tok = load_model("tiny-qwen3", dtype=torch.float32)
    b = mixed_batch(tok)

    def expand_only(which, width):
        cap = flowtracer._capture
        buf = cap.buf.new_zeros(len(which), width, width)
        buf[:, :cap.buf.shape[-1], :cap.buf.shape[-1]] = cap.buf[which]
        cap.buf, cap.passes = buf, cap.passes + 1
    monkeypatch.setattr(flowtracer, "expand_prompts", expand_only)
    with pytest.raises(RuntimeError, match=r"captured (\d+) of \1 chosen layers x 2 forward"):
        forward(model, b, True, layers="middle")


def test_fallbacks_run_one_full_pass(tiny):
    """Reentrant gradient checkpointing (it passes no gradient to the prompt's keys, which a layer reads from
    outside its arguments), and a micro-batch whose rows all have their own prompt: one pass over every
    row, the same values."""
    model, tok = tiny
    b = mixed_batch(tok)
    T = b.input_ids.shape[1]
    model.train()
    ref = forward(model, b, False, layers="middle")
    model.activation_checkpointing_enable({"use_reentrant": True})
    calls, handle = decoder_calls(model)
    got = forward(model, b, True, layers="middle")
    assert calls == [(5, T)] and got[3] == ref[3]                     # one pass, each layer captured once
    for x, y in zip(got[:3], ref[:3]):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    model.activation_checkpointing_disable()
    distinct = build_batch(tok, [tok(p).input_ids for p in PROMPTS.values()], [[65, 66], [67], [68, 69, 70]])
    calls.clear()
    forward(model, distinct, True)
    assert calls == [tuple(distinct.input_ids.shape)]
    handle.remove()


def test_one_grpo_step_equals_with_and_without_sharing(tmp_path, monkeypatch):
    """grpo.train, one step on tiny-qwen3 with the fused flow capture, --share-prefix against
    --no-share-prefix: the same loss, gradient norm and new weights. The rollouts are made the same way in
    both (plain HF generate), so only the update differs. The optimizer is plain SGD, so that the new
    weights read the gradient itself (AdamW's first step, g / (|g| + eps), magnifies float noise where
    |g| is near eps)."""
    real = grpo.generate
    monkeypatch.setattr(grpo, "generate", lambda *a, **k: real(*a, **{**k, "share_prefix": False}))
    sgd = lambda model, cfg, device: torch.optim.SGD(model.parameters(), lr=cfg.lr)   # noqa: E731
    monkeypatch.setattr(policy, "make_optimizer", sgd)
    monkeypatch.setattr(grpo.data, "score", lambda rec, txt: zlib.crc32(txt.encode()) % 4 / 3)
    flags = ["--model", "tiny-qwen3", "--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4",
             "--max-new-tokens", "12", "--steps", "1", "--lr", "1e-3", "--warmup-steps", "0",
             "--no-grad-checkpointing", "--save-every", "5", "--rollouts-every", "5"]
    runs = {}
    for share in ("--share-prefix", "--no-share-prefix"):
        cfg = grpo.parse_args([*flags, share, "--out-dir", str(tmp_path / share)])
        run = grpo.setup(cfg)
        calls, _ = decoder_calls(run.model, training=True)             # the update's forwards
        before = {k: v.detach().clone() for k, v in run.model.named_parameters()}
        m = grpo.train(cfg, run)[0]
        runs[share] = (m, {k: v.detach() - before[k] for k, v in run.model.named_parameters()}, calls)
    (a, da, calls_a), (b, db, calls_b) = runs["--share-prefix"], runs["--no-share-prefix"]
    assert a["rows/trained"] == b["rows/trained"] > 0
    assert len(calls_a) > len(calls_b)                             # a prompt pass of its own: shared
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    num = sum((da[k] - db[k]).pow(2).sum() for k in da).sqrt()
    # 1e-4: the advantages of a group sum to 0, so the gradient is a difference of near-equal terms; float
    # noise alone (regrouping the same rows into micro-batches of 2 or 8, unshared) moves it by a few 1e-5
    assert num / sum(d.pow(2).sum() for d in db.values()).sqrt() < 1e-4
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


def update_under_checkpointing(model, tok, b, share):
    """The fused update of one micro-batch with gradient checkpointing on (non-reentrant, as
    policy.load_policy enables it): (log-probs, entropies, captured maps, flow credit, every parameter's
    gradient, the decoder calls) of token_logprobs under a capture, credit.assign and a GRPO loss."""
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.zero_grad(set_to_none=True)
    calls, handle = decoder_calls(model)
    lp, ent, attn, n = forward(model, b, share, layers="middle")
    adv = torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5])
    with torch.no_grad():
        c = credit.assign(model, tok, b, adv, credit.CreditConfig(credit="flow"), signals.Captured(attn, ent))
    old = lp.detach() + 0.1 * torch.sin(torch.arange(lp.numel()).view(lp.shape))  # ratios != 1, clipped
    loss, _ = grpo.grpo_loss(lp, old, adv, c.gamma, b.response_mask[:, b.prompt_width:], grpo.Config(), 5)
    loss.backward()
    handle.remove()
    model.activation_checkpointing_disable()
    return lp, ent, attn, c, {k: p.grad.clone() for k, p in model.named_parameters()}, calls


@pytest.mark.parametrize("name", ["tiny-qwen3", "smollm2-135m"])
def test_checkpointed_update_shares_each_prompt_and_equals_one_full_pass(name):
    """Under gradient checkpointing the decoder layers read the shared prompt's keys and values on their
    replay in backward (PromptKV): each prompt read once, and the log-probs, entropies, captured maps, flow
    credit and every parameter's gradient equal one checkpointed full pass's."""
    torch.manual_seed(0)
    model, tok = load_model(name, dtype=torch.float32)
    b = mixed_batch(tok)
    P, T = b.prompt_width, b.input_ids.shape[1]
    lp_f, ent_f, attn_f, c_f, g_f, calls_f = update_under_checkpointing(model, tok, b, False)
    lp_s, ent_s, attn_s, c_s, g_s, calls_s = update_under_checkpointing(model, tok, b, True)
    assert calls_f == [(5, T)] and calls_s == [(3, P), (5, T - P)]   # shared under checkpointing too
    torch.testing.assert_close(lp_s, lp_f, rtol=1e-5, atol=1e-5)      # float noise over 30 layers: ~6e-6
    torch.testing.assert_close(ent_s, ent_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn_s, attn_f, rtol=0, atol=1e-6)
    assert not c_f.fallback.all() and (c_f.gamma == 1.5).any()        # not vacuous: flow reached answers
    torch.testing.assert_close(c_s.scores, c_f.scores, rtol=1e-5, atol=1e-6)
    assert torch.equal(c_s.gamma, c_f.gamma)
    for k, g in g_f.items():
        assert g.norm() > 0, k                                         # every weight gets a gradient
        assert (g_s[k] - g).norm() <= 1e-5 * g.norm(), k


def test_checkpointed_shared_update_holds_less_memory():
    """The peak live tensor bytes (memtrace.track_peak) of a checkpointed update's forward + backward on 4
    rows of one 120-token prompt: lower with each prompt read once than with one full pass (sharing keeps
    the prompt's layer inputs and keys once, not 4 times)."""
    from evaluation.memtrace import track_peak
    torch.manual_seed(0)
    model, tok = load_model("tiny-qwen3", dtype=torch.float32)
    prompt = torch.randint(3, 200, (120,)).tolist()
    b = build_batch(tok, [prompt] * 4, [torch.randint(3, 200, (20 - j,)).tolist() for j in range(4)])
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    peak = {}
    for share in (False, True, False, True):
        model.zero_grad(set_to_none=True)
        with track_peak(model) as tr:
            tr.phase("update")
            lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 8, share)
            (lp * b.response_mask[:, b.prompt_width:]).sum().backward()
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
    _, tok = load_model("tiny-qwen3", dtype=torch.float32)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=16384, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, tie_word_embeddings=True, pad_token_id=256,
                                         eos_token_id=259))
    prompt = torch.randint(3, 200, (160,)).tolist()
    b = build_batch(tok, [prompt] * 4, [torch.randint(3, 200, (12 - j,)).tolist() for j in range(4)])
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    peak = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        with track_peak(model) as tr:
            tr.phase("update")
            lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 8, share)
            (lp * b.response_mask[:, b.prompt_width:]).sum().backward()
            del lp
        peak[share] = tr.peak["update"]
    assert peak[True] <= peak[False]
