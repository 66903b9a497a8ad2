"""flowtracer.py: hand-computed toy DAGs, a loop reference taken straight from eq. 2-4, and properties;
flowtracer.Capture refuses what it cannot do right (a second forward, a mask of another shape, no layer) while
gradient checkpointing's replay still works; head_mean_kernel takes the fused kernel only where it can run.
The answer region: tests/tasks/test_answer_region.py; build_batch: tests/test_data.py."""

import math
from fractions import Fraction as Fr

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowtracer
from flowtracer import Capture, dag_weights, flow_credit, reweight, select_layers, trace_flow
from gpu_kernels import availability
from training import policy
from training.credit.attention import use_capture_attention
from training.model.load import load_model


# ----------------------------------------------------------------------------- reference (loops)
def reference_flow(attn, q, a):
    """Per-token loops, eq. 2-4 as printed. Works on exact Fractions or floats. Returns h, W', f, tau."""
    T = len(q)
    W = [[attn[k][i] if i < k else 0 for k in range(T)] for i in range(T)]  # eq. 1
    h = [0] * T
    for i in reversed(range(T)):  # eq. 2
        h[i] = 1 if a[i] else sum(W[i][k] * h[k] for k in range(i + 1, T))
    # eq. 3
    Wp = [[W[i][k] * h[k] / h[i] if (h[i] > 0 and not a[i]) else 0 for k in range(T)] for i in range(T)]
    src = [i for i in range(T) if q[i] and h[i] > 0]
    f = [0] * T
    for k in range(T):  # eq. 4
        f[k] = (Fr(1, len(src)) if isinstance(h[0], Fr) else 1 / len(src)) * (k in src) if src else 0
        f[k] += sum(f[i] * Wp[i][k] for i in range(k))
    tau = [f[k] + sum(f[k] * Wp[k][j] for j in range(k + 1, T)) for k in range(T)]
    return h, Wp, f, tau


def attn_from_edges(T, edges):
    """attn[k][i] = W_ik for the given DAG edges {(i, k): w}; the diagonal takes the rest of the row."""
    A = [[Fr(0)] * T for _ in range(T)]
    for (i, k), w in edges.items():
        A[k][i] = Fr(w)
    for k in range(T):
        A[k][k] = 1 - sum(A[k][:k])
    return A


def fast(attn, q, a):
    def t(x, dt=torch.float64):
        return torch.tensor([[float(v) for v in r] for r in x] if isinstance(x[0], list) else x, dtype=dt)

    return trace_flow(t(attn), torch.tensor(q), torch.tensor(a))


# ----------------------------------------------------------------------------- hand-computed DAGs
CHAIN = dict(
    T=3,
    edges={(0, 1): "1/2", (1, 2): "2/5"},
    q=[1, 0, 0],
    a=[0, 0, 1],
    h=["1/5", "2/5", "1"],
    Wp={(0, 1): 1, (1, 2): 1},
    f=[1, 1, 1],
    tau=[2, 2, 1],
)


# 0 -> {1, 2} -> 3: h(0) = 0.6*0.5 + 0.2*0.25 = 0.35, so W'_01 = 0.3/0.35 = 6/7 and W'_02 = 1/7.
DIAMOND = dict(
    T=4,
    edges={(0, 1): "3/5", (0, 2): "1/5", (1, 3): "1/2", (2, 3): "1/4"},
    q=[1, 0, 0, 0],
    a=[0, 0, 0, 1],
    h=["7/20", "1/2", "1/4", "1"],
    Wp={(0, 1): "6/7", (0, 2): "1/7", (1, 3): 1, (2, 3): 1},
    f=[1, "6/7", "1/7", 1],
    tau=[2, "12/7", "2/7", 1],
)


# 0 -> 1 -> 3 (answer); 0 -> 2 -> 4 where 4 comes after the answer: 2 is a dead end. The answer's own
# edge 3 -> 4 is cut (absorbing), so 4 gets nothing either.
DEAD_END = dict(
    T=5,
    edges={(0, 1): "1/2", (0, 2): "1/2", (1, 3): "1/2", (2, 4): "7/10", (3, 4): "3/10"},
    q=[1, 0, 0, 0, 0],
    a=[0, 0, 0, 1, 0],
    h=["1/4", "1/2", 0, 1, 0],
    Wp={(0, 1): 1, (1, 3): 1},
    f=[1, 1, 0, 1, 0],
    tau=[2, 2, 0, 1, 0],
)


@pytest.mark.parametrize("case", [CHAIN, DIAMOND, DEAD_END], ids=["chain", "diamond", "dead_end"])
def test_hand_computed_dag(case):
    T = case["T"]
    attn = attn_from_edges(T, case["edges"])
    q, a = [bool(x) for x in case["q"]], [bool(x) for x in case["a"]]
    exp_h, exp_f, exp_tau = ([Fr(x) for x in case[key]] for key in ("h", "f", "tau"))
    exp_Wp = [[Fr(case["Wp"].get((i, k), 0)) for k in range(T)] for i in range(T)]
    # 1. the loop reference, in exact arithmetic, matches the hand computation
    h, Wp, f, tau = reference_flow(attn, q, a)
    assert (h, Wp, f, tau) == (exp_h, exp_Wp, exp_f, exp_tau)
    # 2. the fast solver matches it too
    out = fast(attn, q, a)
    torch.testing.assert_close(out.h, torch.tensor([float(x) for x in exp_h], dtype=torch.float64))
    torch.testing.assert_close(out.flow, torch.tensor([float(x) for x in exp_f], dtype=torch.float64))
    torch.testing.assert_close(out.throughput, torch.tensor([float(x) for x in exp_tau], dtype=torch.float64))
    At = torch.tensor([[float(v) for v in r] for r in attn], dtype=torch.float64)
    M = dag_weights(At[None], torch.tensor(a)[None], torch.ones(1, T, dtype=torch.bool))
    torch.testing.assert_close(
        reweight(M, out.h[None])[0],
        torch.tensor([[float(v) for v in r] for r in exp_Wp], dtype=torch.float64),
    )


# ----------------------------------------------------------------------------- properties
def random_batch(seed, B, T):
    """Random causal attention (rows sum to 1), random left/right padding, question first, answer near the
    end."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.zeros(B, T, T, dtype=torch.float64)
    q, a, v = (torch.zeros(B, T, dtype=torch.bool) for _ in range(3))
    for b in range(B):
        lp = int(torch.randint(0, max(1, T // 4), (1,), generator=g))  # left padding
        rp = int(torch.randint(0, max(1, T // 4), (1,), generator=g))  # right padding
        n = T - lp - rp
        if n < 2:
            lp, rp, n = 0, 0, T
        scores = torch.randn(n, n, generator=g, dtype=torch.float64) * 2
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        attn[b, lp : lp + n, lp : lp + n] = scores.softmax(-1)
        v[b, lp : lp + n] = True
        nq = 1 + int(torch.randint(0, max(1, n // 3), (1,), generator=g))
        q[b, lp : lp + nq] = True
        if n - nq >= 2 and b % 4 != 3:  # every 4th row has no answer
            na = 1 + int(torch.randint(0, max(1, (n - nq) // 3), (1,), generator=g))
            a[b, lp + n - na - int(torch.randint(0, 2, (1,), generator=g)) :][:na] = True
            a[b] &= v[b] & ~q[b]
    return attn, q, a, v


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 4), T=st.integers(2, 64))
def test_properties_against_reference(seed, B, T):
    attn, q, a, v = random_batch(seed, B, T)
    out = trace_flow(attn, q, a, attention_mask=v)
    assert torch.isfinite(out.flow).all() and (out.flow >= -1e-12).all()
    M = dag_weights(attn, a, v)
    Wp = reweight(M * (out.h > 0)[:, :, None] * (out.h > 0)[:, None, :], out.h)
    for b in range(B):
        reaches = (q[b] & (out.h[b] > 0)).any()
        # Theorem 3.1: the reweighted outflow is 1 wherever h > 0, off the (absorbing) answer
        live = (out.h[b] > 0) & ~a[b]
        torch.testing.assert_close(Wp[b].sum(-1)[live], torch.ones(int(live.sum()), dtype=torch.float64))
        # unit flow in at the question, exactly 1 into the answer
        assert math.isclose(out.flow[b][a[b]].sum().item(), 1.0 if reaches else 0.0, abs_tol=1e-9)
        # tau = 2f off the answer, and padding carries nothing
        torch.testing.assert_close(out.throughput[b][~a[b]], 2 * out.flow[b][~a[b]])
        assert (out.flow[b][~v[b]] == 0).all() and (out.h[b][~v[b]] == 0).all()
        # equals the loop reference (run on the valid window only)
        idx = v[b].nonzero().squeeze(-1)
        sub = attn[b][idx][:, idx].tolist()
        h, _, f, tau = reference_flow(sub, q[b][idx].tolist(), a[b][idx].tolist())
        torch.testing.assert_close(out.h[b][idx], torch.tensor(h, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(
            out.flow[b][idx], torch.tensor(f, dtype=torch.float64), rtol=1e-9, atol=1e-12
        )
        torch.testing.assert_close(
            out.throughput[b][idx], torch.tensor(tau, dtype=torch.float64), rtol=1e-9, atol=1e-12
        )


def test_flow_equals_h_times_g_identity():
    """f = h * g where g solves (I - M^T) g = s/h: check it against eq. 4 written with W' explicitly."""
    attn, q, a, v = random_batch(7, 3, 48)
    out = trace_flow(attn, q, a, attention_mask=v)
    M = dag_weights(attn, a, v) * (out.h > 0)[:, :, None] * (out.h > 0)[:, None, :]
    Wp = reweight(M, out.h)
    s = (q & v & (out.h > 0)).double()
    s = s / s.sum(-1, keepdim=True).clamp_min(1)
    eye = torch.eye(48, dtype=torch.float64)
    f_direct = torch.linalg.solve(eye - Wp.transpose(-1, -2), s.unsqueeze(-1)).squeeze(-1)  # f = s + W'^T f
    torch.testing.assert_close(out.flow, f_direct)


def test_long_sequence_8k_is_stable():
    """T = 8192 with a strong BOS sink and local decay: fp32 underflows h here; fp64 must not."""
    T = 8192
    k = torch.arange(T, dtype=torch.float32)
    dist = k[:, None] - k[None, :]  # (T, T) query k, key i
    scores = -dist / 16.0  # local decay
    scores[:, 0] += 6.0 + dist[:, 0] / 16.0  # BOS sink: ~constant high logit
    scores = scores.masked_fill(dist < 0, -math.inf)
    attn = scores.softmax(-1)
    del scores, dist
    q = torch.zeros(T, dtype=torch.bool)
    q[1:64] = True
    a = torch.zeros(T, dtype=torch.bool)
    a[T - 8 : T - 2] = True
    out = trace_flow(attn, q, a)
    assert (
        torch.isfinite(out.h).all()
        and torch.isfinite(out.flow).all()
        and torch.isfinite(out.throughput).all()
    )
    assert (out.h[1:64] > 0).all(), "question tokens must still reach the answer in fp64"
    assert abs(out.flow[a].sum().item() - 1.0) < 1e-6  # conservation
    # the same h in fp32 underflows: that is why we solve in fp64
    M32 = dag_weights(attn[None], a[None], torch.ones(1, T, dtype=torch.bool)).float()
    eye = torch.eye(T)
    h32 = torch.linalg.solve_triangular(eye - M32[0], a.float()[:, None], upper=True, unitriangular=True)[
        :, 0
    ]
    assert (h32[1:64] == 0).any() or not torch.isfinite(h32).all()


# ----------------------------------------------------------------------------- bad input
def test_bad_attention_raises():
    q, a = torch.tensor([True, False, False]), torch.tensor([False, False, True])
    bad = torch.full((3, 3), 0.3)
    with pytest.raises(ValueError, match="NaN"):
        trace_flow(bad.clone().fill_(float("nan")), q, a)
    neg = bad.clone()
    neg[2, 0] = -0.1
    with pytest.raises(ValueError, match="non-negative"):
        trace_flow(neg, q, a)
    with pytest.raises(ValueError, match="shape"):
        trace_flow(bad, q[:2], a)


@pytest.mark.parametrize(
    "name,T,q,a",
    [
        ("single_token", 1, [1], [1]),
        ("empty_answer", 4, [1, 1, 0, 0], [0, 0, 0, 0]),
        ("answer_before_question", 4, [0, 0, 1, 1], [1, 0, 0, 0]),
    ],
)
def test_degenerate_inputs_fall_back_to_uniform(name, T, q, a):
    attn = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    out = trace_flow(attn, torch.tensor(q, dtype=torch.bool), torch.tensor(a, dtype=torch.bool))
    resp = ~torch.tensor(q, dtype=torch.bool) if name != "single_token" else torch.tensor([True])
    c = flow_credit(out.throughput if name != "single_token" else torch.zeros(1), resp)
    assert bool(c.fallback) and torch.equal(c.weight, resp.float())


# ----------------------------------------------------------------------------- credit
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 80),
    pad=st.integers(0, 10),
    top=st.sampled_from([0.2, 0.4, 0.6, 1.0]),
    largest=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_credit_boosts_exactly_ceil_top_frac(n, pad, top, largest, seed):
    g = torch.Generator().manual_seed(seed)
    tau = torch.rand(2, pad + n, generator=g, dtype=torch.float64).round(decimals=1)  # many ties
    resp = torch.zeros(2, pad + n, dtype=torch.bool)
    resp[:, pad:] = True
    w, _, fb = flow_credit(tau, resp, top_frac=top, gamma=1.5, largest=largest)
    k = math.ceil(round(top * n, 9))
    boosted = w == 1.5
    assert (boosted.sum(-1) == torch.where(fb, 0, k)).all()
    assert (w[~resp] == 0).all() and set(w[resp].unique().tolist()) <= {1.0, 1.5}
    for b in range(2):
        if fb[b]:
            continue
        sel, rest = tau[b][boosted[b]], tau[b][resp[b] & ~boosted[b]]
        if len(rest):
            assert (sel.min() >= rest.max()) if largest else (sel.max() <= rest.min())
    assert torch.equal(flow_credit(tau, resp, top, 1.5, largest).weight, w)  # deterministic
    c = flow_credit(tau, resp, top, 1.5, largest, prompt_width=pad)  # the response columns only
    assert torch.equal(c.weight, w[:, pad:]) and torch.equal(c.scores, tau[:, pad:].float())
    assert torch.equal(c.fallback, fb)


def test_credit_ties_go_to_the_earlier_token():
    tau = torch.tensor([0.0, 5.0, 1.0, 1.0, 1.0, 1.0])
    resp = torch.tensor([False, True, True, True, True, True])
    w, _, fb = flow_credit(tau, resp, top_frac=0.4)  # n = 5 -> 2 tokens: 5.0, then first 1.0
    assert w.tolist() == [0.0, 1.5, 1.5, 1.0, 1.0, 1.0] and not fb
    w = flow_credit(tau, resp, top_frac=0.4, largest=False).weight  # bottom-k: the two earliest 1.0s
    assert w.tolist() == [0.0, 1.0, 1.5, 1.5, 1.0, 1.0]


# ----------------------------------------------------------------------------- inputs left alone
def test_inputs_are_not_modified():
    attn, q, a, v = random_batch(3, 2, 16)
    before = attn.clone()
    trace_flow(attn, q, a, attention_mask=v)
    dag_weights(attn, a, v)
    assert torch.equal(attn, before)


# ----------------------------------------------------------------------------- Capture refuses
@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    use_capture_attention(model)
    return model, tok


def forward(model, ids, cap):
    mask = torch.ones_like(ids)
    return model(input_ids=ids, attention_mask=mask, flow_capture=cap, use_cache=False)


def test_a_capture_takes_one_forward(tiny):
    model, _ = tiny
    layers = select_layers("middle", model.config.num_hidden_layers)
    ids = torch.tensor([[5, 6, 7, 8]])
    cap = Capture(layers)
    forward(model, ids, cap)
    with pytest.raises(RuntimeError, match="make a new Capture for each forward"):
        forward(model, ids, cap)  # the same shape: refused, not ignored
    cap = Capture(layers)
    forward(model, ids, cap)
    with pytest.raises(RuntimeError, match="make a new Capture for each forward"):
        forward(model, torch.tensor([[5, 6, 7, 8, 9, 10]]), cap)  # another width
    with pytest.raises(ValueError, match="at least one layer"):
        Capture([])


def test_a_capture_refuses_a_mask_of_another_shape(tiny):
    model, _ = tiny
    cap = Capture(select_layers("middle", model.config.num_hidden_layers))
    forward(model, torch.tensor([[5, 6, 7], [8, 9, 10]]), cap)
    with pytest.raises(
        ValueError, match=r"attention_mask \(1, 3\) does not fit the captured forward \(2, 3\)"
    ):
        cap.maps(torch.ones(1, 3, dtype=torch.long))  # today it would broadcast over row 1


def test_gradient_checkpointing_replays_into_a_used_capture(tiny):
    """Backward replays each checkpointed layer with the same Capture: it adds nothing, raises nothing, and
    the
    maps equal a plain forward's."""
    model, tok = tiny
    ckpt = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)[0]
    ckpt.load_state_dict(model.state_dict())
    use_capture_attention(ckpt)
    policy.checkpointing(ckpt)
    ckpt.train()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]])
    mask = torch.ones_like(ids)
    layers = select_layers("middle", model.config.num_hidden_layers)
    maps = []
    for m in (model, ckpt):
        cap = Capture(layers)
        lp, _ = policy.token_logprobs(m, ids, mask, 3, share_prefix=True, capture=cap)
        maps.append(cap.maps(mask))  # read before backward, as grpo.update
        lp.sum().backward()  # the replay reaches cap.take again
    torch.testing.assert_close(maps[0], maps[1], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the head-mean kernel's choice
@pytest.mark.parametrize(
    "device, triton, compilers, chosen, line",
    [
        ("cuda", True, {"gcc": "/usr/bin/gcc"}, "head_mean_triton", "by the fused Triton kernel"),
        ("cuda", False, {"gcc": "/usr/bin/gcc"}, "add_head_mean", "Triton is not installed"),
        ("cuda", True, {}, "add_head_mean", "no C compiler for Triton's launcher"),
        ("cpu", True, {"gcc": "/usr/bin/gcc"}, "add_head_mean", None),
    ],
)
def test_the_head_mean_kernel_is_chosen_where_it_can_run(
    monkeypatch, capsys, device, triton, compilers, chosen, line
):
    """flowtracer.head_mean_kernel: the fused kernel only on CUDA with Triton and a C compiler for its
    launcher (Triton's first call fails without one); else add_head_mean, and on CUDA one line saying why."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(availability.shutil, "which", compilers.get)
    monkeypatch.setattr(availability, "libcuda_dirs", lambda: ["/usr/lib/x86_64-linux-gnu"])  # as on a GPU
    monkeypatch.setattr(
        availability.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" and not triton else real(name, *a),
    )
    fn = flowtracer.head_mean_kernel(device)
    out = capsys.readouterr().out.splitlines()
    assert fn.__name__ == chosen
    assert (out == []) if line is None else (len(out) == 1 and line in out[0])
