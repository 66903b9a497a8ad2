"""Argparse from a flat dataclass: each field is a flag, its trailing comment is the flag's --help line.

    @dataclass
    class Config:
        # update                                      <- a comment line on its own starts a section (a group)
        lr: float = 1e-6   # AdamW's (App. C.3)       <- --lr, its help "AdamW's (App. C.3) (default: 1e-06)"

The help is written once, next to the default (as CleanRL's tyro reads field docstrings, and transformers'
HfArgumentParser reads metadata={"help": ...}). The comments are read from the class source with inspect and
tokenize, for each dataclass in the MRO (grpo.Config inherits the baselines' BaselineConfig). A base class's
section joins the derived class's section of the same name, so BaselineConfig's `# credit: ...` flags come
after grpo.Config's own credit flags, between the reward and the update flags, in the order of the loop.

`read_config` reads a YAML or JSON file of the same flags (a run's run_config.json too): each value goes, as
the word the command line would give (training/config/flag_file.py), through the parser add_fields builds, so
a file and a command line are checked by the same code. `parse` resolves grpo.Config once: the defaults, the
presets in force (training/config/presets.py; in_force picks them), a --config file or a --resume's saved run
(training/config/resume.py), then the flags given; `check` holds grpo.py's rules on the values (one error line
each, before anything loads), `unused` the notices of flags given without effect. All grpo.parse_args runs on
a plain command line is in this file (docs/method.md counts setup's files).

Run: python grpo.py --help
     python -m pytest -q tests/config tests/test_grpo_cli.py
"""

import argparse
import dataclasses
import inspect
import io
import math
import re
import sys
import tokenize

import torch

import data
from training.config import flag_file, helptext, presets, resume
from training.credit import baselines
from training.decode.rollout import MIN_TEMPERATURE
from training.model import load, quantize, trainable
from training.run import checkpoint as ckpt_io
from training.run import tracking
from training.usercode import reward_code


def comments(cls):
    """({field: help}, [(section title, [fields])]) from the source of cls and its dataclass bases; the fields
    before any section comment come last, under the title None."""
    helps, sections = {}, {}  # key -> [title, fields], in the order of appearance
    for klass in [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]:  # the derived class first
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):  # no source (a frozen build): flags without help
            continue
        names = set(klass.__dataclass_fields__)
        lines = {}  # line number -> its tokens, without layout tokens
        for t in tokenize.generate_tokens(io.StringIO(src).readline):
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                lines.setdefault(t.start[0], []).append(t)
        section = None
        for toks in lines.values():
            if len(toks) == 1 and toks[0].type == tokenize.COMMENT and toks[0].start[1] > 0:  # a section
                title = toks[0].string.lstrip("#").strip()
                key = re.split(r"[:(]", title, maxsplit=1)[0].strip().lower()  # "credit (...)": credit
                section = sections.setdefault(key, [title, []])
            elif (
                len(toks) > 2
                and toks[0].type == tokenize.NAME
                and toks[1].string == ":"
                and toks[0].string in names
                and toks[0].start[1] > 0
            ):
                name = toks[0].string
                if toks[-1].type == tokenize.COMMENT and name not in helps:
                    helps[name] = toks[-1].string.lstrip("#").strip()
                if section is not None and not any(name in s[1] for s in sections.values()):
                    section[1].append(name)
    placed = {n for _, fields in sections.values() for n in fields}
    rest = [f.name for f in dataclasses.fields(cls) if f.name not in placed]
    return helps, [(t, f) for t, f in sections.values() if f] + ([(None, rest)] if rest else [])


def flag(name):
    return "--" + name.replace("_", "-")


def add_fields(parser, cls, choices=None, suppress=False, presets=None, active=(), skip=()):
    """One flag per field of the dataclass `cls`, in argument groups by its section comments.
    choices: {field: closed set of values}; suppress: a flag not given is absent from the namespace (so the
    caller knows which were given) and the help names the class default itself; presets: {label: {field:
    value}} shown next to the default; active: the labels of the presets in force (the last wins), whose
    value the help shows as the default, e.g. "(default: 6, set by the embedded model; without a preset:
    500)", the others as "(default: 500; the embedded model: 6)"; skip: fields left out."""
    choices, presets = choices or {}, presets or {}
    helps, sections = comments(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for title, names in sections:
        group = parser.add_argument_group(title) if title else parser  # no section: "options"
        for name in (n for n in names if n not in skip):
            f = fields[name]
            text = helps.get(name, "").replace("%", "%%")
            on = [label for label in active if name in presets[label]]  # in force, setting it
            notes = [f"{label}: {p[name]}" for label, p in presets.items() if name in p and label not in on]
            if suppress:
                shown = f.default if f.default != "" else '""'
                if on:
                    shown = f"{presets[on[-1]][name]}, set by {on[-1]}; without a preset: {shown}"
                text += f" (default: {shown}" + "".join(f"; {n}" for n in notes) + ")"
            elif notes:
                text += f" ({'; '.join(notes)})"
            kw = dict(default=argparse.SUPPRESS if suppress else f.default, help=text.strip())
            if f.type in (bool, "bool"):
                kw["action"] = argparse.BooleanOptionalAction  # --flag / --no-flag
            else:
                kw["type"] = type(f.default)
                kw["metavar"] = type(f.default).__name__.upper()  # INT, FLOAT, STR
            if name in choices:
                kw["choices"], kw["metavar"] = list(choices[name]), None  # shown as {a,b,c}
            group.add_argument(flag(name), **kw)
    return parser


def value_in(argv, name, default):
    """The value argv gives --name (the last `--name V` or `--name=V`; a bool flag: --name / --no-name), or
    `default`: read before argparse runs, so that the help can show the presets a flag puts in force."""
    value = default
    for i, a in enumerate(argv):
        if a == flag(name) and isinstance(default, bool):
            value = True
        elif a == "--no-" + flag(name)[2:]:
            value = False
        elif a == flag(name) and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag(name) + "="):
            value = a.split("=", 1)[1]
    return value


def read_config(path, cls, choices=None):
    """{field: value} from a YAML or JSON file of `cls`'s flags (training/config/flag_file.py's entries: its
    keys, dashes or underscores). Each value is checked exactly as the same flag on the command line: it goes
    through add_fields' parser as its word (`--seed=1.5`: an error; a bool field takes true / false: --flag /
    --no-flag). ValueError, one sentence naming the file and the key, for an unknown key or a bad value; an
    empty file sets nothing."""
    parser = add_fields(
        argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False),
        cls,
        choices,
        suppress=True,
    )  # the command line's parser
    out = {}
    for key, word in flag_file.words(path, cls):
        try:
            out.update(vars(parser.parse_known_args([word])[0]))
        except argparse.ArgumentError as e:
            raise ValueError(f"{path}: {key}: {e.message}") from None
    return out


def check(cfg):
    """grpo.py's rules: the first bad flag of a grpo.Config as one sentence naming it, or None. Runs before
    anything loads (argparse's choices have checked the closed sets: --dataset, --device, --credit, ...)."""
    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
    rules = [
        ("--group-size", cfg.group_size >= 2, "must be >= 2: a group of one has no advantage (eq. 10)"),
        *[
            (flag(k), getattr(cfg, k) >= 1, "must be >= 1")
            for k in (
                "prompts_per_step",
                "max_new_tokens",
                "num_iterations",
                "steps",
                "save_every",
                "rollouts_every",
                "max_bad_steps",
                "logprob_chunk",
                "max_prompt_tokens",
                "top_k",
                "eval_size",
                "keep_checkpoints",
            )
        ],
        ("--eval-every", cfg.eval_every >= 0, "must be >= 0 (0: off)"),
        *[
            (flag(k), getattr(cfg, k) >= 0, "must be >= 0 (0: sized to the card)")
            for k in ("gen_chunk", "micro_batch")
        ],
        *[
            (flag(k), finite(getattr(cfg, k)), "must be a finite number")
            for k in (
                "temperature",
                "top_p",
                "adv_clip",
                "lr",
                "eps_low",
                "eps_high",
                "dual_clip",
                "beta",
                "max_grad_norm",
                "weight_decay",
                "filter_low",
                "filter_high",
            )
        ],
        ("--weight-decay", cfg.weight_decay >= 0, "must be >= 0"),
        ("--lora-rank", cfg.lora_rank >= 0, "must be >= 0 (0: full fine-tuning)"),
        ("--lora-alpha", finite(cfg.lora_alpha) and cfg.lora_alpha > 0, "must be a finite number > 0"),
        ("--lora-dropout", finite(cfg.lora_dropout) and 0 <= cfg.lora_dropout < 1, "must be in [0, 1)"),
        ("--lora-targets", bool(cfg.lora_targets.strip(", ")), "must name modules (or all-linear)"),
        ("--gpu-gb", finite(cfg.gpu_gb) and cfg.gpu_gb >= 0, "must be a finite number >= 0"),
        ("--stop-grace", finite(cfg.stop_grace) and cfg.stop_grace >= 0, "must be a finite number >= 0"),
        *[
            (flag(f.name), abs(getattr(cfg, f.name)) < 2**63, "must fit in int64")
            for f in dataclasses.fields(cfg)
            if f.type in (int, "int")
        ],  # torch's integers
        (
            "--temperature",
            cfg.temperature >= MIN_TEMPERATURE,
            f"must be >= {MIN_TEMPERATURE} (below, logits / T overflows; rollout.MIN_TEMPERATURE)",
        ),
        ("--top-p", 0 < cfg.top_p <= 1, "must be in (0, 1]"),
        ("--adv-clip", cfg.adv_clip > 0, "must be > 0"),
        ("--lr", cfg.lr > 0, "must be > 0"),
        ("--eps-low", 0 <= cfg.eps_low < 1, "must be in [0, 1)"),
        ("--eps-high", cfg.eps_high >= 0, "must be >= 0"),
        ("--dual-clip", cfg.dual_clip > 1, "must be > 1"),
        ("--beta", cfg.beta >= 0, "must be >= 0"),
        ("--max-grad-norm", cfg.max_grad_norm > 0, "must be > 0"),
        ("--warmup-steps", cfg.warmup_steps >= 0, "must be >= 0"),
        ("--filter-low", 0 <= cfg.filter_low <= cfg.filter_high <= 1, "needs 0 <= low <= high <= 1"),
        (
            "--prompt-style",
            cfg.prompt_style == "auto" or data.style_fits(cfg.prompt_style, cfg.dataset.lower()),
            f"{cfg.prompt_style} does not fit --dataset {cfg.dataset} (data.style_fits)",
        ),
        ("--device", cfg.device != "cuda" or torch.cuda.is_available(), "cuda: no GPU is visible"),
    ]
    for name, ok, why in rules:
        if not ok:
            return f"{name} {why}"
    task = cfg.dataset.lower() == "custom" or any(getattr(cfg, k) for k in reward_code.TASK_FLAGS)
    return (
        trainable.precision_problem(cfg) or baselines.check(cfg) or (reward_code.check(cfg) if task else None)
    )


def unused(cfg, given, prog, for_gpu=False):
    """One `prog: notice:` line on stderr for each flag given on the command line (`given`; a --config file's
    and a run_config.json's are not judged) that cannot take effect with the others; the run goes on. cfg:
    grpo.Config, or flowtracer_trl.py's flags (those it lacks are not given). for_gpu: the run is judged as
    one on a GPU whatever this machine has (eval.py memory plans for one)."""
    g = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731

    def made(name):  # the dataset's rows are generated (no file's columns)
        return getattr(data.TASKS.get(str(name).lower()), "generator", None) is not None

    columns = (
        g("data_path")
        or g("eval_data_path")
        or not made(g("dataset"))
        or g("eval_every", 0) > 0
        and not made(g("eval_dataset") or g("dataset"))
    )  # a file's or the hub's rows
    needs = [
        (
            ("lora_alpha", "lora_targets", "lora_dropout"),
            g("lora_rank", 0) > 0,
            "--lora-rank is 0 (full fine-tuning): give --lora-rank R for adapters",
        ),
        (
            ("eval_data_path", "eval_dataset", "eval_size"),
            g("eval_every", 0) > 0,
            "--eval-every is 0 (no held-out evaluation): give --eval-every N",
        ),
        (("filter_low", "filter_high"), g("dynamic_filter"), "--dynamic-filter is off"),
        (
            ("bnb_4bit_quant_type", "use_bnb_nested_quant"),
            g("load_in_4bit"),
            "--load-in-4bit is off (the base is not quantized)",
        ),
        (
            ("question_field", "answer_field"),
            columns,
            f"--dataset {g('dataset')}'s rows are generated "
            f"(no columns to pick): they name a file's, with --data-path or --eval-data-path",
        ),
        (
            ("gpu_gb",),
            for_gpu or g("device") == "cuda" or g("device") == "auto" and torch.cuda.is_available(),
            "the run is on the CPU (it sizes the step to a GPU's memory)",
        ),
        (
            ("overwrite", "config"),
            not g("resume"),
            "--resume continues the run in place, from its own run_config.json",
        ),
        (("allow_config_change",), bool(g("resume")), "it lets a --resume change flags; there is none"),
        (("reward_files",), False, "the run records it itself (each --reward file's path and hash)"),
        (("precision_resolved",), False, "the run records it itself (what --precision resolved to)"),
        (
            ("rollouts_every",),
            g("rollouts_every", 0) <= g("steps", 0),
            f"--steps is {g('steps')}: no step saves its rollouts",
        ),
    ]
    lines = [
        f"{flag(k)} has no effect: {why}"
        for names, ok, why in needs
        if not ok
        for k in names
        if k in given and (k not in ("overwrite", "allow_config_change") or given[k])
    ]
    if "chat_template_kwargs" in given and cfg.chat_template_kwargs:
        from tasks import prompts
        from training.model.load import load_tokenizer

        try:
            tok = load_tokenizer(cfg.model)
        except Exception:  # the model's own load says what is wrong, at setup
            tok = None
        task = data.TASKS[cfg.dataset.lower()].task if cfg.dataset.lower() in data.TASKS else "custom"
        style = cfg.prompt_style if cfg.prompt_style != "auto" else data.default_style(cfg.model, task)
        why = tok and prompts.unread_kwargs(tok, style, reward_code.template_kwargs(cfg))
        lines += [f"--chat-template-kwargs {cfg.chat_template_kwargs}: {why}"] if why else []
    for line in lines:
        print(f"{prog}: notice: {line}", file=sys.stderr)
    return lines


# grpo.Config's closed sets: argparse's choices (a --config file's values are checked against them too)
CHOICES = {
    **baselines.CHOICES,
    "dataset": data.DATASETS,
    "prompt_style": ("auto", *data.STYLES),
    "device": ("auto", "cpu", "cuda"),
    "loss_agg": ("seq-mean", "token-mean"),
    "optimizer": trainable.OPTIMIZERS,
    "precision": trainable.PRECISIONS,
    "bnb_4bit_quant_type": quantize.QUANT_TYPES,
    "report_to": tracking.KINDS,
}


PICKED_BY = ("model", "paper_batch", "lora_rank")  # the flags that put presets in force: in_force's


def in_force(table, model, paper_batch, lora_rank=0) -> list:
    """The labels of the presets in force (training/config/presets.py; `of`: its labels in order, the last
    wins), by what the flags mean: the embedded model (named or not), a paper model (§4.1), --paper-batch,
    LoRA's learning rate (--lora-rank > 0; the embedded model's own). The one place they are decided."""
    paper, embedded = any(k in str(model).lower() for k in presets.PAPER_MODELS), load.is_embedded(model)
    lora = str(lora_rank).isdigit() and int(lora_rank) > 0  # as given on the command line: a word
    on = (embedded, paper, paper_batch, lora and not embedded, lora and embedded)  # presets.of's order
    return [k for k, use in zip(table, on) if use]


def parse(cls, argv, doc, table, prog, for_gpu=False, say=False):
    """A `cls` (grpo.Config) resolved once, from a command line: the defaults, the presets in force
    (in_force: labels of `table`, presets.of's, the last wins), a --config file, then the flags given;
    or, with --resume, the saved run's run_config.json (each value checked as the same flag on the command
    line) and the flags given (training/config/resume.py's rules). A resumed run continues in its own
    directory, wherever it was moved. Bad flags: argparse's one error line. What was given is used here and
    not rebuilt later: the notices of flags that cannot take effect (`unused`; for_gpu: judged as a run on a
    GPU whatever this machine has, as eval.py memory plans one) and, with `say` (grpo.main: a run's first
    lines), where the learning rate in force came from (presets.lr_lines)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    argv_active = in_force(table, *(value_in(argv, k, getattr(cls, k)) for k in PICKED_BY))  # for the help
    head = doc.split("\n\n")[0] + (
        f"\n\nPresets in force: {', '.join(argv_active) or 'none'}; each "
        f"default below says what it sets, and the flags given win."
    )
    p = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [--flag VALUE ...]",
        allow_abbrev=False,
        description=head,
        epilog=doc[doc.index("Run:") :],
        formatter_class=helptext.Formatter,
    )
    add_fields(p, cls, CHOICES, suppress=True, presets=table, active=argv_active)
    given = vars(p.parse_args(argv))  # unknown flags are errors
    file, active = {}, []
    try:
        if given.get("resume"):  # the saved run's config, then the flags given now
            ckpt = ckpt_io.find_checkpoint(given["resume"])
            saved = (
                read_config(ckpt / ckpt_io.RUN_CONFIG, cls, CHOICES)
                if (ckpt / ckpt_io.RUN_CONFIG).is_file()
                else ckpt_io.saved_config(ckpt)
            )
            cfg = cls(**resume.resumed(saved, given, ckpt_io.run_dir(ckpt)))  # in its own directory
        else:  # presets, a --config file, then the flags given
            file = read_config(given["config"], cls, CHOICES) if given.get("config") else {}
            chosen = {**file, **given}
            active = in_force(table, *(chosen.get(k, getattr(cls, k)) for k in PICKED_BY))
            cfg = cls(**{k: v for name in active for k, v in table[name].items()} | file | given)
    except ValueError as e:
        p.error(str(e))
    problem = check(cfg)
    if problem:
        p.error(problem)
    try:
        cfg = resume.reward_record(cfg, given) if cfg.reward or cfg.reward_files else cfg  # --reward's files
    except ValueError as e:
        p.error(str(e))
    unused(cfg, given, prog, for_gpu)
    if say:
        default = comments(cls)[0].get("lr", cls.__name__)  # the lr field's help: its source
        print("\n".join(presets.lr_lines(cfg, given, file, [(k, table[k]) for k in active], default)))
    return cfg
