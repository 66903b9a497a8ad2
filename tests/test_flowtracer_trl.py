"""flowtracer_trl.py on TRL 1.16 (skipped without trl: pip install -r requirements.txt). Tiny random Qwen3,
fp32, CPU: credit none trains exactly as stock TRL; the (B, C) advantages TRL receives are A * gamma, gamma =
flowtracer.flow_credit on TRL's own tensor layout, and TRL's loss is eq. 5 with them; each fused signal gives
grpo.py's credit on the same rows; a generation batch that spans optimizer steps is credited with the weights
that generated it, and a second iteration keeps the first's gamma; both passes log grpo.py's credit metrics;
an unknown TRL is one line; the task flags are grpo.py's, and a pattern that does not compile is refused
before the trainer builds. The 2-process run, which reuses this file's helpers:
tests/test_flowtracer_trl_two_process.py."""

import functools
import json

import pytest
import torch

import flowtracer_trl as ft  # noqa: E402
import grpo  # noqa: E402
from data import build_batch  # noqa: E402
from flowtracer import Capture, Credit, flow_credit, select_layers, trace_flow  # noqa: E402
from tasks.answers import (
    answer_token_range,  # noqa: E402
)
from training.credit import baselines, scoring  # noqa: E402
from training.credit.attention import attention_graph, use_capture_attention  # noqa: E402
from training.model.load import load_model  # noqa: E402
from training.run import log  # noqa: E402
from training.usercode import reward_code

ABSENT = "TRL's plug-in needs {}: pip install -r requirements.txt"


Dataset = pytest.importorskip("datasets", reason=ABSENT.format("datasets")).Dataset


trl = pytest.importorskip("trl", reason=ABSENT.format("trl"))


PROMPTS = ["Q: 2+2=?", "Q: what is 10-3?"]


def toy_reward(prompts, completions, **kwargs):
    """The fraction of digits in each completion: it varies within a group, so A != 0 and something trains.
    (A random tiny model never writes a correct \\boxed{} answer: the verifier would give every row 0.)"""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def answer_everything(trainer):
    """Put an answer "\\boxed{7}" at the end of every completion (before its EOS) as it is generated, so that
    flow has a target: a random tiny model never writes one, and flow credit would fall back to all-1."""
    real, box = trainer._generate_single_turn, trainer.processing_class("\\boxed{7}").input_ids
    eos = set(trainer.eos_token_ids)

    def generate(*args, **kwargs):
        ids, logprobs = real(*args, **kwargs)
        return [c[:-1] + box + c[-1:] if c and c[-1] in eos else c + box for c in ids], logprobs

    trainer._generate_single_turn = generate


def one_step(cls, tmp_path, config=None, **kw):
    """One GRPO step (2 prompts x 4 completions x <= 12 + 9 tokens) from the same seed and initial weights;
    `config`: other GRPOConfig fields. Returns (trainer, the generation batch TRL's loss used, the initial
    parameters)."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=1,
        learning_rate=1e-3,
        loss_type="grpo",
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        save_strategy="no",
    )
    args = trl.GRPOConfig(**{**base, **(config or {})})
    ds = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    tr = cls(model=model, reward_funcs=toy_reward, args=args, train_dataset=ds, processing_class=tok, **kw)
    answer_everything(tr)
    seen, real = [], tr._generate_and_score_completions
    tr._generate_and_score_completions = lambda inputs: seen.append(real(inputs)) or seen[-1]
    tr.train()
    return tr, seen[0], init


def logged_loss(tr):
    return next(m["loss"] for m in tr.state.log_history if "loss" in m)


def row_keys(out):
    """One key per row of a TRL batch: its prompt and completion ids without padding, as JSON."""
    return [
        json.dumps([p[pm.bool()].tolist(), c[cm.bool()].tolist()])
        for p, pm, c, cm in zip(
            out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"]
        )
    ]


def spy(setattr_):
    """Records, per row key, TRL's own advantage A (before the plug-in) in "A" (generation order) and the
    advantages TRL's loss read at the row's first loss, on its completion tokens, in "loss" (loss order).
    setattr_: monkeypatch.setattr in a test, setattr in a subprocess."""
    rec = {"A": {}, "loss": {}}
    gen, loss = trl.GRPOTrainer._generate_and_score_completions, trl.GRPOTrainer._compute_loss

    @functools.wraps(gen)  # trl_problem() reads the wrapped source
    def generate_and_score(self, inputs):
        out = gen(self, inputs)
        rec["A"].update(zip(row_keys(out), out["advantages"].tolist()))
        return out

    @functools.wraps(loss)
    def compute_loss(self, model, inputs):
        value = loss(self, model, inputs)
        for k, a, m in zip(row_keys(inputs), inputs["advantages"], inputs["completion_mask"]):
            rec["loss"].setdefault(k, a.expand(m.shape)[m.bool()].tolist())
        return value

    setattr_(trl.GRPOTrainer, "_generate_and_score_completions", generate_and_score)
    setattr_(trl.GRPOTrainer, "_compute_loss", compute_loss)
    return rec


def reference_gamma(keys, A, cfg, fused=False):
    """A single process's credit of rows (keys) with advantages A, from the initial tiny-qwen3: grpo.py's
    fused pass (its training forward token_logprobs, with the capture) or its separate pass."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    rows = [json.loads(k) for k in keys]
    batch = build_batch(tok, [p for p, _ in rows], [c for _, c in rows])
    got = None
    if fused:
        use_capture_attention(model)  # as trainable.load_policy
        cap = (
            Capture(select_layers(cfg.layers, model.config.num_hidden_layers))
            if baselines.reads_maps(cfg)
            else None
        )  # None: the signal reads no map
        with torch.no_grad():
            _, ent = grpo.token_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.prompt_width, capture=cap
            )
        got = scoring.ForwardOutputs(cap.maps(batch.attention_mask) if cap is not None else None, ent)
    with torch.no_grad():
        c = baselines.assign(model, tok, batch, torch.tensor(A), cfg, got)  # (B, R)
    return [g[: len(c_ids)] for g, (_, c_ids) in zip(c.weight, rows)]


def assert_loss_read(rec, keys, gamma):
    """TRL's loss read A * gamma on each row's completion tokens."""
    for k, g in zip(keys, gamma):
        torch.testing.assert_close(torch.tensor(rec["loss"][k]), rec["A"][k] * g, rtol=0, atol=1e-5)


def expected_gamma(out, tok, model):
    """gamma (B, C) built independently on TRL's own layout [left-padded prompt | right-padded completion]:
    attention_graph -> trace_flow -> flow_credit (eq. 1-6), the answer found as grpo.py finds it."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)  # (B, P + C)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    P, cm = out["prompt_ids"].shape[1], out["completion_mask"].bool()
    plain = ~torch.isin(out["prompt_ids"], torch.tensor(tok.all_special_ids))  # question: no specials
    q = torch.cat([out["prompt_mask"].bool() & plain, torch.zeros_like(cm)], 1)
    resp = torch.cat([torch.zeros_like(out["prompt_mask"]).bool(), cm], 1)
    ans = torch.zeros_like(resp)
    for b, (c, m) in enumerate(zip(out["completion_ids"], cm)):
        k0, k1 = answer_token_range(tok, c[m].tolist())
        ans[b, P + k0 : P + k1] = True
    tau = trace_flow(attention_graph(model, ids, mask, "middle"), q, ans, mask.bool()).throughput
    return flow_credit(tau, resp, 0.4, 1.5).weight[:, P:]  # (B, C)


def test_credit_none_is_stock_trl_and_flow_scales_each_token_term(tmp_path):
    stock, out_s, init = one_step(trl.GRPOTrainer, tmp_path / "stock")
    none, out_n, _ = one_step(
        ft.FlowTracerGRPOTrainer,
        tmp_path / "none",
        credit_cfg=grpo.Config(credit="none", credit_pass="separate"),
    )
    flow, out_f, _ = one_step(
        ft.FlowTracerGRPOTrainer, tmp_path / "flow", credit_cfg=grpo.Config(credit_pass="separate")
    )
    A, cm = out_s["advantages"], out_s["completion_mask"].float()  # (B,), (B, C)
    assert (A != 0).all() and torch.equal(out_n["completion_ids"], out_s["completion_ids"])  # same rollouts
    # credit none: gamma 1 on every completion token, and the step is stock TRL's, bit for bit
    assert torch.equal(out_n["advantages"], A[:, None] * cm)
    assert logged_loss(none) == logged_loss(stock)
    after_s, after_n = stock.model.state_dict(), none.model.state_dict()
    assert all(torch.equal(after_s[k], after_n[k]) for k in after_s)
    assert any(not torch.equal(after_s[k], init[k]) for k in init)  # the step did train
    # flow: TRL gets A * gamma with gamma = flow_credit on its own layout (columns aligned)
    gamma = expected_gamma(
        out_f, flow.processing_class, load_model("tiny-qwen3", device="cpu", dtype=torch.float32)[0]
    )
    assert torch.equal(out_f["completion_ids"], out_s["completion_ids"])
    assert (gamma == 1.5).any() and torch.equal(out_f["advantages"], A[:, None] * gamma)
    # ... and TRL's loss is eq. 5 with it: on-policy ratio 1, so 1/G sum_i 1/N_i sum_t -gamma_it A_i
    ref = (-(A[:, None] * gamma * cm).sum(-1) / cm.sum(-1)).mean()
    assert logged_loss(flow) == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert logged_loss(flow) != pytest.approx(logged_loss(stock), rel=1e-3)


def test_fused_credit_equals_the_separate_pass(tmp_path):
    """--credit-pass fused: gamma from TRL's own training forward (attention captured, once) equals the
    separate pass's, and so do the loss and the trained parameters."""
    sep, out_s, _ = one_step(
        ft.FlowTracerGRPOTrainer, tmp_path / "sep", credit_cfg=grpo.Config(credit_pass="separate")
    )
    seen, fused = [], None

    def spy(self, model, inputs):
        out = real(self, model, inputs)
        seen.append((inputs["completion_ids"].clone(), inputs["advantages"].clone()))
        return out

    real = ft.FlowTracerGRPOTrainer._compute_loss
    ft.FlowTracerGRPOTrainer._compute_loss = spy
    try:
        fused, out_f, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path / "fused", credit_cfg=grpo.Config())
    finally:
        ft.FlowTracerGRPOTrainer._compute_loss = real
    assert out_f["advantages"].dim() == 1 and torch.equal(out_f["completion_ids"], out_s["completion_ids"])
    ids, adv = seen[0]  # TRL shuffles rows: match them by their ids
    assert adv.dim() == 2 and (adv != 0).any() and len(ids) == len(out_s["completion_ids"])
    for row, a in zip(ids.tolist(), adv):
        j = out_s["completion_ids"].tolist().index(row)
        torch.testing.assert_close(a, out_s["advantages"][j], rtol=0, atol=1e-6)  # A * gamma, the same
    assert logged_loss(fused) == pytest.approx(logged_loss(sep), rel=1e-5, abs=1e-7)
    a, b = sep.model.state_dict(), fused.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_rows_without_advantage_get_gamma_1_and_the_pass_still_runs(tmp_path, monkeypatch):
    """A rank whose rows all have A = 0 still runs one credit pass (on a placeholder row): its collectives
    match the other ranks'. The placeholder's gamma is dropped."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        num_generations=2,
        per_device_train_batch_size=2,
        report_to="none",
        bf16=False,
        use_cpu=True,
    )
    tr = ft.FlowTracerGRPOTrainer(
        model=model,
        reward_funcs=toy_reward,
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 2),
    )
    calls = []

    def assign(model, tok, batch, adv, cfg, outputs=None):
        calls.append(len(adv))
        return Credit(
            2 * batch.response_mask[:, batch.prompt_width :].float(),
            None,
            torch.ones(len(adv), dtype=torch.bool),
        )

    monkeypatch.setattr(ft.baselines, "assign", assign)
    p, c = [tok("Q: 1+1?").input_ids] * 2, [tok("so \\boxed{2}").input_ids, tok("ab").input_ids]
    gamma, fallback = tr.token_credit(p, c, torch.zeros(2))  # (2, 12)
    assert calls == [1] and not fallback.any()
    assert torch.equal(gamma, torch.tensor([[1.0] * 12, [1.0] * 2 + [0.0] * 10]))
    gamma, fallback = tr.token_credit(p, c, torch.tensor([0.0, 1.0]))  # one row credited
    assert calls == [1, 1] and fallback.tolist() == [False, True]
    assert torch.equal(gamma, torch.tensor([[1.0] * 12, [2.0] * 2 + [0.0] * 10]))


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--top-frac", "2"], "--top-frac must be in (0, 1]"),
        (["--num-generations", "1"], "at least 2 generations"),
        (["--dataset", "nope"], "--dataset: invalid choice"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        ft.parse_args(flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    "signal, temperature",
    [("none", 0.7), ("random", 0.7), ("flow", 0.7), ("attention", 0.7), ("entropy", 0.7), ("entropy", 1.0)],
)
def test_each_fused_signal_gives_grpo_py_credit_on_the_same_rows(signal, temperature, tmp_path, monkeypatch):
    """One signal name, one definition: the plug-in's gamma (fused, or its fallback) is grpo.py's fused pass
    on the same rows, in the same order. Entropy is of the untempered logits, as grpo.token_logprobs gives
    it, whatever temperature TRL samples at."""
    rec, cfg = spy(monkeypatch.setattr), grpo.Config(credit=signal)
    tr, _, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path, dict(temperature=temperature), credit_cfg=cfg)
    assert tr.fused == (signal != "entropy" or temperature == 1.0)  # departure 2 (b): the fallback
    keys = list(rec["loss"])  # the loss's micro-batch, in order
    A = [rec["A"][k] for k in keys]
    assert len(keys) == 8 and all(A)
    gamma = reference_gamma(keys, A, cfg, fused=True)
    assert_loss_read(rec, keys, gamma)
    assert (signal == "none") == all(bool((g == 1).all()) for g in gamma)  # the credit did something


def test_on_policy_credit_is_the_optimizer_step_arithmetic():
    assert ft.on_policy_credit(1, 1, 1) and ft.on_policy_credit(4, 4, 1) and ft.on_policy_credit(2, 4, 1)
    assert ft.on_policy_credit(4, 4, 2)  # the second iteration reuses the stored gamma
    assert not ft.on_policy_credit(2, 1, 1) and not ft.on_policy_credit(3, 2, 1)
    assert not ft.on_policy_credit(3, 4, 1)  # generations at 0, 3, 6, ...: 3 + 3 > 4


def test_a_generation_spanning_updates_is_credited_with_the_generating_weights(tmp_path, monkeypatch):
    """steps_per_generation 2 > gradient accumulation 1: half the rows meet their first loss after an update.
    Their gamma is still the separate pass's with the weights that generated them (the initial ones)."""
    rec, cfg = spy(monkeypatch.setattr), grpo.Config()
    tr, _, init = one_step(
        ft.FlowTracerGRPOTrainer,
        tmp_path,
        dict(per_device_train_batch_size=4, steps_per_generation=2, max_steps=2, learning_rate=1e-2),
        credit_cfg=cfg,
    )
    assert not tr.fused and "steps_per_generation 2" in tr.separate_why and tr.state.global_step == 2
    keys = list(rec["A"])  # generation order
    assert len(keys) == 8 and set(rec["loss"]) == set(keys) and all(rec["A"].values())
    assert_loss_read(rec, keys, reference_gamma(keys, [rec["A"][k] for k in keys], cfg))
    after = tr.model.state_dict()
    assert any(not torch.equal(after[k], init[k]) for k in init)  # the weights did move in between


def test_a_second_iteration_reuses_the_first_iterations_gamma(tmp_path, monkeypatch):
    """num_iterations 2, fused: the second pass over the batch (after an update) reads the gamma of the
    first, written into TRL's buffered batch (departure 3), not a gamma of the updated weights."""
    reads, loss = {}, trl.GRPOTrainer._compute_loss

    @functools.wraps(loss)
    def compute_loss(self, model, inputs):
        value = loss(self, model, inputs)
        for k, a, m in zip(row_keys(inputs), inputs["advantages"], inputs["completion_mask"]):
            reads.setdefault(k, []).append(a[m.bool()].tolist())
        return value

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", compute_loss)
    tr, _, _ = one_step(
        ft.FlowTracerGRPOTrainer,
        tmp_path,
        dict(num_iterations=2, max_steps=2, learning_rate=1e-2),
        credit_cfg=grpo.Config(),
    )
    assert tr.fused and tr.state.global_step == 2 and [len(v) for v in reads.values()] == [2] * 8
    assert all(first == second for first, second in reads.values())


@pytest.mark.parametrize("credit_pass", ["fused", "separate"])
def test_both_passes_log_grpo_py_credit_metrics(credit_pass, tmp_path, monkeypatch):
    rec = spy(monkeypatch.setattr)
    tr, _, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path, credit_cfg=grpo.Config(credit_pass=credit_pass))
    assert tr.fused == (credit_pass == "fused")
    logged = next(m for m in tr.state.log_history if "loss" in m)
    gamma = [torch.tensor(rec["loss"][k]) / rec["A"][k] for k in rec["loss"]]  # every row has A != 0
    boosted = sum(int((g != 1).sum()) for g in gamma) / sum(len(g) for g in gamma)
    ess = [
        log.credit_stats(g[None], torch.tensor([rec["A"][k]]), torch.ones(1, len(g), dtype=torch.bool))
        for g, k in zip(gamma, rec["loss"])
    ]
    assert 0 < boosted < 1 and logged["credit/boosted_frac"] == pytest.approx(boosted)
    assert logged["credit/fallback_frac"] == 0.0  # every completion ends in an answer
    for name in ("credit/ess_ratio", "credit/top10_adv_mass"):
        assert logged[name] == pytest.approx(sum(e[name] for e in ess) / len(ess))


def test_an_unknown_trl_is_one_clear_line(tmp_path, monkeypatch, capsys):
    assert ft.trl_problem() is None  # the pinned TRL is the known one
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(SystemExit) as e:
        ft.main(["--model", "tiny-qwen3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("flowtracer_trl.py: error: trl 1.17.0") and "requirements.txt" in err
    with pytest.raises(ValueError, match="knows the internals of trl 1.16.0"):
        ft.FlowTracerGRPOTrainer(model=None, reward_funcs=toy_reward)


def test_changed_trl_internals_are_refused(monkeypatch):
    def old_loss(self, model, inputs):  # reads the advantages before its forward
        advantages = inputs["advantages"].unsqueeze(1)
        return self._get_per_token_logps_and_entropies(model, None, None, 1) and advantages

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", old_loss)
    assert "_compute_loss" in ft.trl_problem()
    monkeypatch.undo()
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", lambda self, model, ids: None)
    assert "compute_entropy" in ft.trl_problem()


def test_the_trl_plug_in_takes_the_same_task_flags(capsys):
    import flowtracer_trl
    from training.config import trl_setup

    args, _, _ = flowtracer_trl.parse_args(
        [
            "--dataset",
            "custom",
            "--data-path",
            "rows.jsonl",
            "--reward",
            "r.py:exact",
            "--answer-pattern",
            r"A: (\d+)",
        ]
    )
    assert (args.dataset, args.reward, args.answer_pattern) == ("custom", "r.py:exact", r"A: (\d+)")
    for bad, words in ((["--answer-pattern", "("], "does not compile"), (["--dataset", "custom"], "needs")):
        with pytest.raises(SystemExit):
            flowtracer_trl.parse_args(bad)
        assert words in capsys.readouterr().err.strip().splitlines()[-1]

    def exact(completion, record):
        return float(completion == record["answer"])

    fn = trl_setup.trl_reward(reward_code.Term("r.py:exact", exact, 3.0))  # TRL weighs: reward_weights
    assert fn.__name__ == "exact"
    assert fn(None, ["7", "8"], [json.dumps({"id": "a", "answer": "7"})] * 2) == [1.0, 0.0]


def test_the_trl_trainer_refuses_a_pattern_that_does_not_compile_before_it_builds():
    pytest.importorskip("trl")
    import flowtracer_trl

    with pytest.raises(ValueError, match=r"--answer-pattern '\(' does not compile"):
        flowtracer_trl.FlowTracerGRPOTrainer(model=None, answer_pattern="(")
