"""Every command explains itself, and every path flag fails in one line.

--help: each script's parser (and each eval.py subcommand's) is captured where the script builds it, and every
flag must carry help text, every subcommand must be listed with a summary, and the help must format; grpo.py's
names every default answer region. Paths: a symlink loop, a dangling link, a file where a directory is
expected and the reverse end in one `<script>: error: ...` line naming the flag, exit 2, never a traceback."""

import argparse
import dataclasses
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev
import grpo
from evaluation import harness, learn
from training.config import flags, helptext
from training.model import trainable

ROOT = Path(grpo.__file__).resolve().parent


class Captured(Exception):
    pass


def parser_of(monkeypatch, run):
    """The first argparse parser `run()` parses with (its parse is stopped there)."""

    def grab(self, *a, **k):
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    with pytest.raises(Captured) as e:
        run()
    monkeypatch.undo()
    return e.value.args[0]


def undocumented(p, where):
    """The flags of `p` (and of its subcommands, recursively) without help, and subcommands not listed."""
    bad = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            listed = {c.dest: c.help for c in a._choices_actions}
            bad += [f"{where} {name}: not listed" for name in a.choices if not listed.get(name)]
            bad += [
                x
                for name, sub in a.choices.items()
                if sub.add_help
                for x in undocumented(sub, f"{where} {name}")
            ]
        elif a.option_strings and (not a.help or a.help == argparse.SUPPRESS or not a.help.strip()):
            bad.append(f"{where} {a.option_strings[0]}: no help")
    p.format_help()  # formats (a stray % would raise here)
    return bad


def script(path, *argv):
    def run():
        sys.argv = [str(path), *argv]
        runpy.run_path(str(path), run_name="__main__")

    return run


SCRIPTS = {
    "grpo.py": lambda: grpo.parse_args([]),
    "eval.py": lambda: ev.parse(["bench"]),
    "eval.py learn": lambda: learn.parse([], "eval.py"),
    "flowtracer_trl.py": lambda: (
        [
            pytest.importorskip(m, reason=f"flowtracer_trl.py needs {m}: pip install -r requirements.txt")
            for m in ("datasets", "trl")
        ]
        and __import__("flowtracer_trl").parse_args([])
    ),
    "data.py": script(ROOT / "data.py"),
    "tasks/countdown.py": script(ROOT / "tasks" / "countdown.py"),
    **{f"benchmarks/{b.name}": script(b) for b in sorted((ROOT / "benchmarks").glob("*.py"))},
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_has_help_and_every_command_is_listed(name, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    p = parser_of(monkeypatch, SCRIPTS[name])
    assert undocumented(p, name) == []


def test_grpo_help_shows_defaults_choices_and_groups(monkeypatch):
    text = " ".join(parser_of(monkeypatch, lambda: grpo.parse_args([])).format_help().split())  # unwrapped
    for s in (
        "--credit {none,flow",
        "(default: flow)",
        "--gamma FLOAT",
        "(default: 1.5)",
        "--steps INT",
        "(default: 6, set by the embedded model; without a preset: 500)",
        "model and dataset:",
        "rollout (App. C.3):",
        "credit (",
        "update:",
        "run:",
    ):
        assert s in text, s
    assert text.index("reward and advantages:") < text.index("--credit {") < text.index("update:")
    helps, _ = flags.comments(grpo.Config)
    assert set(helps) == {f.name for f in dataclasses.fields(grpo.Config)}  # one comment per field


def grpo_help(monkeypatch, argv):
    return " ".join(parser_of(monkeypatch, lambda: grpo.parse_args(argv)).format_help().split())


@pytest.mark.parametrize(
    "argv, in_force, steps, dynamic_filter",
    [
        (
            [],
            "the embedded model",
            "(default: 6, set by the embedded model; without a preset: 500)",
            "(default: False; a paper model: True)",
        ),
        (
            ["--model", "smollm2-135m"],
            "the embedded model",
            "(default: 6, set by the embedded model;",
            "(default: False; a paper model: True)",
        ),
        (
            ["--model=Qwen/Qwen3-4B-Base"],
            "a paper model",
            "(default: 500; the embedded model: 6)",
            "(default: True, set by a paper model; without a preset: False)",
        ),
        (
            ["--model", "tiny-qwen3"],
            "none",
            "(default: 500; the embedded model: 6)",
            "(default: False; a paper model: True)",
        ),
    ],
)
def test_the_help_says_which_preset_is_in_force(argv, in_force, steps, dynamic_filter, monkeypatch):
    text = grpo_help(monkeypatch, argv)
    assert f"Presets in force: {in_force};" in text
    assert f"--steps INT training steps (the paper: 500 for 3B/4B models, 600 for 8B; §4.1) {steps}" in text
    assert dynamic_filter in text[text.index("--dynamic-filter, --no-dynamic-filter") :]


def test_value_in_reads_a_flag_as_argparse_would():
    argv = ["--model", "a", "--steps", "3", "--model=b", "--paper-batch", "--no-paper-batch"]
    assert flags.value_in(argv, "model", "default") == "b"  # the last one wins
    assert flags.value_in(argv, "paper_batch", False) is False
    assert flags.value_in(["--paper-batch"], "paper_batch", False) is True
    assert flags.value_in(["--steps", "3"], "model", "default") == "default"


# Citations and the symbols of a closed set are not an explanation: "App. C.3", "(eq. 6, Table 7)",
# "auto | cpu | cuda". What is left of a help line without them must hold words.
CITATION = re.compile(
    r"App\.\s*[A-Z]\.\d+|eq\.\s*[\d-]+|Table\s*\d+\w?|Fig\.\s*\d+|§\s*[\d.]+"
    r"|\bOAR\b|\bDAPO\b"
)


def words_beyond_citations(text, choices=()):
    """The words of a help comment once citations, the flag's choices and its symbols are taken out."""
    rest = CITATION.sub(" ", text)
    return [w for w in re.findall(r"[A-Za-z][A-Za-z'-]+", rest) if w.lower() not in {str(c) for c in choices}]


def test_words_beyond_citations_tells_an_explanation_from_a_citation():
    assert words_beyond_citations("App. C.3") == []
    assert words_beyond_citations("auto | cpu | cuda", ("auto", "cpu", "cuda")) == []
    assert words_beyond_citations("gamma_flow (eq. 6, Table 7)") == ["gamma", "flow"]  # a symbol
    explained = "sampling temperature of the rollouts (the paper's, §4.1, App. C.3)"
    assert words_beyond_citations(explained)[:4] == ["sampling", "temperature", "of", "the"]


def test_every_grpo_flag_is_explained_in_words():
    """Each flag's comment (grpo.Config and the baselines' BaselineConfig) says what the flag does in at least
    three words besides citations and its choices, and writes no default (the help adds it, once)."""
    helps, _ = flags.comments(grpo.Config)
    short = {k: v for k, v in helps.items() if len(words_beyond_citations(v, flags.CHOICES.get(k, ()))) < 3}
    assert short == {}
    assert [k for k, v in helps.items() if "default" in v.lower()] == []


def test_eval_lists_every_command_with_its_usage(capsys):
    with pytest.raises(SystemExit):
        ev.parse(["--help"])
    top = capsys.readouterr().out
    for name in helptext.commands(ev.__doc__):
        assert f"    {name}" in top, name
    assert set(helptext.commands(ev.__doc__)) == {
        "bench",
        "intervene",
        "recall",
        "memory",
        "plot",
        "credit",
        "learn",
        "answer-forms",
        "deadend",
    }
    with pytest.raises(SystemExit):
        ev.main(["learn", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: eval.py learn") and "--eval-size INT" in out and "Departures" in out


def test_help_in_a_subprocess_exits_0():
    p = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "recall", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 0 and p.stdout.startswith("usage: eval.py recall") and "Traceback" not in p.stderr
    assert "recall@K% of the Oracle's causal tokens" in p.stdout


# ----------------------------------------------------------------------------- path flags
@pytest.fixture
def paths(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (tmp_path / "dir").mkdir()
    return tmp_path


def one_line(capsys, run, prog):
    with pytest.raises(SystemExit) as e:
        run()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err and err[-1].startswith(f"{prog}: error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


GRPO_PATHS = [
    ("--out-dir", "loop", "symlink loop"),
    ("--out-dir", "dangling", "nowhere"),
    ("--out-dir", "file.jsonl", "not a directory"),
    ("--out-dir", "loop/sub", "symlink loop"),
    ("--resume", "loop", "symlink loop"),
    ("--resume", "dangling", "nowhere"),
    ("--resume", "file.jsonl", "a file"),
    ("--resume", "dir", "no complete checkpoint"),
    ("--data-path", "loop", "symlink"),
    ("--data-path", "dangling", "symlink"),
    ("--data-path", "dir", "a directory"),
    ("--model", "loop", "symlink"),
    ("--model", "dangling", "symlink"),
    ("--model", "file.jsonl", "a file"),
    ("--model", "dir", "could not load"),
]


@pytest.mark.parametrize("flag, name, says", GRPO_PATHS, ids=[f"{f} {n}" for f, n, _ in GRPO_PATHS])
def test_grpo_path_flags(flag, name, says, paths, capsys, monkeypatch):
    if flag == "--model":  # the model is the last thing loaded
        monkeypatch.setattr(trainable, "load_policy", lambda cfg, *a, **k: trainable.load_model(cfg.model))
    argv = ["--out-dir", str(paths / "run"), flag, str(paths / name)]
    line = one_line(capsys, lambda: grpo.main(argv), "grpo.py")
    assert says in line and (flag in line or name in line), line


EVAL_PATHS = [
    (["plot", "--figures", "curves", "--metrics"], "loop", "symlink loop"),
    (["plot", "--figures", "curves", "--metrics"], "dangling", "nowhere"),
    (["plot", "--figures", "curves", "--metrics"], "dir", "a directory"),
    (["bench", "--model"], "loop", "symlink loop"),
    (["bench", "--model"], "dangling", "nowhere"),
    (["bench", "--model"], "dir", "without config.json"),
    (["bench", "--out"], "loop", "symlink loop"),
    (["bench", "--out"], "dangling", "nowhere"),
    (["bench", "--out"], "file.jsonl", "not a directory"),
]


@pytest.mark.parametrize("argv, name, says", EVAL_PATHS, ids=[f"{a[-1]} {n}" for a, n, _ in EVAL_PATHS])
def test_eval_path_flags(argv, name, says, paths, capsys, monkeypatch):
    monkeypatch.setattr(
        harness, "load_model", lambda *a, **k: pytest.fail("a model loaded before the path check")
    )
    out = [] if "--out" in argv else ["--out", str(paths / "o")]
    line = one_line(capsys, lambda: ev.main([*argv, str(paths / name), *out]), "eval.py")
    assert says in line and argv[-1] in line, line


@pytest.mark.parametrize(
    "name, says", [("loop", "symlink loop"), ("dangling", "nowhere"), ("file.jsonl", "not a directory")]
)
def test_learn_out_dir(name, says, paths, capsys):
    line = one_line(
        capsys,
        lambda: learn.main(["--out-dir", str(paths / name), "--arms", "none", "--seeds", "1"], grpo),
        "eval.py",
    )
    assert says in line, line


# ----------------------------------------------------------------------------- the answer region's rule
def test_help_names_every_default_answer_region(capsys):
    with pytest.raises(SystemExit):
        grpo.parse_args(["--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    rule = help_[help_.index("--answer-pattern") :][:160]
    assert "\\boxed{}" in rule and "<answer>" in rule, rule
