"""Flow credit on models that transformers runs without SDPA: tiny random Gemma-2 (logit soft-capping) and
GPT-OSS (attention sinks), both with sliding-window layers, built here (no hub) as save_pretrained writes
them. Their maps come from the model's own eager attention ("eager_capture": flowtracer.py's
eager_capture_attention, chosen by training/credit/attention.py's capture_impl), equal to the head mean of
eager output_attentions (fp32), where SDPA's recomputation would differ; one pass and the shared-prompt
update read the same maps; rollouts decode them with HF generate (rollout.prefix_problem); grpo.py and
FlowTracerGRPOTrainer train them with gamma != 1 (an answer pattern that matches); the memory estimate counts
the eager layers' probabilities; a model whose attention runs outside transformers' AttentionInterface (GPT-J)
is refused at construction by a credit that reads maps, in one line, and trains with one that reads none.

Run: python -m pytest -q tests/model/test_eager_capture.py
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GPTJConfig, GptOssConfig

import flowtracer
import grpo
from flowtracer import EAGER_IMPL, IMPL, Capture, add_head_mean, select_layers
from training.credit.attention import attention_graph, capture_impl
from training.decode.rollout import Sampling, generate, prefix_problem
from training.memory import phases, shapes, terms
from training.model.load import byte_tokenizer, load_model, tiny_config
from training.policy import token_logprobs

WINDOW = 6  # the sliding window, shorter than every test sequence: it binds
COMMON = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    initializer_range=0.2,  # load.py's tiny models' (its departure 4): attention far from uniform
    pad_token_id=256,
    eos_token_id=259,
    bos_token_id=None,
)
CONFIGS = {
    "gemma2": lambda: Gemma2Config(
        **COMMON,
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,  # binds: |Q K^T| / 4 exceeds 2 at these weights
        query_pre_attn_scalar=16,
        tie_word_embeddings=True,
    ),
    "gpt_oss": lambda: GptOssConfig(
        **COMMON,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        tie_word_embeddings=False,
    ),
    "gptj": lambda: GPTJConfig(  # attention outside transformers' AttentionInterface
        vocab_size=260,
        n_embd=64,
        n_layer=4,
        n_head=4,
        rotary_dim=8,
        n_positions=2048,
        initializer_range=0.2,
        pad_token_id=256,
        eos_token_id=259,
        bos_token_id=None,
        tie_word_embeddings=False,
    ),
}
REWARD = '''
def spread(completion, record):
    """Distinct characters of a completion: varies within a group, so rows have A != 0 and train."""
    return len(set(completion)) / 16
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """{kind: a directory save_pretrained wrote: the random model and the byte tokenizer (load.py's)}."""
    root, out = tmp_path_factory.mktemp("tiny"), {}
    for kind, config in CONFIGS.items():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config())
        out[kind] = root / kind
        model.save_pretrained(out[kind])
        byte_tokenizer().save_pretrained(out[kind])
    return out


def padded(tok, texts, device="cpu"):
    """Left-padded ids and mask of `texts` (byte tokens: one a character), all longer than WINDOW."""
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


TEXTS = ["the sliding window binds here, twice over", "short one, padded", "a middle length text"]


def eager_maps(model, ids, mask, spec):
    """Reference: output_attentions=True under transformers' "eager", head and layer mean, padding zeroed."""
    old = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                output_attentions=True,
            )
    finally:
        model.set_attn_implementation(old)
    layers = select_layers(spec, model.config.num_hidden_layers)
    A = torch.stack([out.attentions[i] for i in layers]).float().mean(dim=(0, 2))  # (B, T, T)
    m = mask.float()
    return A * m[:, :, None] * m[:, None, :], out.logits


def test_capture_impl_is_chosen_by_class_and_loaded(model_dir):
    """One place chooses: SDPA where the class has it, the model's own eager attention where it has not,
    none where its attention ignores AttentionInterface; load_model puts the choice in force."""
    assert capture_impl(load_model("tiny-qwen3", device="cpu")[0]) == IMPL
    for kind, impl in (("gemma2", EAGER_IMPL), ("gpt_oss", EAGER_IMPL), ("gptj", None)):
        model = load_model(str(model_dir[kind]), device="cpu", dtype=torch.float32)[0]
        assert capture_impl(model) == capture_impl(model.config) == impl
        assert model.config._attn_implementation == (impl or "eager")  # GPT-J: its own, untouched
    assert capture_impl(tiny_config("tiny-llama", 260)) == IMPL  # a config: the estimate's way in


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("spec", ["middle", "all"])
def test_captured_map_is_the_head_mean_of_eager_output_attentions(model_dir, kind, spec):
    """attention_graph's maps (a Capture inside the forward, eager_capture) equal eager output_attentions'
    head mean in fp32, soft-capping, sinks and the sliding window included; the forward's logits are
    eager's to the bit. SDPA's recomputation (add_head_mean: softmax(Q K^T s + mask)) would drop the
    soft-cap and the sinks: it is far from them, so this test would fail on a capture that recomputed."""
    model, tok = load_model(str(model_dir[kind]), device="cpu", dtype=torch.float32)
    ids, mask = padded(tok, TEXTS)
    ref, ref_logits = eager_maps(model, ids, mask, spec)
    W = attention_graph(model, ids, mask, spec)
    assert torch.allclose(W, ref, atol=1e-6), (W - ref).abs().max()
    assert model.config._attn_implementation == EAGER_IMPL  # attention_graph left it as it was
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(logits.logits, ref_logits)

    sdpa_like = Capture(select_layers(spec, 4), head_mean=add_head_mean)
    take = sdpa_like.take  # the same Q, K, mask, without the model's probabilities: SDPA's arithmetic
    sdpa_like.take = lambda layer, q, k, m, s, probs=None: take(layer, q, k, m, s)
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            flow_capture=sdpa_like,
        )
    assert (sdpa_like.maps(mask) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_shared_prompt_update_reads_what_one_pass_reads(model_dir, kind):
    """token_logprobs with each prompt read once (PromptKV: its sliding-window layers keep the prompt whole,
    the mask applies the window) equals one pass over the rows: log-probs and captured maps, with grad."""
    model, tok = load_model(str(model_dir[kind]), device="cpu", dtype=torch.float32)
    prompts, pmask = padded(tok, ["a prompt that is long enough", "short prompt"])  # (2, P)
    resp = torch.tensor([[ord(c) for c in "response one!"], [ord(c) for c in "response two?"]])  # (2, R)
    ids = torch.cat([prompts.repeat_interleave(2, 0), resp.repeat(2, 1)], 1)  # (4, T) two rows a prompt
    mask = torch.cat([pmask.repeat_interleave(2, 0), torch.ones(4, resp.shape[1], dtype=torch.long)], 1)
    mask[3, -4:] = 0  # a right-padded response
    layers, got = select_layers("all", 4), {}
    for share in (True, False):
        cap = Capture(layers)
        lp = token_logprobs(model, ids, mask, prompts.shape[1], share_prefix=share, capture=cap).logp
        got[share] = (lp, cap.maps(mask))
    assert torch.allclose(got[True][0], got[False][0], atol=1e-5)
    assert torch.allclose(got[True][1], got[False][1], atol=1e-6)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_rollouts_of_a_sliding_window_model_are_hf_generates(model_dir, kind):
    """rollout.generate's shared prefix lays a row out [prefix | pads | suffix], and transformers' window
    counts the pads: on these models it is off (prefix_problem), so the rollouts are HF generate's. Without
    the fallback the second prompt's greedy response differs (tiny Gemma-2 and GPT-OSS, fp32)."""
    model, tok = load_model(str(model_dir[kind]), device="cpu", dtype=torch.float32)
    assert prefix_problem(model) and prefix_problem(load_model("tiny-qwen3", device="cpu")[0]) is None
    prompts = ["Shared prefix text here: a", "Shared prefix text here: a much longer suffix"]
    shared, plain = (
        generate(model, tok, prompts, 1, Sampling(12, greedy=True), share_prefix=s) for s in (1, 0)
    )
    assert shared.response_ids == plain.response_ids


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_grpo_trains_them_with_rows_boosted(model_dir, kind, tmp_path, in_process):
    """grpo.py on a Gemma-2 / GPT-OSS directory: two steps on the CPU, flow credit with an answer pattern that
    matches (the last word of each response): every trained row boosted (gamma != 1), none falling back;
    the setup says which attention gives the maps and that HF generate decodes, one line each."""
    (tmp_path / "spread.py").write_text(REWARD)
    r = in_process(
        grpo.main,
        *("--model", model_dir[kind], "--device", "cpu", "--answer-pattern", r"(\S+)\s*$", "--steps", 2),
        *("--prompts-per-step", 2, "--group-size", 4, "--max-new-tokens", 16),
        *("--reward", f"{tmp_path / 'spread.py'}:spread", "--out-dir", tmp_path / "run"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert sum(line.startswith("attention: ") and "own eager attention" in line for line in lines) == 1
    assert sum(line.startswith("rollout: HF generate") for line in lines) == 1
    for m in metrics(tmp_path / "run"):
        assert m["rows/trained"] > 0 and m["credit/fallback"] == 0
        assert 0 < m["credit/boosted_frac"] < 1


def test_a_model_without_attention_interface_is_refused_in_one_line(model_dir, tmp_path, in_process):
    """GPT-J's attention runs outside AttentionInterface: --credit flow stops at setup (exit 2, one line
    naming the class and the credits that read no map, before any rollout); --credit none trains."""
    (tmp_path / "spread.py").write_text(REWARD)
    run = (
        *(
            "--model",
            model_dir["gptj"],
            "--device",
            "cpu",
            "--steps",
            1,
            "--prompts-per-step",
            2,
            "--group-size",
            2,
        ),
        *("--max-new-tokens", 8, "--reward", f"{tmp_path / 'spread.py'}:spread"),
    )
    r = in_process(grpo.main, *run, "--out-dir", tmp_path / "flow")
    err = [line for line in r.stderr.splitlines() if line.startswith("grpo.py: error:")]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert "GPTJForCausalLM" in err[0] and "--credit entropy, none" in err[0]
    assert not (tmp_path / "flow").exists()  # refused before the run directory is made
    r = in_process(grpo.main, *run, "--credit", "none", "--out-dir", tmp_path / "none")
    assert r.returncode == 0, r.stderr[-2000:]
    assert metrics(tmp_path / "none")[0]["rows/trained"] > 0


def test_eager_saved_is_what_the_eager_attention_keeps(model_dir):
    """terms.eager_saved equals track_peak's count of what Gemma-2's and GPT-OSS's attention keeps for
    backward under eager_capture, fp32 and bf16; the estimate counts it, and HF generate's rollouts."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    from evaluation import memtrace

    flowtracer.register_attention()
    kinds = {
        "gemma2": (Gemma2Attention, Gemma2RotaryEmbedding),
        "gpt_oss": (GptOssAttention, GptOssRotaryEmbedding),
    }
    b, T = 3, 40
    for kind, (Attention, Rope) in kinds.items():
        for dtype in (torch.float32, torch.bfloat16):
            mc = CONFIGS[kind]()
            mc._attn_implementation = EAGER_IMPL
            attn = Attention(mc, 0).to(dtype).train()
            x = torch.randn(b, T, mc.hidden_size, dtype=dtype, requires_grad=True)
            cos, sin = Rope(mc)(x, torch.arange(T)[None].expand(b, T))
            mask = torch.zeros(b, 1, T, T, dtype=dtype)
            mask.masked_fill_(~torch.ones(T, T, dtype=torch.bool).tril(), torch.finfo(dtype).min)
            with memtrace.track_peak(attn, x, cos, sin, mask) as tr:
                base = tr.now
                out, probs = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
                del probs
                saved = tr.now - base - out.untyped_storage().nbytes()
            nb = 4 if dtype == torch.float32 else 2
            assert saved == b * T * terms.eager_saved(mc, mc.num_attention_heads * mc.head_dim, T, nb)
        cfg = grpo.parse_args(["--model", str(model_dir[kind])])
        s = shapes.read_shapes(cfg, phases.model_config(cfg.model), "cpu", 64)
        assert s.eager and not s.shared_rollout


@pytest.mark.parametrize("kind,extra", [("gemma2", {"cast_lm_head_to_fp32": True}), ("gpt_oss", {})])
def test_flowtracer_trainer_trains_them_as_grpo_trainer_does(model_dir, kind, extra, tmp_path):
    """TRL's test_train (and, on Gemma-2, its cast_lm_head_to_fp32 variant) as TRL's own test file runs it
    (a model path TRL loads, with its tokenizer; lr 0.1, 3 completions of 8 tokens), on FlowTracerGRPOTrainer
    with flow credit (fused, from TRL's own forward) and an answer pattern that matches: it trains (every
    parameter moves), gamma != 1 on some tokens of every step and no row falls back to plain GRPO."""
    trl = pytest.importorskip("trl", reason="TRL's plug-in needs trl: pip install -r requirements.txt")
    from datasets import Dataset

    import flowtracer_trl

    def spread(completions, **kwargs):  # varies within a group: rows with A != 0
        return [len(set(c)) / 8 for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        **extra,
    )
    prompts = ["The sky is", "The sun rises in the", "Two plus two makes", "Once upon a"] * 2
    trainer = flowtracer_trl.FlowTracerGRPOTrainer(
        model=str(model_dir[kind]),
        reward_funcs=spread,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        answer_pattern=r"(\S+)\s*$",
    )
    assert trainer.fused
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    moved = [k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])]
    assert len(moved) == len(before)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["credit/boosted_frac"] > 0 and h["credit/fallback_frac"] == 0


def test_flowtracer_trainer_refuses_an_uncapturable_model_at_construction(model_dir, tmp_path):
    """FlowTracerGRPOTrainer's __init__, before any generation: flow credit on GPT-J is one ValueError
    naming the class and the credits that read no map; --credit none builds the trainer."""
    trl = pytest.importorskip("trl", reason="TRL's plug-in needs trl: pip install -r requirements.txt")
    from datasets import Dataset

    import flowtracer_trl

    kw = dict(
        model=str(model_dir["gptj"]),
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none"),
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8),
    )
    with pytest.raises(ValueError, match=r"GPTJForCausalLM .*--credit entropy, none"):
        flowtracer_trl.FlowTracerGRPOTrainer(**kw)
    flowtracer_trl.FlowTracerGRPOTrainer(**kw, credit_cfg=grpo.Config(credit="none"))
