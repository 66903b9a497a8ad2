"""What every eval.py subcommand stands on: the model it loads, its prompt style, its problems, its output.

  resolve_model(name)          a model name, a grpo run directory (its ckpt/), a checkpoint or a .gguf file,
                               checked before anything loads (a missing path, a cut safetensors file: exit 2)
  auto_style(model, task, style)   grpo.py's prompt style for the model and task (a checkpoint: the style of
                               the model it began as)
  model_for(args, task)        the model and tokenizer, seeded, with --layers and --max-new-tokens checked
                               against the loaded model's depth and positions
  records_for(args, task)      the first --n-problems test records, or a seeded random sample of them
                               (eval.py's departure 4)
  inputs(args, tok, style)     --responses' fixed responses, else the task's records
  save(args, result, table)    <out>/<cmd>.json, <cmd>.md (and <cmd>_rows.jsonl), the table printed
  fail(msg, code)              raise EvalError: eval.py's main prints `eval.py: error: msg`, exits with code

Run: python eval.py bench --model runs/embedded --benchmarks gsm8k --n-problems 5 --n 1   (any subcommand)
"""

import json
import os
import random
from pathlib import Path

import torch

import data
from evaluation import probes
from flowtracer import select_layers
from training.decode.rollout import prefix_problem
from training.model.load import adapter_dir, load_model
from training.run import checkpoint as ckpt_io
from training.run import directory


class EvalError(Exception):
    """(msg, code): main prints `eval.py: error: msg` and exits with code (2: bad input, 1: no result)."""


def fail(msg, code=2):
    raise EvalError(msg, code)


def resolve_model(name):
    """A model name for load_model. Paths must exist (exit 2); a grpo run directory means its ckpt/."""
    looks_local = (
        name.endswith(".gguf")
        or name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep in name and Path(name.split(os.sep)[0]).is_dir())
    )
    path = Path(name).expanduser()
    if looks_local and not path.exists():
        fail(
            f"--model {directory.link_problem(path) or name + ': not found'} (give a run directory, its "
            "ckpt/, a save_pretrained directory or a .gguf file)"
        )
    run = (path / "ckpt" / "config.json").is_file() or adapter_dir(path / "ckpt")  # a run: full or LoRA
    if not run and path.is_dir() and not (path / "config.json").is_file() and not adapter_dir(path):
        fail(
            f"--model {name}: a directory without config.json (or a LoRA checkpoint's adapter_config.json), "
            f"not a checkpoint or run directory"
        )
    if problem := path.is_dir() and ckpt_io.safetensors_problem(path / "ckpt" if run else path):
        fail(f"--model {problem}")  # a cut file: before the model loads
    return str(path / "ckpt") if run else str(path) if looks_local else name


def auto_style(model_name, task, style):
    """grpo.py's rule: countdown frame for Countdown, few-shot for SmolLM2 / GGUF, plain for base models."""
    if style != "auto":
        return "countdown" if task == "countdown" and style in ("fewshot", "fewshot3") else style
    state = Path(model_name) / "trainer_state.pt"  # a grpo checkpoint: the style of the model it began as
    if state.is_file():
        model_name = ckpt_io.read_state(model_name)["config"]["model"]  # checked whole (CPU), or RunError
    return data.default_style(model_name, task)


def save(args, result, table, rows=None):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": args.cmd, "args": {k: v for k, v in vars(args).items() if k != "func"}, **result}
    try:  # a full disk, a read-only dir
        (out / f"{args.cmd}.json").write_text(json.dumps(result, indent=1))
        (out / f"{args.cmd}.md").write_text(table)
        if rows is not None:
            with open(out / f"{args.cmd}_rows.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    except OSError as e:
        fail(f"{out}: cannot write the results ({e.strerror})")
    print(table + f"\nwrote {out}/{args.cmd}.json, {args.cmd}.md")


def model_for(args, task):
    """(model, tokenizer, prompt style) of eval.py's --model for `task`, seeded, with --layers and
    --max-new-tokens checked against it; a rollout fallback the model needs said in one line."""
    model_name = resolve_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)  # float32, bfloat16, float16
    try:
        model, tok = load_model(model_name, device=args.device, dtype=dtype)
    except (RuntimeError, OSError, ValueError, ImportError) as e:  # offline hub, missing wheel, bad dir
        fail(f"--model {args.model}: cannot be loaded: {e}")
    try:
        select_layers(getattr(args, "layers", None), model.config.num_hidden_layers)
    except ValueError as e:  # e.g. 40:48 of a 30-layer model
        fail(f"--layers: {e}")
    context = getattr(model.config, "max_position_embeddings", None) or float("inf")
    if (
        getattr(args, "max_new_tokens", 0) > context
    ):  # positions the model has no embedding for (deadend: none)
        fail(f"--max-new-tokens {args.max_new_tokens}: more than the model's {context} positions")
    if problem := prefix_problem(model):  # rollout.generate falls back to HF generate: said once, here
        print(f"rollout: HF generate reads each row's prompt (no shared prefix): {problem}")
    kind = data.TASKS[task].task if task in data.TASKS else task
    return model, tok, auto_style(model_name, kind, args.style)


def records_for(args, task, sample=False):
    """The first --n-problems test records; sample=True: a seeded random sample of that many (eval.py's
    departure 4)."""
    try:
        recs = data.load_task(task, split="test", limit=None if sample else args.n_problems, seed=args.seed)
    except (ValueError, OSError) as e:
        fail(str(e))
    return (
        random.Random(f"problems-{args.seed}").sample(recs, min(args.n_problems or len(recs), len(recs)))
        if sample
        else recs
    )


def inputs(args, tok, style, sample=False):
    """--responses rows (fixed responses), else the task's records (the probes sample the responses)."""
    try:
        return (
            probes.load_responses(args.responses, tok, style)
            if args.responses
            else records_for(args, args.task, sample)
        )
    except data.DataError as e:
        fail(str(e))
