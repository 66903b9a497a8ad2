"""How a script's command line reads beyond a dataclass's flags (training/config/flags.py): argparse's
formatter for the docstrings the scripts open with, a docstring's table of subcommands, and the
--answer-pattern type.

  Formatter       descriptions and epilogs as written (a docstring's own line breaks), and "(default: X)"
                  after each help that does not name its default (grpo.py, eval.py, flowtracer_trl.py)
  commands        {name: (summary, description)} from a docstring's `  name   summary` table: eval.py's
                  subcommands and their --help
  answer_pattern  argparse's type of eval.py plot's --answer-pattern: its one error line before any model
                  loads (tasks/answers.py's pattern_problem)

Run: python eval.py --help
     python -m pytest -q tests/config/test_help.py
"""

import argparse
import re

from tasks.answers import pattern_problem


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (the docstrings' own line breaks); "(default: X)" after each help
    that does not name its default already (or whose default is None: not set)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return text + ' (default: "")' if action.default == "" else super()._get_help_string(action)


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


def answer_pattern(value):
    """argparse's type of an --answer-pattern (eval.py plot): the pattern, or its one error line when it does
    not compile (before any model loads)."""
    if problem := pattern_problem(value):
        raise argparse.ArgumentTypeError(problem.removeprefix("--answer-pattern "))
    return value
