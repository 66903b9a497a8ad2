"""flowtracer_trl.py on TRL 1.16 (skipped without trl: pip install -r requirements.txt). Tiny random
Qwen3, fp32, CPU: credit none trains exactly as stock TRL; the (B, C) advantages TRL receives are A * gamma,
gamma = flowtracer.flow_credit on TRL's own tensor layout, and TRL's loss is eq. 5 with them; a real 2-process
`accelerate launch` run (gloo) trains and gives every sample the same gamma on every rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

trl = pytest.importorskip("trl")

import flowtracer_trl as ft                                                            # noqa: E402
from credit import CreditConfig                                                      # noqa: E402
from flowtracer import attention_graph, flow_credit, trace_flow                      # noqa: E402
from models import load_model                                                        # noqa: E402
from regions import answer_token_range                                               # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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


def one_step(cls, tmp_path, **kw):
    """One GRPO step (2 prompts x 4 completions x <= 12 + 9 tokens) from the same seed and initial weights.
    Returns (trainer, the generation batch TRL's loss used, the initial parameters)."""
    model, tok = load_model("tiny-qwen3", dtype=torch.float32)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=12, max_steps=1, learning_rate=1e-3, loss_type="grpo",
                          logging_steps=1, report_to="none", bf16=False, use_cpu=True, save_strategy="no")
    ds = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    tr = cls(model=model, reward_funcs=toy_reward, args=args, train_dataset=ds, processing_class=tok, **kw)
    answer_everything(tr)
    seen, real = [], tr._generate_and_score_completions
    tr._generate_and_score_completions = lambda inputs: seen.append(real(inputs)) or seen[-1]
    tr.train()
    return tr, seen[0], init


def logged_loss(tr):
    return next(m["loss"] for m in tr.state.log_history if "loss" in m)


def expected_gamma(out, tok, model):
    """gamma (B, C) built independently on TRL's own layout [left-padded prompt | right-padded completion]:
    attention_graph -> trace_flow -> flow_credit (eq. 1-6), the answer found as grpo.py finds it."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)                    # (B, P + C)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    P, cm = out["prompt_ids"].shape[1], out["completion_mask"].bool()
    plain = ~torch.isin(out["prompt_ids"], torch.tensor(tok.all_special_ids))       # question: no specials
    q = torch.cat([out["prompt_mask"].bool() & plain, torch.zeros_like(cm)], 1)
    resp = torch.cat([torch.zeros_like(out["prompt_mask"]).bool(), cm], 1)
    ans = torch.zeros_like(resp)
    for b, (c, m) in enumerate(zip(out["completion_ids"], cm)):
        k0, k1 = answer_token_range(tok, c[m].tolist())
        ans[b, P + k0:P + k1] = True
    tau = trace_flow(attention_graph(model, ids, mask, "middle"), q, ans, mask.bool()).throughput
    return flow_credit(tau, resp, 0.4, 1.5).gamma[:, P:]                             # (B, C)


def test_credit_none_is_stock_trl_and_flow_scales_each_token_term(tmp_path):
    stock, out_s, init = one_step(trl.GRPOTrainer, tmp_path / "stock")
    none, out_n, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path / "none",
                              credit_cfg=CreditConfig("none", credit_pass="separate"))
    flow, out_f, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path / "flow",
                              credit_cfg=CreditConfig(credit_pass="separate"))
    A, cm = out_s["advantages"], out_s["completion_mask"].float()                      # (B,), (B, C)
    assert (A != 0).all() and torch.equal(out_n["completion_ids"], out_s["completion_ids"])   # same rollouts
    # credit none: gamma 1 on every completion token, and the step is stock TRL's, bit for bit
    assert torch.equal(out_n["advantages"], A[:, None] * cm)
    assert logged_loss(none) == logged_loss(stock)
    after_s, after_n = stock.model.state_dict(), none.model.state_dict()
    assert all(torch.equal(after_s[k], after_n[k]) for k in after_s)
    assert any(not torch.equal(after_s[k], init[k]) for k in init)                    # the step did train
    # flow: TRL gets A * gamma with gamma = flow_credit on its own layout (columns aligned)
    gamma = expected_gamma(out_f, flow.processing_class, load_model("tiny-qwen3", dtype=torch.float32)[0])
    assert torch.equal(out_f["completion_ids"], out_s["completion_ids"])
    assert (gamma == 1.5).any() and torch.equal(out_f["advantages"], A[:, None] * gamma)
    # ... and TRL's loss is eq. 5 with it: on-policy ratio 1, so 1/G sum_i 1/N_i sum_t -gamma_it A_i
    ref = (-(A[:, None] * gamma * cm).sum(-1) / cm.sum(-1)).mean()
    assert logged_loss(flow) == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert logged_loss(flow) != pytest.approx(logged_loss(stock), rel=1e-3)


def test_fused_credit_equals_the_separate_pass(tmp_path):
    """--credit-pass fused: gamma from TRL's own training forward (attention captured, once) equals the
    separate pass's, and so do the loss and the trained parameters."""
    sep, out_s, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path / "sep",
                             credit_cfg=CreditConfig(credit_pass="separate"))
    seen, fused = [], None

    def spy(self, model, inputs):
        out = real(self, model, inputs)
        seen.append((inputs["completion_ids"].clone(), inputs["advantages"].clone()))
        return out
    real = ft.FlowTracerGRPOTrainer._compute_loss
    ft.FlowTracerGRPOTrainer._compute_loss = spy
    try:
        fused, out_f, _ = one_step(ft.FlowTracerGRPOTrainer, tmp_path / "fused", credit_cfg=CreditConfig())
    finally:
        ft.FlowTracerGRPOTrainer._compute_loss = real
    assert out_f["advantages"].dim() == 1 and torch.equal(out_f["completion_ids"], out_s["completion_ids"])
    ids, adv = seen[0]                                         # TRL shuffles rows: match them by their ids
    assert adv.dim() == 2 and (adv != 0).any() and len(ids) == len(out_s["completion_ids"])
    for row, a in zip(ids.tolist(), adv):
        j = out_s["completion_ids"].tolist().index(row)
        torch.testing.assert_close(a, out_s["advantages"][j], rtol=0, atol=1e-6)     # A * gamma, the same
    assert logged_loss(fused) == pytest.approx(logged_loss(sep), rel=1e-5, abs=1e-7)
    a, b = sep.model.state_dict(), fused.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_rows_without_advantage_get_no_credit_pass(tmp_path, monkeypatch):
    model, tok = load_model("tiny-qwen3", dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2,
                          report_to="none", bf16=False, use_cpu=True)
    tr = ft.FlowTracerGRPOTrainer(model=model, reward_funcs=toy_reward, args=args, processing_class=tok,
                                  train_dataset=Dataset.from_list([{"prompt": "x"}] * 2))
    calls = []
    monkeypatch.setattr(ft.credit, "assign", lambda *a, **k: calls.append(a))
    p, c = [tok("Q: 1+1?").input_ids] * 2, [tok("so \\boxed{2}").input_ids, tok("ab").input_ids]
    gamma = tr.token_credit(p, c, torch.zeros(2))                                   # (2, 12)
    assert not calls and torch.equal(gamma, torch.tensor([[1.0] * 12, [1.0] * 2 + [0.0] * 10]))


@pytest.mark.parametrize("flags, says", [(["--top-frac", "2"], "--top-frac must be in (0, 1]"),
                                         (["--num-generations", "1"], "at least 2 generations"),
                                         (["--dataset", "nope"], "--dataset must be one of"),
                                         (["--no-such-flag"], "unrecognized arguments: --no-such-flag")])
def test_bad_flags_are_one_line_and_exit_2(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        ft.parse_args(flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


# ----------------------------------------------------------------------------- 2 processes
# The real command line under `accelerate launch`, with two test stand-ins: the toy reward (data.score) and
# the \boxed{} answer appended to each completion. Each rank also gathers every rank's rows at each step,
# credits all of them with its own copy of the policy, and writes what it applied and what it computed.
DRIVER = """import json, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
import data, flowtracer_trl as ft, test_trl
from accelerate.utils import gather_object
data.score = lambda rec, txt: test_trl.toy_reward(None, [txt])[0]

class Probe(ft.FlowTracerGRPOTrainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        test_trl.answer_everything(self)
        self.probe = []

    def token_credit(self, prompt_ids, completion_ids, adv):
        gamma = super().token_credit(prompt_ids, completion_ids, adv)
        p, c, a = zip(*gather_object(list(zip(prompt_ids, completion_ids, adv.tolist()))))
        every = super().token_credit(list(p), list(c), torch.tensor(a))
        row = lambda ids, g: [json.dumps(ids), g[:len(ids[1])].tolist()]
        self.probe.append({{"own": [row(x, g) for x, g in zip(zip(prompt_ids, completion_ids), gamma)],
                           "every": [row(x, g) for x, g in zip(zip(p, c), every)]}})
        with open({out!r} + f"/gamma-{{self.accelerator.process_index}}.json", "w") as f:
            json.dump(self.probe, f)
        return gamma

ft.FlowTracerGRPOTrainer = Probe
ft.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_two_process_accelerate_run_trains_with_the_same_gamma_on_every_rank(tmp_path):
    driver, out = tmp_path / "driver.py", tmp_path / "run"
    driver.write_text(DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(tmp_path)))
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",  # torchrun, 2 ranks
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    flags = ["--use-cpu", "--credit-pass", "separate", "--model", "tiny-qwen3", "--max-steps", "2", "--num-generations", "4",  # gloo
             "--per-device-train-batch-size", "4", "--max-completion-length", "8", "--learning-rate", "1e-3",
             "--warmup-steps", "0", "--save-strategy", "no", "--output-dir", str(out), "--seed", "1"]
    p = subprocess.run([sys.executable, *launch, str(driver), *flags], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 process(es)" in p.stdout
    ranks = [json.loads((tmp_path / f"gamma-{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 2                                      # one credit pass a step
    for step in zip(*ranks):
        every = [dict(s["every"]) for s in step]
        assert every[0] == every[1]                                  # every sample: one gamma on both ranks
        own = [dict(s["own"]) for s in step]
        assert own[0] and own[1] and not own[0].keys() & own[1].keys()   # data parallel: each its own rows
        for o in own:                                                # ... and each applied that gamma
            assert o == {k: every[0][k] for k in o}
    assert any(1.5 in g for s in ranks[0] for _, g in s["every"])    # flow credit boosted some tokens
    trained = load_model(str(out), dtype=torch.float32)[0].state_dict()
    init = load_model("tiny-qwen3", dtype=torch.float32)[0].state_dict()
    assert any(not torch.equal(trained[k], init[k]) for k in init)                 # the parameters changed
    assert len([m for m in map(json.loads, open(out / "metrics.jsonl")) if "loss" in m]) == 2
