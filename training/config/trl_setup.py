"""What flowtracer_trl.py's main sets up before TRL trains: grpo.py's flags and defaults on TRL's GRPOConfig,
the policy, the prompts as a TRL dataset and the rewards as TRL reward functions.

  parse_args(argv, description, config)   (ours, the credit's config, GRPOConfig): our flags, the
                        credit flags of grpo.Config (`config`), its LoRA flags (lora.AdapterConfig); the
                        rest go to HfArgumentParser as GRPOConfig fields, with grpo.py's defaults (defaults)
  build(args, targs)    TrlParts: the model (loaded here, or a hub name TRL loads), the tokenizer, the
                        prompt style, the reward functions, the dataset of {prompt, record} rows, the peft
                        LoraConfig (or None)
  verifier              data.py's verified reward (grpo.py's), as a TRL reward function
  trl_reward(term)      a --reward function (reward_code.Term) as a TRL reward function

Departures from grpo.py (flowtracer_trl.py's departures 5 and 6):
 1. HF's constant_with_warmup schedule: the first step has lr 0 (grpo.py's first step has lr / warmup).
 2. --lora-rank R > 0 (grpo.py's LoRA flags and defaults, its departure 9) hands TRL a peft LoraConfig
    (lora.lora_config), the frozen base in bf16 on a GPU (--fp16: fp16; TRL's own is fp32) and, without
    --learning-rate, 10x the lr (presets.LORA_LR_FACTOR); the credit reads the peft policy as it trains.
 3. --load-in-4bit (with --lora-rank; training/model/quantize.py) reads the base's linears in 4 bits onto
    the trainer's device, computing in the base's dtype: a local name here, a hub name through TRL's
    model_init_kwargs (quantization_config, device_map). TRL casts a 4-bit model's adapters to bf16 (QLoRA's
    recipe); flowtracer_trl.py keeps them fp32, as grpo.py does (FlowTracerGRPOTrainer).

Run:  python flowtracer_trl.py --help        Test: python -m pytest -q tests/test_flowtracer_trl.py
"""

import argparse
import dataclasses
import json
from typing import NamedTuple

import torch
from datasets import Dataset
from transformers import AutoTokenizer, HfArgumentParser
from trl import GRPOConfig

import data
from training.config import flags, helptext, presets
from training.credit import baselines
from training.decode.rollout import prompt_ids
from training.model import lora, quantize
from training.model.load import RANDOM_MODELS, fix_tokenizer, load_model
from training.usercode import reward_code


def defaults(config) -> dict:
    """GRPOConfig's defaults changed to grpo.py's (App. C.3), read from `config` (grpo.Config, where each is
    written once); any flag given wins."""
    c = config()
    return dict(
        output_dir="runs/trl",
        num_generations=c.group_size,
        max_completion_length=c.max_new_tokens,
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k,
        learning_rate=c.lr,
        lr_scheduler_type="constant_with_warmup",  # departure 1
        warmup_steps=c.warmup_steps,
        loss_type="grpo",
        logging_steps=1,
        report_to="none",
        seed=c.seed,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
    )


def verifier(prompts, completions, record, **kwargs):
    """data.py's verified reward of each completion (grpo.py's reward); `record` is the dataset column."""
    return [data.reward(c, json.loads(r)) for r, c in zip(record, completions)]


def trl_reward(term, prompt=None, keys=None):
    """A --reward function (reward_code.Term, either form) as a TRL reward function of its name, as
    grpo.py's."""
    one = reward_code.UserReward([term._replace(weight=1.0)], prompt, keys)

    def reward(prompts, completions, record, completion_ids=None, **kwargs):
        return one.table(completions, [json.loads(r) for r in record], completion_ids, **kwargs)[0]

    reward.__name__ = term.fn.__name__
    return reward


def parse_args(argv, description, config):
    """(ours, the credit's config, GRPOConfig). Our flags and the credit flags as grpo.py spells them (the
    fields of `config`'s credit section: grpo.Config, passed in); the rest go to HfArgumentParser as
    GRPOConfig fields (--per-device-train-batch-size, --deepspeed, --use-vllm, ...). Under --lora-rank the lr
    is presets.LORA_LR_FACTOR times the default's (departure 2)."""
    p = argparse.ArgumentParser(
        prog="flowtracer_trl.py",
        description=description,
        allow_abbrev=False,
        formatter_class=helptext.Formatter,
        usage="%(prog)s [--flag VALUE ...] [trl.GRPOConfig flags]",
        epilog="Any other flag is a trl.GRPOConfig field (--output-dir, --max-steps, "
        "--per-device-train-batch-size, ...: see TRL's GRPOConfig).",
    )
    p.add_argument("--model", default="smollm2-135m", help="a load.py name, a local directory, a hub name")
    p.add_argument(
        "--dataset",
        default="arithmetic",
        choices=list(data.DATASETS),
        help="a data.py task; custom: your --data-path rows and --reward (docs/your-task.md)",
    )
    p.add_argument("--data-path", default="", help="local JSONL/parquet of the dataset")
    p.add_argument("--question-field", default="", help="the question's column (\"\": the task's, guessed)")
    p.add_argument("--answer-field", default="", help="the answer's column (\"\": the task's, guessed)")
    p.add_argument(
        "--reward",
        default="",
        help="FILE.py:FUNCTION[,...]: (completion, record) -> float or "
        "TRL's (completions, **columns), as grpo.py's; weights: GRPOConfig's --reward-weights",
    )
    p.add_argument(
        "--answer-pattern",
        default="",
        help="regex of eq. 2's answer region: its last match "
        '(group 1 if any); "": the last \\boxed{}, else <answer>...</answer>',
    )
    p.add_argument(
        "--chat-template-kwargs",
        default="",
        help='JSON object for apply_chat_template, e.g. {"enable_thinking": false}',
    )
    p.add_argument("--prompt-style", default="auto", choices=["auto", *data.STYLES], help="prompt style")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are dropped")
    sections = flags.comments(config)[1]  # [(title, fields)]: grpo.py's credit section, the baselines' in it
    credit = next(names for title, names in sections if title and title.lower().startswith("credit"))
    skip = [f.name for f in dataclasses.fields(config) if f.name not in credit]
    flags.add_fields(p, config, baselines.CHOICES, skip=skip)  # help: the fields' comments
    flags.add_fields(p, lora.AdapterConfig)  # grpo.py's LoRA flags, their defaults and help (departure 2)
    flags.add_fields(p, config, skip=[f.name for f in dataclasses.fields(config) if f.name != "stop_grace"])
    args, rest = p.parse_known_args(argv)
    base = defaults(config)  # grpo.py's, on GRPOConfig's fields
    hf = HfArgumentParser(GRPOConfig, prog="flowtracer_trl.py")
    lr_given = any(a.split("=")[0] == "--learning-rate" for a in rest)
    hf.set_defaults(
        **{
            **base,
            **(
                {"learning_rate": presets.LORA_LR_FACTOR * base["learning_rate"]}
                if args.lora_rank > 0 and not lr_given
                else {}
            ),
        }
    )
    try:
        targs, unknown = hf.parse_args_into_dataclasses(rest, return_remaining_strings=True)
    except ValueError as e:  # GRPOConfig's own checks
        p.error(str(e))
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    ccfg = config(**{name: getattr(args, name) for name in credit}, seed=targs.seed)  # --seed: GRPOConfig's
    task = argparse.Namespace(**vars(args), reward_weights="", eval_every=0, eval_data_path="")  # its flags
    problem = (
        baselines.check(ccfg)
        or reward_code.check(task)
        or (
            "--lora-rank must be >= 0"
            if args.lora_rank < 0
            else "--lora-alpha must be > 0"
            if not args.lora_alpha > 0
            else "--lora-dropout must be in [0, 1)"
            if not 0 <= args.lora_dropout < 1
            else quantize.four_bit_problem(args)  # --load-in-4bit without --lora-rank
            if args.load_in_4bit
            else None
        )
    )
    if problem:
        p.error(problem)
    flags.unused(task, {k for k, v in vars(args).items() if v != p.get_default(k)}, p.prog)  # notices
    return args, ccfg, targs


class TrlParts(NamedTuple):
    """What main hands FlowTracerGRPOTrainer, built from the flags."""

    model: object  # the policy, loaded here; or a hub name that TRL loads (targs.model_init_kwargs)
    tok: object  # its tokenizer (load.fix_tokenizer's)
    style: str  # the prompt style (data.STYLES), --prompt-style or the model's
    rewards: list  # TRL reward functions: the --reward functions, or the verifier
    dataset: Dataset  # {prompt, record} rows, the prompts at most --max-prompt-tokens long
    n_long: int  # prompts dropped for their length
    lora: object  # peft's LoraConfig under --lora-rank (departure 2), else None


def build(args, targs):
    """TrlParts from our flags (args) and TRL's (targs; a hub model's dtype goes to its model_init_kwargs).
    Bad input (a data file, a model, a --reward, every prompt too long): ValueError or OSError."""
    records = data.load_task(
        args.dataset,
        split="train",
        path=args.data_path or None,
        seed=targs.seed,
        question_field=args.question_field,
        answer_field=args.answer_field,
    )
    style = (
        args.prompt_style
        if args.prompt_style != "auto"
        else data.default_style(args.model, records[0]["task"])
    )
    adapters = args.lora_rank > 0  # departure 2
    dt = torch.float32 if not adapters or targs.use_cpu else torch.float16 if targs.fp16 else torch.bfloat16
    bnb = quantize.four_bit(args, dt) if adapters and args.load_in_4bit else None  # departure 3: in dt
    four = {"quantization": bnb} if bnb is not None else {}  # read onto its device: a 4-bit model stays
    if args.model in RANDOM_MODELS or args.model == "smollm2-135m" or args.model.endswith(".gguf"):
        where = targs.device if bnb is not None else "cpu"  # else the Trainer places it
        model, tok = load_model(args.model, device=where, dtype=dt, **four)
    else:  # a name: TRL loads it (fp32 master weights, LoRA's base in dt; ZeRO-3 shards it)
        model, tok = args.model, fix_tokenizer(AutoTokenizer.from_pretrained(args.model))
        targs.model_init_kwargs = {
            "dtype": dt,
            **(quantize.load_kwargs(bnb, targs.device) if bnb is not None else {}),
            **(targs.model_init_kwargs or {}),
        }  # TRL's: fp32
    kwargs = reward_code.template_kwargs(args)
    prompt = reward_code.trl_prompt(tok, style, kwargs)  # a TRL-form one's
    mine = reward_code.load(
        argparse.Namespace(reward=args.reward, reward_weights=""),
        records[0],
        prompt,
        keys := [k for r in records for k in r],
    )  # checked once
    funcs = [trl_reward(t, prompt, keys) for t in mine.terms] if args.reward else [verifier]
    rows = [
        {"prompt": data.make_prompt(r, tok, style, kwargs), "record": json.dumps(r, default=str)}
        for r in records
    ]
    n = [len(ids) for ids in prompt_ids(tok, [r["prompt"] for r in rows])]  # as TRL will get them
    rows = [r for r, k in zip(rows, n) if k <= args.max_prompt_tokens]
    if not rows:
        raise ValueError(f"every prompt is longer than --max-prompt-tokens {args.max_prompt_tokens}")
    peft_config = lora.lora_config(args, model) if adapters else None  # departure 2; checked
    return TrlParts(model, tok, style, funcs, Dataset.from_list(rows), len(n) - len(rows), peft_config)
