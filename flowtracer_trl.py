"""FlowTracer credit on TRL's GRPOTrainer: the method of grpo.py on an engine that scales past one GPU.

grpo.py is the one-GPU teaching loop. This file keeps TRL 1.16's loop (generation, also with vLLM; rewards;
group advantages; the clipped loss; accelerate / DeepSpeed ZeRO / FSDP) and changes one thing. After TRL has
scored the completions, each rank computes the token credit of its own rows with baselines.assign (the one
credit call of grpo.py: any signal, any shaping; FlowTracer's flow + top-k by default) and hands TRL

    A_it = A_i * gamma_it        (B, C) advantages, one per completion token (eq. 5-6)

TRL unsqueezes only 1-D advantages, so its _compute_loss takes these as they are. For the PPO-clip family and
gamma >= 0, min(r A gamma, clip(r) A gamma) = gamma * min(r A, clip(r) A): gamma weighs each token's whole
surrogate term, as eq. 5 does, and A's sign (TRL's clip metrics) is unchanged.

Layout: TRL holds prompts left-padded (B, P') and completions right-padded (B, C). The credit batch is built
from the token ids themselves (data.build_batch, as in grpo.py: the answer is the last \\boxed{} of the
decoded completion, or --answer-pattern's last match), so response column j of Credit.weight is
completion token j: TRL's column j.

Departures from grpo.py (numbered):
 1. The engine is TRL's: advantages (r - mean) / (std + 1e-4) per group (no +-2 clip), no dual-clip, TRL's
    sampling and loss aggregation (loss_type "grpo" by default here: eq. 5's 1/G sum_i 1/N_i sum_t).
 2. --credit-pass fused (the default, for grpo.py's fused signals: flow, attention, entropy, none, random):
    TRL's own training forward captures the attention (attention.capturing: SDPA's, or a model's own eager
    attention where transformers runs it without SDPA, Gemma-2, GPT-OSS; a model whose attention runs outside
    transformers' AttentionInterface is refused at construction by the credits that read maps, in one line)
    and gives the entropy; gamma is
    computed from them right after that forward and multiplies the batch's advantages before TRL's loss reads
    them (TRL 1.16's _compute_loss reads inputs["advantages"] after _get_per_token_logps_and_entropies: trl is
    pinned, and trl_problem() checks it). --credit-pass separate (and the other signals): a no-grad credit
    pass at rollout time on the unwrapped policy, ZeRO-3 parameters gathered as TRL's own generation does. The
    fused pass falls back to the separate one (said at start) where it would not read what grpo.py reads: (a)
    a generation batch that spans an optimizer step (steps_per_generation > gradient_accumulation_steps;
    on_policy_credit): its later slices meet their first loss after an update, and credit must come from the
    policy that generated them; (b) --credit entropy at a temperature != 1: TRL's entropy is of the tempered
    logits, grpo.py's (token_logprobs) of the untempered ones.
 3. gamma is computed once per batch (its first loss, or rollout time), so every reuse of the batch
    (num_iterations > 1, steps_per_generation > 1) keeps it, as grpo.py credits at the first iteration.
 4. Each rank credits its own rows: a batch-wide rule (--shaping 80-20) ranks one rank's rows; --credit random
    is seeded by the content of that rank's credited rows. Rows with A = 0 get no credit (gamma 1): their term
    is 0 anyway. A rank without a row with A != 0 still runs its credit pass, on a placeholder row whose gamma
    it drops: the parameter gathering (ZeRO-3), summon_full_params and the forward (FSDP) are collective, and
    a rank that skipped them would leave the others waiting. Evaluation keeps TRL's plain advantages.
 5. HF's constant_with_warmup schedule: the first step has lr 0 (training/config/trl_setup.py, its departure
 1).
 6. --lora-rank R > 0 hands TRL a peft LoraConfig, the base in 16 bits on a GPU and 10x the lr: the setup's
    departure 2; the credit reads the peft policy as it trains. --load-in-4bit: the base's linears in 4 bits
    (the setup's departure 3), the adapters kept fp32 where TRL would make them bf16.

Run:  python flowtracer_trl.py --model smollm2-135m --data-path runs/one_step.jsonl --max-steps 3 \\
          --num-generations 4 --per-device-train-batch-size 8 --max-completion-length 64 --warmup-steps 0 \\
          --learning-rate 1e-5 --output-dir runs/trl-demo        # add --lora-rank 16 for LoRA (departure 6)
      (runs/one_step.jsonl, the 2 processes and ZeRO-3: the README's section "When one GPU is not enough")
Our flags (--model, --dataset, --credit, --top-frac, ...) as in grpo.py; any other is a GRPOConfig field
(training/config/trl_setup.py: the flags, grpo.py's defaults, the policy, prompts and rewards handed to the
trainer).
Test: python -m pytest -q tests/test_flowtracer_trl.py tests/test_flowtracer_trl_two_process.py
      tests/model/test_eager_capture.py
Time: python benchmarks/peer_trl.py
"""

import argparse
import contextlib
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import trl
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation
except ImportError as e:  # no TRL: one line from the command line
    if __name__ != "__main__":
        raise
    print(f"flowtracer_trl.py: error: {e}: pip install -r requirements.txt", file=sys.stderr)
    sys.exit(2)

import grpo
from data import Batch, build_batch, take
from flowtracer import EAGER_IMPL, select_layers
from tasks.answers import PatternError, answer_token_range, pattern_problem
from training.config import trl_setup
from training.credit import attention, baselines, scoring
from training.credit.attention import capturing
from training.decode.rollout import prompt_ids
from training.run import log
from training.usercode import guard, reward_code

TRL_VERSION = "1.16.0"  # the TRL whose GRPOTrainer internals this file relies on (requirements.txt)


def trl_problem(trainer=None):
    """Why the installed TRL is not the one this plug-in knows (one sentence), or None. It relies on these
    GRPOTrainer internals (README: "When one GPU is not enough"): _generate_and_score_completions returns
    the rank's rows with 1-D "advantages"; _compute_loss keeps 2-D advantages as they are and reads them
    after _get_per_token_logps_and_entropies(..., compute_entropy=...); _prepare_inputs buffers a generation
    batch in steps_per_generation slices (_buffered_inputs, _step); _tokenize_prompts(prompts) gives
    (ids, images, fields); and on an instance (trainer): _dist.summon_full_params, _metrics, temperature,
    num_iterations."""
    if trl.__version__ != TRL_VERSION:
        return (
            f"trl {trl.__version__} is installed, but this plug-in knows the internals of trl "
            f"{TRL_VERSION} only: pip install -r requirements.txt"
        )
    need = (
        "_generate_and_score_completions",
        "_compute_loss",
        "_get_per_token_logps_and_entropies",
        "_prepare_inputs",
        "_tokenize_prompts",
    )
    if not all(callable(getattr(GRPOTrainer, n, None)) for n in need):
        return f"trl's GRPOTrainer lacks one of {', '.join(need)}"
    loss, prep = inspect.getsource(GRPOTrainer._compute_loss), inspect.getsource(GRPOTrainer._prepare_inputs)
    fwd, adv = loss.find("self._get_per_token_logps_and_entropies("), loss.find('inputs["advantages"]')
    if not (0 <= fwd < adv and "advantages.dim() == 1" in loss):
        return "trl's GRPOTrainer._compute_loss no longer reads 1-D or 2-D advantages after its forward"
    if "compute_entropy" not in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters:
        return "trl's GRPOTrainer._get_per_token_logps_and_entropies has no compute_entropy argument"
    if not all(k in prep for k in ("_buffered_inputs", "steps_per_generation", "self._step")):
        return "trl's GRPOTrainer._prepare_inputs no longer buffers steps_per_generation slices"
    if trainer is not None and not (
        hasattr(getattr(trainer, "_dist", None), "summon_full_params")
        and isinstance(getattr(trainer, "_metrics", None), dict)
        and all(hasattr(trainer, k) for k in ("temperature", "num_iterations"))
    ):
        return "trl's GRPOTrainer has no _dist.summon_full_params, _metrics, temperature or num_iterations"
    return None


def on_policy_credit(steps_per_generation, accumulation, iterations):
    """True when every slice of each generation batch meets its first loss before the optimizer steps after
    that batch's generation: the fused credit then reads the weights that generated it. TRL generates every
    steps_per_generation * iterations micro-steps (_prepare_inputs) and steps the optimizer every
    `accumulation` micro-steps; the pattern repeats with their least common multiple."""
    every = steps_per_generation * iterations
    return all(
        s % accumulation + steps_per_generation <= accumulation
        for s in range(0, math.lcm(every, accumulation), every)
    )


class FlowTracerGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages are A_i * gamma_it (eq. 5). credit_cfg: a grpo.Config (its credit
    flags: --credit, --shaping, --top-frac, --gamma, --layers, the baselines'; the paper's by default)."""

    def __init__(self, *args, credit_cfg=None, answer_pattern="", **kwargs):
        self.credit_cfg = credit_cfg or grpo.Config()
        self.answer_pattern = answer_pattern or None  # eq. 2's answer region (answers.find_answer_span)
        if problem := trl_problem() or baselines.check(self.credit_cfg) or pattern_problem(answer_pattern):
            raise ValueError(problem)
        super().__init__(*args, **kwargs)
        if problem := trl_problem(self):
            raise ValueError(problem)
        if getattr(self.model, "is_loaded_in_4bit", False):  # departure 6: fp32 adapters, not TRL's bf16
            for p in self.model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        select_layers(self.credit_cfg.layers, self.model.config.num_hidden_layers)  # --layers it lacks: error
        policy = self.accelerator.unwrap_model(self.model)
        maps, impl = self.credit_cfg.credit in attention.MAP_CREDITS, attention.capture_impl(policy)
        if maps and impl is None:  # its attention gives no maps: one line, before any generation
            raise ValueError(attention.capture_problem(policy, self.credit_cfg.credit))
        if maps and impl == EAGER_IMPL:
            print(attention.eager_line(policy))
        self.separate_why = self.separate_reason()  # departure 2
        self.fused, self._loss_inputs = not self.separate_why, None
        if self._dist.is_zero3 and not self.args.ds3_gather_for_generation:
            raise ValueError(
                "ZeRO-3 needs ds3_gather_for_generation (the default): the credit pass stops "
                "its forward after the last chosen layer, with the parameters gathered"
            )

    def separate_reason(self):
        """ "" when the fused credit pass reads what grpo.py's reads; else why credit runs at rollout time."""
        a, c = self.args, self.credit_cfg
        if baselines.separate_pass(c):
            return "asked for, or the signal or the shaping needs it"
        if not on_policy_credit(a.steps_per_generation, a.gradient_accumulation_steps, self.num_iterations):
            return (
                f"steps_per_generation {a.steps_per_generation} spans an optimizer step (gradient "
                f"accumulation {a.gradient_accumulation_steps}): credit from the generating weights"
            )
        if c.credit == "entropy" and self.temperature != 1.0:
            return f"TRL's entropy is at temperature {self.temperature}, grpo.py's of the untempered logits"
        return ""

    def _tokenize_prompts(self, prompts):
        """TRL's, but a text prompt gets rollout.prompt_ids' ids, as rollout.generate's: one BOS (TRL adds the
        tokenizer's special tokens also to a prompt whose chat template wrote the BOS). Chat prompts:
        TRL's."""
        if isinstance(prompts[0], str):
            return prompt_ids(self.processing_class, prompts), None, {}
        return super()._tokenize_prompts(prompts)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)  # TRL: generate, reward, A (B,) of this rank
        if not self.model.training or self.fused:  # departure 4: eval keeps plain advantages
            return out  # fused: gamma comes with the loss (dep. 2)
        prompts = [p[m.bool()].tolist() for p, m in zip(out["prompt_ids"], out["prompt_mask"])]
        comps = [c[: int(m.sum())].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
        t = time.perf_counter()
        weight, fallback = self.token_credit(prompts, comps, out["advantages"])  # (B, R), R <= C; (B,)
        self._metrics["train"]["time/credit"].append(time.perf_counter() - t)
        C = out["completion_ids"].shape[1]
        weight = F.pad(weight, (0, C - weight.shape[1])).to(out["advantages"].device)  # (B, C) TRL's columns
        self.log_credit(weight, out["advantages"], out["completion_mask"], fallback)
        out["advantages"] = out["advantages"].unsqueeze(-1) * weight  # (B, C) eq. 5
        return out

    def _compute_loss(self, model, inputs):
        self._loss_inputs = inputs if self.fused and inputs["advantages"].dim() == 1 else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
        """TRL's forward; fused, also the attention capture, then gamma into inputs["advantages"]."""
        inputs, forward = self._loss_inputs, super()._get_per_token_logps_and_entropies
        if inputs is None or not torch.is_grad_enabled():
            return forward(model, input_ids, attention_mask, logits_to_keep, *a, **k)
        self._loss_inputs, policy = None, self.accelerator.unwrap_model(model)
        attn = scoring.NEEDS.get(self.credit_cfg.credit) == "attn"
        with (
            capturing(policy, attention_mask, self.credit_cfg.layers)
            if attn
            else contextlib.nullcontext(argparse.Namespace(attn=None))
        ) as cap:
            out = forward(model, input_ids, attention_mask, logits_to_keep, *a, **k)
        t = time.perf_counter()
        adv = inputs["advantages"]  # (B,)
        with torch.no_grad():
            weight, fallback = self.fused_credit(
                policy, input_ids, attention_mask, logits_to_keep, adv, cap.attn, out[1]
            )  # (B, C), (B,)
        self._metrics["train"]["time/credit"].append(time.perf_counter() - t)
        self.log_credit(weight, adv, attention_mask[:, -logits_to_keep:], fallback)
        inputs["advantages"] = adv.unsqueeze(-1) * weight  # (B, C) eq. 5
        return out

    def fused_credit(self, policy, input_ids, attention_mask, C, adv, attn, entropy):
        """(gamma (B, C), fallback (B,)) on TRL's layout [left-padded prompt | right-padded completion] from
        the maps and the entropy its training forward gave; rows with A = 0 get 1 on their tokens."""
        tok, P = self.processing_class, input_ids.shape[1] - C
        pm, cm = attention_mask[:, :P].bool(), attention_mask[:, P:].bool()  # (B, P), (B, C)
        special = torch.tensor(tok.all_special_ids, device=input_ids.device)
        q = torch.cat([pm & ~torch.isin(input_ids[:, :P], special), torch.zeros_like(cm)], 1)  # no specials
        resp = torch.cat([torch.zeros_like(pm), cm], 1)
        ans = torch.zeros_like(resp)
        for b in cm.any(-1).nonzero().flatten().tolist():  # the rows with a completion
            if k := answer_token_range(tok, input_ids[b, P:][cm[b]].tolist(), self.answer_pattern):
                ans[b, P + k[0] : P + k[1]] = True
        weight, fallback = cm.float(), torch.zeros(len(cm), dtype=torch.bool, device=cm.device)
        rows = ((adv != 0) & cm.any(-1)).nonzero().flatten()
        if len(rows):
            batch = take(Batch(input_ids, attention_mask.long(), q, resp, ans, P), rows)
            got = scoring.ForwardOutputs(
                attn[rows] if attn is not None else None,
                entropy[rows].detach() if entropy is not None else None,
            )
            c = baselines.assign(policy, tok, batch, adv[rows].float(), self.credit_cfg, got)  # (b, C)
            weight[rows], fallback[rows] = c.weight.float(), c.fallback.to(cm.device)
        return weight, fallback

    def token_credit(self, prompt_ids, completion_ids, adv):
        """(gamma (B, R), fallback (B,)) for B (prompt ids, completion ids) lists without padding and
        advantages adv (B,): R = the longest completion, column j = completion token j, 0 past each
        completion's end. Rows with A != 0 get baselines.assign's gamma; the others 1. Every rank runs the
        pass (departure 4): without such a row, on a placeholder whose gamma is dropped. Deterministic given
        the rows and the policy."""
        n = [len(c) for c in completion_ids]
        weight = (torch.arange(max(n, default=0)) < torch.tensor(n)[:, None]).float()  # (B, R) 1 on tokens
        fallback = torch.zeros(len(n), dtype=torch.bool)
        rows = [i for i, c in enumerate(completion_ids) if c and adv[i] != 0]
        tok, dev = self.processing_class, self.accelerator.device
        pairs = (
            [(prompt_ids[i], completion_ids[i]) for i in rows]
            if rows
            # the placeholder:
            else [(prompt_ids[0], completion_ids[0] or [tok.eos_token_id])]
        )  # its gamma is dropped
        A = adv[rows].to(dev).float() if rows else torch.ones(1, device=dev)
        batch = build_batch(tok, *map(list, zip(*pairs)), answer_pattern=self.answer_pattern).to(dev)
        a = self.args  # the model as TRL's generation sees it
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=a.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=a.gradient_checkpointing_kwargs,
            ) as policy,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
            self.accelerator.autocast(),
        ):
            c = baselines.assign(policy, tok, batch, A, self.credit_cfg)  # (b, R')
        if rows:
            weight[rows, : c.weight.shape[1]], fallback[rows] = c.weight.float().cpu(), c.fallback.cpu()
        return weight, fallback

    def log_credit(self, weight, adv, mask, fallback):
        """grpo.py's credit/* metrics (log.py) over every rank's credited rows (A != 0): weight (B, C),
        adv (B,), mask (B, C) the completion tokens, fallback (B,). One gather, entered by every rank."""
        on = mask.bool() & (adv != 0)[:, None]  # (B, C)
        g, A, o = weight.float().cpu(), adv.float().cpu(), on.cpu()
        per_row = [log.credit_stats(g[b : b + 1], A[b : b + 1], o[b : b + 1]) for b in range(len(g))]
        ess = [r["credit/ess_ratio"] for r in per_row if r["credit/ess_ratio"] is not None]
        mass = [r["credit/top10_adv_mass"] for r in per_row if r["credit/top10_adv_mass"] is not None]
        local = [
            ((g != 1) & o).sum().item(),
            o.sum().item(),
            (fallback.cpu() & o.any(-1)).sum().item(),
            o.any(-1).sum().item(),
            sum(ess),
            len(ess),
            sum(mass),
            len(mass),
        ]
        total = self.accelerator.gather(torch.tensor(local, dtype=torch.float64, device=adv.device)[None])
        boosted, tokens, fell, n, ess, n_ess, mass, n_mass = total.sum(0).tolist()  # every rank's
        if n:
            m = self._metrics["train"]
            m["credit/boosted_frac"].append(boosted / tokens)
            m["credit/fallback_frac"].append(fell / n)
            m["credit/ess_ratio"].append(ess / max(1, n_ess))
            m["credit/top10_adv_mass"].append(mass / max(1, n_mass))


class StopAtSignal(TrainerCallback):
    """Ctrl-C or SIGTERM on TRL's loop as in grpo.py (guard.Stop): the step finishes (a --reward running gets
    --stop-grace), TRL saves its checkpoint-N, training stops, and main exits 143 or 130. Every process stops
    at the same step: the request is reduced over them (max) at each step's end, one small collective."""

    def __init__(self, stop, accelerator):
        self.stop, self.accelerator = stop, accelerator

    def on_step_end(self, args, state, control, **kwargs):
        asked = torch.tensor([float(self.stop.requested)], device=self.accelerator.device)
        if self.accelerator.reduce(asked, "max").item() > 0:  # any process's signal
            control.should_save = control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        control.should_save = False  # once: the epoch's end would save the same step again
        return control


# ----------------------------------------------------------------------------- command line
def parse_args(argv=None):
    """(ours, the credit's grpo.Config, GRPOConfig): grpo.py's flags and defaults on TRL's GRPOConfig
    (trl_setup.py)."""
    return trl_setup.parse_args(argv, __doc__.splitlines()[0], grpo.Config)


def main(argv=None):
    problem = trl_problem()  # an unknown TRL: one line, before any flag
    if problem:
        print(f"flowtracer_trl.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    args, ccfg, targs = parse_args(argv)
    stop = guard.Stop(args.stop_grace).install()  # Ctrl-C, SIGTERM: StopAtSignal, exit 143 / 130
    try:
        parts = trl_setup.build(args, targs)  # the policy, prompts and rewards
        trainer = FlowTracerGRPOTrainer(
            model=parts.model,
            reward_funcs=parts.rewards,
            args=targs,
            processing_class=parts.tok,
            train_dataset=parts.dataset,
            credit_cfg=ccfg,
            answer_pattern=args.answer_pattern,
            peft_config=parts.lora,
        )
    except (ValueError, OSError) as e:
        print(f"flowtracer_trl.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(
        f"GRPO on TRL: {args.model} on {args.dataset} ({parts.style} prompts, {parts.n_long} too long), "
        f"credit={ccfg.credit}/{ccfg.shaping}, {trainer.accelerator.num_processes} process(es), "
        f"{'fused credit pass' if trainer.fused else 'separate credit pass: ' + trainer.separate_why}"
    )
    trainer.add_callback(StopAtSignal(stop, trainer.accelerator))
    try:
        trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    except (reward_code.RewardError, PatternError) as e:  # a --reward raised or gave NaN; a pattern hung
        print(f"flowtracer_trl.py: error: {e}; TRL's last checkpoint (--save-steps) stands", file=sys.stderr)
        sys.exit(2)
    except guard.Interrupted as e:  # a second signal, or the grace's end inside a --reward
        print(f"flowtracer_trl.py: interrupted ({e}): TRL's last checkpoint (--save-steps) stands")
        sys.exit(stop.status or 130)
    if not stop.requested:  # a finished run: the model; an interrupted one: its checkpoint-N alone
        trainer.save_model(targs.output_dir)
    if trainer.accelerator.is_main_process:
        with open(Path(targs.output_dir) / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in trainer.state.log_history)
    stop.uninstall()
    if stop.requested:
        at = Path(targs.output_dir) / f"checkpoint-{trainer.state.global_step}"
        if trainer.accelerator.is_main_process:
            print(f"interrupted ({stop.ended()}): checkpoint saved ({at}); continue with the same flags and")
            print(f"  --resume-from-checkpoint {at}")
        if torch.distributed.is_initialized():  # as at the end of a finished run (below)
            torch.distributed.destroy_process_group()
        sys.exit(stop.status)  # 128 + the signal: 143 SIGTERM, 130 Ctrl-C
    return trainer


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # before the interpreter ends: gloo's threads may abort it
        torch.distributed.destroy_process_group()
