"""Argparse from a flat dataclass: each field is a flag, its trailing comment is the flag's --help line.

    @dataclass
    class Config:
        # update                                      <- a comment line on its own starts a section (a group)
        lr: float = 1e-6   # App. C.3                 <- --lr, its help "App. C.3 (default: 1e-06)"

The help is written once, next to the default (as CleanRL's tyro reads field docstrings, and transformers'
HfArgumentParser reads metadata={"help": ...}). The comments are read from the class source with inspect and
tokenize, for each dataclass in the MRO (grpo.Config inherits credit.CreditConfig's fields). A section comment
with no fields under it places a base class's section of the same name there, so `# credit` in grpo.Config
puts CreditConfig's flags between the reward and the update flags, in the order of the loop.

`commands` reads a script's docstring table of subcommands (`  name   summary`) for eval.py's listing.
"""
import argparse
import dataclasses
import inspect
import io
import re
import tokenize


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (the docstrings' own line breaks); "(default: X)" after each help
    that does not name its default already (or whose default is None: not set)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return text + ' (default: "")' if action.default == "" else super()._get_help_string(action)


def section_key(text):
    return re.split(r"[:(]", text, maxsplit=1)[0].strip().lower()


def comments(cls):
    """({field: help}, [(section title, [fields])]) from the source of cls and its dataclass bases; the fields
    before any section comment come last, under the title None."""
    helps, sections = {}, {}                          # key -> [title, fields], in the order of appearance
    for klass in [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]:       # the derived class first
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):                  # no source (a frozen build): flags without help
            continue
        names = set(klass.__dataclass_fields__)
        lines = {}                                    # line number -> its tokens, without layout tokens
        for t in tokenize.generate_tokens(io.StringIO(src).readline):
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                lines.setdefault(t.start[0], []).append(t)
        section = None
        for toks in lines.values():
            if len(toks) == 1 and toks[0].type == tokenize.COMMENT and toks[0].start[1] > 0:   # a section
                title = toks[0].string.lstrip("#").strip()
                section = sections.setdefault(section_key(title), [title, []])
            elif len(toks) > 2 and toks[0].type == tokenize.NAME and toks[1].string == ":" \
                    and toks[0].string in names and toks[0].start[1] > 0:
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


def add_fields(parser, cls, choices=None, suppress=False, presets=None, skip=()):
    """One flag per field of the dataclass `cls`, in argument groups by its section comments.
    choices: {field: closed set of values}; suppress: a flag not given is absent from the namespace (so the
    caller knows which were given) and the help names the class default itself; presets: {label: {field:
    value}} shown next to the default, e.g. "(default: 500; no --model: 6)"; skip: fields left out."""
    choices, presets = choices or {}, presets or {}
    helps, sections = comments(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for title, names in sections:
        group = parser.add_argument_group(title) if title else parser         # no section: "options"
        for name in (n for n in names if n not in skip):
            f = fields[name]
            text = helps.get(name, "").replace("%", "%%")
            notes = [f"{label}: {p[name]}" for label, p in presets.items() if name in p]
            if suppress:
                shown = f.default if f.default != "" else '""'
                text += f" (default: {shown}" + "".join(f"; {n}" for n in notes) + ")"
            elif notes:
                text += f" ({'; '.join(notes)})"
            kw = dict(default=argparse.SUPPRESS if suppress else f.default, help=text.strip())
            if f.type in (bool, "bool"):
                kw["action"] = argparse.BooleanOptionalAction    # --flag / --no-flag
            else:
                kw["type"] = type(f.default)
                kw["metavar"] = type(f.default).__name__.upper()         # INT, FLOAT, STR
            if name in choices:
                kw["choices"], kw["metavar"] = list(choices[name]), None           # shown as {a,b,c}
            group.add_argument(flag(name), **kw)
    return parser


def commands(doc):
    """{name: (summary, description)} from a docstring's table of subcommands: a line `  name   text` starts
    an entry (its text is the one-line summary), the more-indented lines after it continue the description."""
    out, name = {}, None
    for line in doc.splitlines():
        m = re.match(r"^  ([a-z][\w-]*) {2,}(\S.*)$", line)
        if m:
            name = m.group(1)
            out[name] = [m.group(2).strip(), m.group(2).strip()]
        elif name and line.startswith("   ") and line.strip():
            out[name][1] += "\n" + line.strip()
        else:
            name = None
    return {k: tuple(v) for k, v in out.items()}
