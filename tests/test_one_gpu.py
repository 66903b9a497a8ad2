"""The one-GPU path, checked on the CPU: what a CUDA run does differently, shown with tiny models, the meta
device or a fake where the CPU cannot show it. One section per finding; each test failed before its fix.

  checkpoints   read onto the CPU, the run's flags from a small JSON file; a full disk found at setup, and
                torch.save's own full-disk error is one line like the others
  bf16 weights  the rotary frequencies stay fp32 on every load path, as from_pretrained(dtype=bf16) keeps them
  padding rows  no attention row is fully masked: under a kernel that gives NaN for such rows (some GPU
                kernels; torch's CPU kernels give 0) the log-probs, the gradient, rollouts and maps are finite
  optimizer     torch-optimi's step chosen at setup: Triton only with a C compiler for its launcher, and only
                for CUDA weights (CPU weights under the CUDA scheme take the for-loop)
  rollouts      the prefill keeps one position's logits; dropping finished rows copies their filled part once
Where the device matters, a test runs on each device present (conftest.DEVICES: cpu, and cuda where there is
one), its inputs on model.device.
"""

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICES, assert_to_rounding

import data
import grpo
from gpu_kernels import availability
from training import attention, credit, load, models, policy, rollout, step_bytes, step_shapes
from training import checkpoint as ckpt_io
from training.models import load_model


@pytest.fixture(scope="module", params=DEVICES)
def tiny_state(request):
    """A model and an optimizer with state on each device: its checkpoint is read onto the CPU."""
    model, tok = load_model("tiny-llama", device=request.param)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]], device=model.device)).logits.sum().backward()
    opt.step()  # the optimizer has its state
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config(model="tiny-llama", credit="entropy")


def last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- checkpoints: resume
def watch_loads(monkeypatch):
    """Every torch.load call's keyword arguments, in a list."""
    calls, real = [], torch.load

    def load(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(ckpt_io.torch, "load", load)
    return calls


def test_resume_reads_the_flags_without_the_tensors(tmp_path, tiny_state, monkeypatch):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    calls = watch_loads(monkeypatch)
    got = grpo.parse_args(["--resume", str(tmp_path), "--steps", "9"])
    assert (got.model, got.credit, got.steps) == ("tiny-llama", "entropy", 9)
    assert calls == [], "parse_args read trainer_state.pt"
    assert json.loads((tmp_path / "ckpt" / ckpt_io.RUN_CONFIG).read_text())["credit"] == "entropy"
    device = next(model.parameters()).device
    drawn = torch.rand(4, device=device)  # the RNG state saved was before it
    assert ckpt_io.load_checkpoint(tmp_path / "ckpt", opt, sched) == (2, 0)
    assert [c.get("map_location") for c in calls] == ["cpu"] and calls[0]["weights_only"]
    assert torch.equal(torch.rand(4, device=device), drawn)  # this device's RNG restored


def test_a_checkpoint_without_the_json_still_resumes_on_the_cpu(tmp_path, tiny_state, monkeypatch):
    """A checkpoint written before run_config.json existed: the flags come from trainer_state.pt, read onto
    the CPU."""
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    (tmp_path / "ckpt" / ckpt_io.RUN_CONFIG).unlink()
    calls = watch_loads(monkeypatch)
    got = grpo.parse_args(["--resume", str(tmp_path)])
    assert (got.model, got.credit) == ("tiny-llama", "entropy")
    assert [c.get("map_location") for c in calls] == ["cpu"]


def test_a_broken_run_config_names_the_file(tmp_path, tiny_state, capsys):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    (tmp_path / "ckpt" / ckpt_io.RUN_CONFIG).write_text('{"model": "tiny-')
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(["--resume", str(tmp_path)])
    assert e.value.code == 2 and ckpt_io.RUN_CONFIG in last_line(capsys)


# ----------------------------------------------------------------------------- checkpoints: a full disk
def zip_writer_full(*a, **k):
    """What torch.save raises when the disk fills under its zip writer (measured into /dev/full)."""
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_torch_saves_full_disk_error_is_one_line_and_loses_nothing(tmp_path, tiny_state, monkeypatch):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    with monkeypatch.context() as mp:
        mp.setattr(ckpt_io.torch, "save", zip_writer_full)
        with pytest.raises(ckpt_io.RunError, match=r"ckpt: no space left .* needs about [0-9.]+ [MG]iB"):
            ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial ckpt.tmp
    assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), opt, sched)[0] == 1
    assert grpo.parse_args(["--resume", str(tmp_path)]).model == "tiny-llama"  # --resume works


def test_the_real_zip_writer_error_is_a_full_disk():
    """The message torch.save gives into /dev/full (a device that is always full) is recognised."""
    with pytest.raises(RuntimeError) as e:
        torch.save({"a": torch.zeros(10**5)}, "/dev/full")
    assert ckpt_io.no_space(e.value), str(e.value)
    assert not ckpt_io.no_space(RuntimeError("a bug"))


def disk_with(monkeypatch, free):
    """shutil.disk_usage as a disk with `free` bytes free, wherever checkpoint.py asks."""
    monkeypatch.setattr(ckpt_io.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**15, 0, free))


def tiny_run(tmp_path, *flags):
    return [
        "--model",
        "tiny-qwen3",
        "--prompts-per-step",
        "1",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--out-dir",
        str(tmp_path / "run"),
        *flags,
    ]


@pytest.mark.parametrize("steps, copies", [(4, 2), (1, 1)])
@pytest.mark.parametrize("optimizer, per_param", [("adamw", 4 + 8), ("kahan", 2 + 6)])
def test_a_disk_too_small_for_the_checkpoints_stops_before_the_first_step(
    tmp_path, monkeypatch, capsys, device, optimizer, per_param, steps, copies
):
    """One byte short of the checkpoints the run will write, under each scheme (adamw: fp32 weights, m, v;
    kahan, the CUDA default: bf16 weights, m, v and compensation), on each device: one line before the first
    step. (On the H100 this test asked for the adamw size while the run, --optimizer auto on CUDA, was
    kahan's: 12 B/param of disk minus a byte was more than kahan's 8, so the run rightly began.)"""
    model = load_model("tiny-qwen3", device="cpu")[0]
    n = sum(p.numel() for p in model.parameters())
    one = ckpt_io.checkpoint_bytes(n, optimizer)
    assert one == n * per_param
    disk_with(monkeypatch, copies * one - 1)
    monkeypatch.setattr(grpo, "generate", lambda *a, **k: pytest.fail("a step began"))
    with pytest.raises(SystemExit) as e:
        grpo.main(
            tiny_run(
                tmp_path,
                "--steps",
                str(steps),
                "--save-every",
                "2",
                "--optimizer",
                optimizer,
                "--device",
                device.type,
            )
        )
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("grpo.py: error: ") and "Traceback" not in line, line
    assert f"need about {ckpt_io.gb(copies * one)}" in line, line
    assert all(w in line for w in ("--out-dir", "--save-every")), line
    assert ("--optimizer kahan" in line) == (optimizer == "adamw"), line  # the smaller state, if not used
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # a rerun needs no --overwrite


@pytest.mark.parametrize("optimizer", ["adamw", "kahan"])
def test_checkpoint_bytes_is_what_a_checkpoint_holds(tmp_path, optimizer):
    """checkpoint_bytes (the disk check's estimate) against a checkpoint written under each scheme: its
    weights and optimizer tensors (state_bytes), and the files on disk, which add only the tokenizer, the
    config and the pickle's framing (under 2 MB at this size)."""
    cfg = grpo.Config(model="tiny-qwen3", optimizer=optimizer, lr=1e-3)
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=load.weight_dtype(cfg, "cpu"))
    opt = load.make_optimizer(model, cfg, "cpu")
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-2)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    one = ckpt_io.checkpoint_bytes(sum(p.numel() for p in model.parameters()), optimizer)
    scalars = 8 * len(opt.state)  # a step count per parameter
    assert one <= ckpt_io.state_bytes(model, opt) <= one + scalars
    held = sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir() if f.is_file())
    assert one <= held < one + 2 * 2**20, (held, one)


def test_a_disk_just_large_enough_runs(tmp_path, monkeypatch):
    """Enough for one checkpoint beside the one a resumed run already has."""
    model = load_model("tiny-qwen3")[0]
    one = ckpt_io.checkpoint_bytes(sum(p.numel() for p in model.parameters()), "adamw")
    grpo.main(tiny_run(tmp_path, "--steps", "1"))
    held = sum(f.stat().st_size for f in (tmp_path / "run" / "ckpt").iterdir())
    disk_with(monkeypatch, 2 * one - held)
    grpo.main(tiny_run(tmp_path, "--steps", "2", "--resume", str(tmp_path / "run")))
    assert [json.loads(x)["step"] for x in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_eval_memory_names_the_disk_a_checkpoint_needs(capsys):
    import eval as ev

    ev.main(["memory", "--model", "qwen3-4b-random"])
    out = capsys.readouterr().out.splitlines()
    n = step_shapes.param_counts(step_bytes.model_config("qwen3-4b-random"))[0]
    disk = [x for x in out if x.startswith("disk:")]
    assert len(disk) == 1 and f"{n * 8 / 1e9:.2f} GB" in disk[0] and out[-1].startswith("peak"), disk


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
    plain = models.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
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
            n=2,
            max_new_tokens=6,
            greedy=True,
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
    opt = load.make_optimizer(model, SimpleNamespace(optimizer="kahan", lr=1e-3, weight_decay=0.0), "cuda")
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
    opt = load.make_optimizer(model, cfg, "cpu")
    assert f"its {kernel} step" in capsys.readouterr().out
    g = opt.param_groups[0]
    assert (g["foreach"], g["triton"]) == (kernel == "foreach", False)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    opt.step()
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: "for-loop")
    ref_model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    ref = load.make_optimizer(ref_model, cfg, "cpu")
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

    model = models.AutoModelForCausalLM.from_config(models.tiny_config("tiny-qwen3", 20000)).eval()
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
            n=2,
            max_new_tokens=5,
            greedy=True,
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
    """credit.head_mean_kernel: the fused kernel only on CUDA with Triton and a C compiler for its
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
    fn = credit.head_mean_kernel(device)
    out = capsys.readouterr().out.splitlines()
    assert fn.__name__ == chosen
    assert (out == []) if line is None else (len(out) == 1 and line in out[0])
