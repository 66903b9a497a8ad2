"""The one-GPU path, checked on the CPU: what a CUDA run does differently, shown with tiny models, the meta
device or a fake where the CPU cannot show it. One section per finding; each test failed before its fix.

  bf16 weights  the rotary frequencies stay fp32 on every load path, as from_pretrained(dtype=bf16) keeps them
  padding rows  no attention row is fully masked: under a kernel that gives NaN for such rows (some GPU
                kernels; torch's CPU kernels give 0) the log-probs, the gradient, rollouts and maps are finite
  optimizer     torch-optimi's step chosen at setup: Triton only with a C compiler for its launcher, and only
                for CUDA weights (CPU weights under the CUDA scheme take the for-loop)
  rollouts      the prefill keeps one position's logits; dropping finished rows copies their filled part once
Where the device matters, a test runs on each device present (conftest.DEVICES: cpu, and cuda where there is
one), its inputs on model.device. Checkpoints on the one-GPU path: tests/test_one_gpu_checkpoints.py.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_to_rounding

import data
import flowtracer
import grpo
from gpu_kernels import availability
from training import policy
from training.credit import attention
from training.decode import rollout
from training.model import load, trainable
from training.model.load import load_model


# ----------------------------------------------------------------------------- bf16 weights: RoPE stays fp32
def rope_buffers(model):
    return {n: b for n, b in model.named_buffers() if "inv_freq" in n}


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "dir"])
def test_bf16_loads_equal_from_pretrained_with_fp32_rope(tmp_path, name):
    """A bf16 load by load_model (a random model, or a save_pretrained directory) has what a plain
    from_pretrained(dtype=bf16) of the same weights has: fp32 inverse frequencies, and equal logits."""
    src = tmp_path / "model"
    m, tok = load_model(
        "tiny-qwen3" if name == "dir" else name,
        device="cpu",
        dtype=torch.float32 if name == "dir" else torch.bfloat16,
    )  # dir: an fp32 save
    m.save_pretrained(src)
    tok.save_pretrained(src)
    if name == "dir":
        m, _ = load_model(str(src), device="cpu", dtype=torch.bfloat16)
    plain = load.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ours, ref = rope_buffers(m), rope_buffers(plain)
    assert ours and ours.keys() == ref.keys()
    assert all(b.dtype == torch.float32 and torch.equal(b, ref[n]) for n, b in ours.items()), {
        n: b.dtype for n, b in ours.items()
    }
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, plain(ids).logits)


@pytest.mark.smollm2
def test_the_gguf_model_in_bf16_keeps_fp32_rope():
    """SmolLM2 from its GGUF (de-quantized fp32, then cast): the fp32 load's frequencies, exactly."""
    fp32, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    bf16, _ = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    want, got = rope_buffers(fp32), rope_buffers(bf16)
    assert got and all(b.dtype == torch.float32 and torch.equal(b, want[n]) for n, b in got.items())
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- padding rows: never empty
@pytest.fixture
def nan_kernel(monkeypatch):
    """sdpa as a GPU kernel that returns NaN for a fully masked query row; the list counts such rows."""
    real, empty = torch.nn.functional.scaled_dot_product_attention, []

    def sdpa(q, k, v, attn_mask=None, **kw):
        out = real(q, k, v, attn_mask=attn_mask, **kw)  # (B, H, q, d)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            rows = ~attn_mask.any(-1, keepdim=True)  # (B, 1, q, 1)
            empty.append(int(rows.sum()))
            out = out.masked_fill(rows, float("nan"))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return empty


PROMPTS, RESPONSES = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [5, 6, 7]], [[20, 21, 22], [23], [24, 25]]


@pytest.mark.parametrize("share", [False, True])
def test_left_padding_rows_give_finite_log_probs_and_gradients(nan_kernel, share, device):
    """The update's forward over left-padded prompts (build_batch): every log-prob and gradient finite, and
    each row's log-probs those of the row alone, unpadded, to rounding (fp32 against the padded batch in
    float64: conftest.assert_to_rounding): the padding rows add nothing to the loss."""
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    b = data.build_batch(tok, PROMPTS, RESPONSES).to(model.device)
    logp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 2, share)
    resp = b.response_mask[:, b.prompt_width :]
    (logp * resp).sum().backward()
    assert torch.isfinite(logp).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        exact, _ = policy.token_logprobs(
            copy.deepcopy(model).double(), b.input_ids, b.attention_mask, b.prompt_width, 2, share
        )
    assert nan_kernel and sum(nan_kernel) == 0, nan_kernel  # no fully masked row was built
    for j, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):  # each row alone, no padding
        one = data.build_batch(tok, [p], [r]).to(model.device)
        alone, _ = policy.token_logprobs(model, one.input_ids, one.attention_mask, one.prompt_width, 2, False)
        assert_to_rounding(alone[0][: len(r)], logp[j][resp[j]], exact[j][resp[j]], what=f"row {j}")


@pytest.mark.parametrize("share", [False, True])
def test_left_padded_rollouts_are_unchanged(nan_kernel, monkeypatch, share):
    """HF generate (share_prefix=False) and the shared path, whose prompts here share no prefix (a
    [pads | suffix] layout): the same greedy tokens as with torch's own kernel."""
    model, tok = load_model("tiny-qwen3")

    def run():
        return rollout.generate(
            model,
            tok,
            ["ab", "cdefg"],
            2,
            rollout.Sampling(6, greedy=True),
            share_prefix=share,
        ).response_ids

    got = run()
    monkeypatch.undo()  # torch's kernel: 0 for such rows
    assert got == run()
    assert nan_kernel and sum(nan_kernel) == 0, nan_kernel


def test_captured_maps_of_left_padded_rows_are_finite(nan_kernel, device):
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    b = data.build_batch(tok, PROMPTS, RESPONSES).to(model.device)
    attn = attention.attention_graph(model, b.input_ids, b.attention_mask, layers="all")
    with attention.capturing(model, b.attention_mask, "all") as cap:
        policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 2, False)
    assert torch.isfinite(attn).all() and torch.isfinite(cap.attn).all()
    torch.testing.assert_close(cap.attn, attn)
    assert sum(nan_kernel) == 0, nan_kernel


# ----------------------------------------------------------------------------- the optimizer's kernel
@pytest.mark.parametrize(
    "device, triton, compilers, want",
    [
        ("cuda", True, {"gcc": "/usr/bin/gcc"}, "triton"),
        ("cuda", True, {"clang": "/usr/bin/clang"}, "triton"),
        ("cuda", True, {}, "foreach"),
        ("cuda", False, {"gcc": "/usr/bin/gcc"}, "foreach"),
        ("cpu", True, {"gcc": "/usr/bin/gcc"}, "for-loop"),
    ],
)
def test_the_optimizer_step_is_chosen_at_setup(monkeypatch, device, triton, compilers, want):
    """Triton only where its launcher can be built (a C compiler, as Triton looks for one), else foreach."""
    import optimi.utils

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(availability.shutil, "which", compilers.get)
    monkeypatch.setattr(availability, "libcuda_dirs", lambda: ["/usr/lib/x86_64-linux-gnu"])  # as on a GPU
    monkeypatch.setattr(optimi.utils, "HAS_TRITON", triton)
    assert policy.optimi_kernel(device) == want


def test_cpu_weights_take_the_for_loop_step_under_the_cuda_scheme(monkeypatch, capsys):
    """make_optimizer chooses optimi's step by where the weights are, not by the device asked for: bf16 CPU
    weights under the scheme grpo.py uses on CUDA, on a machine with Triton and a C compiler, take the
    for-loop step (asked for "cuda", it chose Triton, whose kernel cannot read CPU tensors: "Pointer argument
    (at 0) cannot be accessed from Triton (cpu tensor?)", tests/test_memory.py on the H100)."""
    import optimi.utils

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(availability.shutil, "which", {"gcc": "/usr/bin/gcc"}.get)
    monkeypatch.setattr(availability, "libcuda_dirs", lambda: ["/usr/lib/x86_64-linux-gnu"])  # as on a GPU
    monkeypatch.setattr(optimi.utils, "HAS_TRITON", True)
    assert policy.optimi_kernel("cuda") == "triton"  # what "cuda" alone would choose
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    opt = trainable.make_optimizer(
        model, SimpleNamespace(optimizer="kahan", lr=1e-3, weight_decay=0.0), "cuda"
    )
    assert "its for-loop step" in capsys.readouterr().out
    assert (opt.param_groups[0]["triton"], opt.param_groups[0]["foreach"]) == (False, False)
    before = policy.master_weights(model, opt)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-2)
    opt.step()  # runs, on the CPU
    after = policy.master_weights(model, opt)  # p + its Kahan compensation
    assert all(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("kernel", ["foreach", "for-loop"])
def test_make_optimizer_runs_the_chosen_step(monkeypatch, capsys, kernel):
    """The choice reaches optimi (one printed line), and its foreach step equals the for-loop on the CPU."""
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: kernel)
    cfg = grpo.Config(model="tiny-qwen3", optimizer="kahan", lr=1e-3)
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    opt = trainable.make_optimizer(model, cfg, "cpu")
    assert f"its {kernel} step" in capsys.readouterr().out
    g = opt.param_groups[0]
    assert (g["foreach"], g["triton"]) == (kernel == "foreach", False)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    opt.step()
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: "for-loop")
    ref_model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    ref = trainable.make_optimizer(ref_model, cfg, "cpu")
    for p in ref_model.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


# ----------------------------------------------------------------------------- prefill: one position's logits
def test_the_prefill_keeps_one_positions_logits():
    """A model whose logits dominate (a 20,000-token vocabulary): the prefill of a shared prefix and of the
    rows' prompts stays below the bytes of the logits of every prompt position (which nothing reads), and
    the greedy rollouts still equal HF generate's."""
    from evaluation.memtrace import track_peak

    model = load.AutoModelForCausalLM.from_config(load.tiny_config("tiny-qwen3", 20000)).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 256, 259
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 250, (200,), generator=g).tolist() for _ in range(2)]
    ids[1][:100] = ids[0][:100]  # a shared prefix of 100 tokens
    with torch.no_grad(), track_peak(model) as tr:
        tr.phase("prefix")
        prefix = rollout.shared_prefix(model, ids, room=8)
        tr.phase("rows")
        rollout.prefill_rows(model, prefix, [ids[0], ids[0], ids[1], ids[1]], 256)
        tr.phase(None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert prefix[0] == 100
    assert tr.peak["prefix"] - weights < 100 * 20000 * 4, tr.peak  # (1, 100, V) fp32
    assert tr.peak["rows"] - weights < 2 * 99 * 20000 * 4, tr.peak  # (2, 99, V) fp32
    tok = load_model("tiny-qwen3")[1]
    texts = [tok.decode(p) for p in ids]

    def run(share):
        return rollout.generate(
            model,
            tok,
            texts,
            2,
            rollout.Sampling(5, greedy=True),
            share_prefix=share,
        ).response_ids

    assert run(True) == run(False)


# ----------------------------------------------------------------------------- dropping finished rows
class CountCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that touch data inside the block (views are free) and the bytes they write."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.__name__.startswith(("_local_scalar_dense", "lift_fresh")):
            return out
        self.ops += 1
        self.bytes += sum(
            t.numel() * t.element_size()
            for t in torch.utils._pytree.tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        )
        return out


def dropped(rows, room, keep, filled=5):
    """(ops, bytes written) of a ReservedLayer dropping all rows but `keep`, and whether the rows kept
    hold what they held, in place."""
    layer = rollout.ReservedLayer(room)
    k, v = torch.randn(rows, 2, filled, 4), torch.randn(rows, 2, filled, 4)
    layer.update(k, v)
    ptr = layer.buf[0].data_ptr()
    with CountCopies() as c:
        layer.batch_select_indices(torch.tensor(keep))
    ok = torch.equal(layer.keys, k[keep]) and torch.equal(layer.values, v[keep])
    return c.ops, c.bytes, ok and layer.keys.data_ptr() == ptr


def test_dropping_rows_copies_the_filled_part_once_per_tensor():
    row = 2 * 5 * 4 * 4  # one row's filled keys, fp32
    ops, nbytes, ok = dropped(rows=8, room=1000, keep=[0, 2, 5, 7])
    assert ok and nbytes <= 2 * 2 * 3 * row, nbytes  # keys, values: gather + copy of the 3 rows that move
    assert (ops, nbytes) == dropped(rows=8, room=10, keep=[0, 2, 5, 7])[:2]  # not the spare room
    assert ops == dropped(rows=64, room=10, keep=list(range(0, 64, 2)))[0]  # not a loop over rows
    assert dropped(rows=8, room=10, keep=[0, 1, 2])[:2] == (0, 0)  # the tail leaves: free


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
