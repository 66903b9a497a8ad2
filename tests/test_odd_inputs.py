"""Odd inputs get one clear error, or mean what their help says: config files of flags (flags.read_config),
paths of the wrong kind where a run writes (run.check_out_dir), a model directory without a tokenizer
(models.load_model), eval.py's numbers and metrics files, and a memory snapshot that is never unpickled;
flags given that cannot take effect (a notice each), names of modules that name nothing, a resume that would
change the LoRA adapters, chat-template keywords that collide with the project's, a cut weights file, a
--gpu-gb past the card, and a resume from another working directory."""

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import eval as ev
import grpo
from evaluation import harness, memtrace
from tasks import prompts
from training import budget, flags, load
from training import checkpoint as ckpt_io
from training import run as run_mod
from training.models import load_model
from training.pretrained import ModelError

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Toy:
    # run
    lr: float = 1e-6  # learning rate
    seed: int = 0  # seed
    name: str = "a"  # a name
    fast: bool = False  # go fast
    mode: str = "x"  # x or y


TOY_CHOICES = {"mode": ("x", "y")}


# ----------------------------------------------------------------------------- flags.read_config
@pytest.mark.parametrize(
    "values, key",
    [
        ({"lr": "abc"}, "lr"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "1.5"}, "seed"),
        ({"seed": True}, "seed"),
        ({"fast": "maybe"}, "fast"),
        ({"fast": 1}, "fast"),
        ({"mode": "z"}, "mode"),
        ({"name": [1]}, "name"),
        ({"seed": None}, "seed"),
        ({"lrr": 1.0}, "lrr"),
        ({"top-k": 3}, "top-k"),
    ],
)
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_bad_config_value_is_one_error_naming_the_file_and_the_key(tmp_path, values, key, suffix):
    f = tmp_path / f"run{suffix}"
    f.write_text(json.dumps(values))  # JSON is YAML too
    with pytest.raises(ValueError) as e:
        flags.read_config(f, Toy, TOY_CHOICES)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ") and key in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "key, word",
    [
        ("lr", "abc"),
        ("lr", "1e-5"),
        ("lr", "3"),
        ("seed", "1.5"),
        ("seed", "-2"),
        ("seed", "1e3"),
        ("mode", "y"),
        ("mode", "z"),
        ("name", "-dash x"),
    ],
)
def test_a_config_value_is_taken_exactly_as_the_same_flag_on_the_command_line(tmp_path, key, word):
    parser = flags.add_fields(argparse.ArgumentParser(exit_on_error=False), Toy, TOY_CHOICES)
    try:
        want = getattr(parser.parse_args([f"--{key}={word}"]), key)
    except argparse.ArgumentError:
        want = None
    f = tmp_path / "c.yaml"
    f.write_text(f"{key}: {json.dumps(word)}\n")  # the word, quoted: a YAML str
    try:
        got = flags.read_config(f, Toy, TOY_CHOICES)[key]
    except ValueError:
        got = None
    assert got == want and type(got) is type(want)


def test_config_keys_take_dashes_or_underscores_in_yaml_or_json(tmp_path):
    y, j = tmp_path / "c.yaml", tmp_path / "c.json"
    y.write_text("top-k: 50\nlr: 1e-5\nshare_prefix: false\ncredit: random\npad-id: -1\n")  # 1e-5: a str
    j.write_text(
        json.dumps({"top_k": 50, "lr": 1e-5, "share-prefix": False, "credit": "random", "pad_id": -1})
    )
    want = {"top_k": 50, "lr": 1e-5, "share_prefix": False, "credit": "random", "pad_id": -1}
    for f in (y, j):
        got = flags.read_config(f, grpo.Config, flags.CHOICES)
        assert got == want and type(got["lr"]) is float and type(got["top_k"]) is int
    y.write_text("top-k: 5\ntop_k: 6\n")
    with pytest.raises(ValueError, match="given twice"):
        flags.read_config(y, grpo.Config, flags.CHOICES)
    y.write_text("")  # an empty file sets nothing
    assert flags.read_config(y, grpo.Config, flags.CHOICES) == {}
    for text, word in (("- 1\n", "a mapping"), ("a: [\n", "not a YAML file")):
        y.write_text(text)
        with pytest.raises(ValueError, match=word):
            flags.read_config(y, grpo.Config, flags.CHOICES)


def test_a_runs_own_run_config_json_reads_back_equal(tmp_path):
    """Written by the checkpoint's writer, read back through the command line's checks: the same Config."""
    cfg = grpo.Config(
        lr=3e-5,
        top_k=7,
        credit="random",
        share_prefix=False,
        data_path="my data.jsonl",
        pad_id=-1,
        temperature=0.7,
        seed=12,
        out_dir=str(tmp_path / "run"),
    )
    model, tok = load_model("tiny-llama")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt_io.save_checkpoint(tmp_path / "run" / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    got = flags.read_config(tmp_path / "run" / "ckpt" / ckpt_io.RUN_CONFIG, grpo.Config, flags.CHOICES)
    assert got == dataclasses.asdict(cfg) and grpo.Config(**got) == cfg


# ----------------------------------------------------------------------------- the run directory
@pytest.mark.parametrize(
    "name, kind",
    [
        ("curves.png", "dir"),
        ("metrics.jsonl", "dir"),
        (".lock", "dir"),
        ("rollouts", "file"),
        ("ckpt", "file"),
        ("ckpt.tmp", "file"),
        ("ckpt.old", "file"),
        ("ckpt", "dangling link"),
    ],
)
@pytest.mark.parametrize(
    "resume, overwrite, claim", [(False, False, False), (False, True, True), (True, False, True)]
)
def test_a_path_of_the_wrong_kind_where_the_run_writes_is_one_error(
    tmp_path, name, kind, resume, overwrite, claim
):
    p = tmp_path / name
    if kind == "dir":
        p.mkdir()
    elif kind == "file":
        p.write_text("mine")
    else:
        p.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ckpt_io.RunError) as e:
        run_mod.check_out_dir(tmp_path, resume=resume, overwrite=overwrite, claim=claim)
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    assert p.is_symlink() or p.exists()  # --overwrite deleted nothing
    assert not (tmp_path / ".lock").is_file()  # checked before the lock is taken


@pytest.mark.parametrize("saved", ["ckpt", "ckpt.tmp", "ckpt.old"])
def test_the_run_directory_of_a_checkpoint_is_the_one_that_holds_it(tmp_path, saved):
    run = tmp_path / "moved" / "run"
    (run / saved).mkdir(parents=True)
    for f in (ckpt_io.MARK, "trainer_state.pt"):
        (run / saved / f).write_text("1")
    for given in (run, run / "ckpt", run / saved):
        assert ckpt_io.run_dir(ckpt_io.find_checkpoint(given)) == run


# ----------------------------------------------------------------------------- model directories
def test_a_model_directory_without_a_tokenizer_is_one_error_before_the_weights_load(tmp_path, monkeypatch):
    model, tok = load_model("tiny-qwen3")
    model.save_pretrained(tmp_path / "m")  # config.json and weights, no tokenizer
    from training import models

    monkeypatch.setattr(
        models.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("the weights loaded before the tokenizer check"),
    )
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path / "m"))
    assert (
        str(tmp_path / "m") in str(e.value)
        and "no tokenizer" in str(e.value)
        and "tokenizer.json" in str(e.value)
    )


def test_a_tokenizer_that_encodes_text_to_no_ids_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model, _ = load_model("tiny-qwen3")
    empty = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab={}, merges=[])), eos_token="<|im_end|>"
    )  # a vocabulary of one special
    model.save_pretrained(tmp_path / "m")
    empty.save_pretrained(tmp_path / "m")  # tokenizer.json is there
    with pytest.raises(ModelError, match="to no token ids") as e:
        load_model(str(tmp_path / "m"))
    assert str(tmp_path / "m") in str(e.value)


# ----------------------------------------------------------------------------- eval.py from the command line
def run_eval(*argv, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *map(str, argv)],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture
def eval_main(in_process):
    """eval.py's main(argv) in this process, read as run_eval's result (conftest.in_process)."""
    return lambda *argv: in_process(ev.main, *argv)


def one_error(p, *words):
    """Exit 2, exactly one `eval.py: error:` line holding `words`, and no traceback."""
    lines = [x for x in p.stderr.splitlines() if x.startswith("eval.py: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_eval_bench_top_k_0_is_off(tmp_path, eval_main):
    p = eval_main(
        "bench",
        "--model",
        "tiny-qwen3",
        "--benchmarks",
        "countdown",
        "--n-problems",
        "1",
        "--n",
        "2",
        "--ks",
        "1",
        "--max-new-tokens",
        "3",
        "--top-k",
        "0",
        "--out",
        tmp_path,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["args"]["top_k"] == 0 and res["benchmarks"]["countdown"]["n_problems"] == 1


@pytest.mark.parametrize(
    "argv, words",
    [
        (["learn", "--seeds", "99999999999999999999"], ["--seeds", "at most"]),
        (["learn", "--seeds", "0,99999999999999999999"], ["--seeds"]),
        (["bench", "--max-new-tokens", "99999999999999999999"], ["--max-new-tokens", "int64"]),
        (["recall", "--n-responses", "-99999999999999999999"], ["--n-responses", "int64"]),
        (["answer-forms", "--percents", "10", "99999999999999999999"], ["--percents"]),
        (["plot", "--metrics"], ["--metrics"]),
        (["plot", "--figures", "curves"], ["--metrics"]),
    ],
)
def test_eval_out_of_range_numbers_and_missing_files_are_one_error_line(tmp_path, eval_main, argv, words):
    one_error(eval_main(*argv, "--out" if argv[0] != "learn" else "--out-dir", tmp_path / "o"), *words)


def test_an_eval_error_from_the_shell_is_one_line_exit_2(tmp_path):
    """The cases above call eval.py's main in this process; this one runs the real command line."""
    p = run_eval("bench", "--max-new-tokens", "99999999999999999999", "--out", tmp_path / "o")
    one_error(p, "--max-new-tokens", "int64")
    assert not (tmp_path / "o").exists()


def test_eval_max_new_tokens_past_the_models_context_is_one_error_line(tmp_path, eval_main):
    one_error(
        eval_main(
            "bench",
            "--model",
            "tiny-qwen3",
            "--benchmarks",
            "countdown",
            "--n-problems",
            "1",
            "--max-new-tokens",
            "100000",
            "--out",
            tmp_path,
        ),
        "--max-new-tokens 100000",
        "2048",
    )


@pytest.mark.parametrize(
    "line",
    [
        '{"step": null, "acc": 0.2}',
        '{"step": "2", "acc": 0.2}',
        '{"step": 1.5, "acc": 0.2}',
        "step 2 acc 0.2",
        "[2, 0.2]",
    ],
)
def test_eval_plot_names_the_file_and_line_of_a_malformed_metrics_line(tmp_path, eval_main, line):
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(f'{{"step": 1, "acc": 0.5}}\n{line}\n{{"step": 3, "acc": 0.7}}\n')
    one_error(eval_main("plot", "--metrics", m, "--keys", "acc", "--out", tmp_path / "o"), f"{m}, line 2")
    assert not (tmp_path / "o" / "curves.png").exists()


def test_eval_plot_keeps_two_runs_of_the_same_name_apart(tmp_path, eval_main):
    paths = []
    for d, acc in (("a", 0.25), ("b", 0.75)):
        m = tmp_path / d / "run" / "metrics.jsonl"
        m.parent.mkdir(parents=True)
        m.write_text(json.dumps({"step": 1, "acc": acc}) + "\n")
        paths.append(m)
    p = eval_main("plot", "--metrics", *paths, "--keys", "acc", "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-2000:]
    ema = json.loads((tmp_path / "o" / "plot.json").read_text())["curves"]["final_peak_ema"]
    assert sorted(ema.values()) == [0.25, 0.75]  # two curves, not one overwritten by the other


# ----------------------------------------------------------------------------- memory snapshots
class Evil:
    """A pickle that creates a file when it is loaded: what a crafted snapshot could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_snapshot_is_read_back_from_its_json_summary_never_unpickled(tmp_path):
    frames = [{"filename": "/x/policy.py", "line": 183, "name": "piece"}]
    snap = {
        "base_allocated": 10**9,
        "window_peak": 15 * 10**8,
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 4 * 10**8, "frames": frames},  # 1.4 GB
                {"action": "alloc", "addr": 2, "size": 10**8, "frames": []},  # 1.5 GB: the peak
                {"action": "free_requested", "addr": 2, "size": 10**8, "frames": []},
            ]
        ],
    }
    path = tmp_path / "snap" / "backward.pickle"
    memtrace.save_snapshot(snap, str(path))
    assert path.read_bytes() == pickle.dumps(snap)  # the pickle is memory_viz's
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps(Evil(marker)))  # swapped for a crafted one
    out = memtrace.report_held(str(path), 12 * 10**8).splitlines()
    assert not marker.exists()  # nothing was unpickled
    assert "peak 1.50 GB" in out[0] and "estimated 1.20" in out[0] and "1.00 GB of it from before" in out[0]
    assert [x.split()[:2] for x in out[2:]] == [["0.400", "1"], ["0.100", "1"]]
    assert out[2].endswith("- | - | policy.py:183 piece")
    Path(str(path) + ".json").unlink()
    with pytest.raises(ValueError, match=r"backward\.pickle\.json"):
        memtrace.report_held(str(path), 1200)
    src = (ROOT / "evaluation" / "memtrace.py").read_text() + (ROOT / "eval.py").read_text()
    assert "pickle.load" not in src


# ----------------------------------------------------------------------------- flags that cannot take effect
TINY_RUN = [
    "--model",
    "tiny-qwen3",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "8",
    "--warmup-steps",
    "1",
    "--lr",
    "1e-3",
]
NOTICES = [  # (flags given, the notice's words): one notice line each, the run goes on
    (["--lora-alpha", "16"], "--lora-alpha has no effect: --lora-rank is 0"),
    (["--lora-targets", "q_proj"], "--lora-targets has no effect: --lora-rank is 0"),
    (["--lora-dropout", "0.1"], "--lora-dropout has no effect: --lora-rank is 0"),
    (["--eval-data-path", "held.jsonl"], "--eval-data-path has no effect: --eval-every is 0"),
    (["--eval-size", "5"], "--eval-size has no effect: --eval-every is 0"),
    (["--gpu-gb", "24", "--device", "cpu"], "--gpu-gb has no effect: the run is on the CPU"),
    (["--filter-high", "0.9"], "--filter-high has no effect: --dynamic-filter is off"),
    (["--allow-config-change"], "--allow-config-change has no effect"),
    (["--rollouts-every", "20", "--steps", "5"], "--rollouts-every has no effect: --steps is 5"),
    (["--reward-files", "[]"], "--reward-files has no effect: the run records it itself"),
    (["--chat-template-kwargs", '{"enable_thinkng": false}'], "the chat template never reads 'enable_thin"),
    (["--prompt-style", "plain", "--chat-template-kwargs", '{"x": 1}'], "'plain' prompt style writes plain"),
]


@pytest.mark.parametrize("argv, words", NOTICES)
def test_a_flag_that_cannot_take_effect_gets_one_notice(capsys, argv, words):
    cfg = grpo.parse_args([*TINY_RUN, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo.py: notice: ") and words in err[0], err
    assert cfg.steps >= 1  # parsed: the run goes on


def test_eval_memory_plans_with_gpu_gb_on_any_machine(monkeypatch, capsys):
    """eval.py memory takes grpo.py's flags to plan a GPU's step from any machine: --gpu-gb takes effect."""
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--gpu-gb", "24"], for_gpu=True)  # eval.py memory's
    assert cfg.gpu_gb == 24 and capsys.readouterr().err == ""
    grpo.parse_args(["--model", "tiny-qwen3", "--gpu-gb", "24", "--device", "cpu"])  # a run on the CPU
    assert "--gpu-gb has no effect" in capsys.readouterr().err


def test_flags_from_a_config_file_are_not_judged(tmp_path, capsys):
    """A run's own config resumes on another device without a word: --config's values get no notice."""
    f = tmp_path / "run.yaml"
    f.write_text("lora_alpha: 16\ngpu_gb: 24\ndevice: cpu\neval_size: 5\nfilter_high: 0.9\n")
    cfg = grpo.parse_args(["--config", str(f), "--model", "tiny-qwen3"])
    assert (cfg.lora_alpha, cfg.gpu_gb) == (16, 24) and capsys.readouterr().err == ""
    grpo.parse_args(
        [*TINY_RUN, "--lora-rank", "4", "--lora-alpha", "16", "--eval-every", "2", "--eval-size", "5"]
    )
    assert capsys.readouterr().err == ""  # each takes effect: no notice


def test_a_misspelt_template_keyword_is_named_with_the_one_it_resembles(tmp_path):
    tok = load_model("tiny-qwen3")[1]
    template = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    )
    try:
        assert prompts.unread_kwargs(tok, "chat", {"enable_thinking": False}) is None
        assert prompts.unread_kwargs(tok, "chat", {"tools": []}) is None  # apply_chat_template's own
        why = prompts.unread_kwargs(tok, "chat", {"enable_thinkng": False})
        assert "never reads 'enable_thinkng' (did you mean 'enable_thinking'?)" in why
        why = prompts.unread_kwargs(tok, "chat", {"enable_thinking": "false"})  # JSON's "false": a string
        assert "'enable_thinking' is a string ('false'), which the template reads as true" in why
    finally:
        tok.chat_template = template


@pytest.mark.parametrize(
    "kwargs",
    [
        '{"tokenize": true}',
        '{"add_generation_prompt": false}',
        '{"return_dict": true}',
        '{"continue_final_message": true}',
    ],
)
def test_template_keywords_the_prompts_set_themselves_are_one_line(tmp_path, capsys, kwargs):
    """They used to raise a TypeError from inside apply_chat_template (grpo.py and the TRL plug-in)."""
    for main, prog in ((grpo.main, "grpo.py"), (None, "flowtracer_trl.py")):
        with pytest.raises(SystemExit) as e:
            if main is None:
                pytest.importorskip("trl")
                import flowtracer_trl

                flowtracer_trl.parse_args(["--chat-template-kwargs", kwargs])
            else:
                main([*TINY_RUN, "--chat-template-kwargs", kwargs, "--out-dir", str(tmp_path / "r")])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and line.startswith(f"{prog}: error: --chat-template-kwargs sets "), line
        assert "which the prompts set themselves" in line and not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- names of modules, LoRA's shape
@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora-targets", "q_proj,v_prj"], "no module of Qwen3ForCausalLM is called 'v_prj'"),
        (["--lora-targets", "qproj"], "is called 'qproj' (its linear layers: down_proj"),
        (["--lora-rank", "1099511627776"], "--lora-rank 1099511627776 is more than any adapted layer's rank"),
        (["--lora-targets", "model"], "names no linear layer of Qwen3ForCausalLM"),
        (["--lora-targets", "all-linear,q_proj"], "all-linear stands alone"),
    ],
)
def test_lora_flags_that_name_nothing_or_ask_too_much_are_one_line(tmp_path, capsys, argv, words):
    """peft fails only when no module matches: q_proj,v_prj trained q_proj alone and recorded v_prj; a rank
    past int32 was a RuntimeError from inside. Nothing is written."""
    with pytest.raises(SystemExit) as e:
        grpo.main([*TINY_RUN, "--lora-rank", "4", *argv, "--out-dir", str(tmp_path / "r")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and line.startswith("grpo.py: error: --lora-") and words in line, line
    assert not (tmp_path / "r").exists()


def test_the_trl_plug_in_checks_each_lora_target(tmp_path, capsys):
    pytest.importorskip("trl")
    import flowtracer_trl

    with pytest.raises(SystemExit) as e:
        flowtracer_trl.main(
            [
                "--model",
                "tiny-qwen3",
                "--lora-rank",
                "4",
                "--lora-targets",
                "q_proj,v_prj",
                "--max-steps",
                "1",
                "--output-dir",
                str(tmp_path / "t"),
            ]
        )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "flowtracer_trl.py: error: --lora-targets" in line and "'v_prj'" in line


def test_the_trl_trainer_refuses_a_pattern_that_does_not_compile_before_it_builds():
    pytest.importorskip("trl")
    import flowtracer_trl

    with pytest.raises(ValueError, match=r"--answer-pattern '\(' does not compile"):
        flowtracer_trl.FlowTracerGRPOTrainer(model=None, answer_pattern="(")


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--lora-targets", "no_such_proj"],
            "--lora-targets no_such_proj: no module of a qwen3 model is called",
        ),
        (["--lora-rank", str(2**40)], f"--lora-rank {2**40} is more than any adapted layer's rank"),
    ],
)
def test_eval_memory_estimates_no_lora_run_grpo_py_refuses(capsys, argv, words):
    """It estimated a run without adapters (a target that names nothing) or of 4.5e10 GB (a rank past every
    layer's). A target outside the decoder layers (lm_head) is a module: estimated, not refused."""
    with pytest.raises(SystemExit) as e:
        ev.main(["memory", "--model", "tiny-qwen3", "--lora-rank", "4", *argv])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and line.startswith("eval.py: error: ") and words in line, line
    ev.main(["memory", "--model", "tiny-qwen3", "--lora-rank", "4", "--lora-targets", "lm_head"])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A one-step rank-4 LoRA run on tiny-qwen3 (its adapters in ckpt/)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    grpo.main([*TINY_RUN, "--lora-rank", "4", "--steps", "1", "--out-dir", str(out)])
    return out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora-rank", "8", "--allow-config-change"], "--lora-rank 4 -> 8"),
        (["--lora-rank", "0", "--allow-config-change"], "--lora-rank 4 -> 0"),
        (["--lora-alpha", "8"], "--lora-alpha 32.0 -> 8.0"),
        (["--lora-targets", "q_proj", "--allow-config-change"], "--lora-targets 'all-linear' -> 'q_proj'"),
    ],
)
def test_a_resume_that_would_change_the_adapters_is_one_line(lora_run, capsys, argv, words):
    """It exited 0 with run_config.json saying rank 8 and the adapters still rank 4 (--lora-rank 0: an empty
    optimizer). --allow-config-change cannot change a checkpoint's adapters."""
    with pytest.raises(SystemExit) as e:
        grpo.main(["--resume", str(lora_run), "--steps", "2", *argv])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and words in line and "adapter_config.json" in line, line
    assert (lora_run / "ckpt" / "COMPLETE").read_text() == "1"


def test_a_cut_weights_file_is_one_line_on_resume_and_in_eval_bench(lora_run, tmp_path, monkeypatch, capsys):
    """A truncated adapter_model.safetensors was a SafetensorError traceback; now one line naming it,
    before any model loads."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(lora_run, run)
    f = run / "ckpt" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(harness, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
    for main, argv in (
        (grpo.main, ["--resume", str(run), "--steps", "2"]),
        (
            ev.main,
            [
                "bench",
                "--model",
                str(run),
                "--benchmarks",
                "gsm8k",
                "--n-problems",
                "1",
                "--out",
                str(tmp_path / "o"),
            ],
        ),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and f"{f}: cut short or corrupted" in line, line
    assert ckpt_io.safetensors_problem(lora_run / "ckpt") is None


def test_a_gpu_gb_past_the_card_is_said_and_the_card_is_taken(monkeypatch, capsys):
    """--gpu-gb 1e9 on a 10 GB card sized the step to 1e9 GB without a word; now a notice, and the card."""
    card = 10 * budget.GB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (card, card))
    cfg = grpo.parse_args(
        ["--model", "qwen3-4b-random", "--gpu-gb", "1e9", "--max-new-tokens", "256", "--lora-rank", "16"]
    )
    capsys.readouterr()
    try:
        budget.size(cfg, torch.device("cuda"), 256)
    except ValueError as e:  # nothing fits 10 GB: the card's size is named
        assert "the GPU has 10.0 GB (torch.cuda.mem_get_info)" in str(e)
    out = capsys.readouterr().out
    assert "--gpu-gb 1e+09 is more than the GPU's 10.0 GB" in out


# ----------------------------------------------------------------------------- resume from elsewhere
def test_a_resume_from_another_directory_reads_the_runs_own_files(tmp_path, monkeypatch, capsys):
    """A run launched in A with relative --data-path and --reward resumes from B: given again by their
    absolute paths (the documented way out: it was refused as a change of meaning), or not given at all."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "train.jsonl").write_text(
        "".join(json.dumps({"q": f"What is {i} + 1?", "a": i + 1}) + "\n" for i in range(3))
    )
    (a / "reward.py").write_text("def score(completion, record):\n    return len(completion) % 3 / 2\n")
    monkeypatch.chdir(a)
    grpo.main(
        [
            *TINY_RUN,
            "--dataset",
            "custom",
            "--data-path",
            "train.jsonl",
            "--question-field",
            "q",
            "--reward",
            "reward.py:score",
            "--steps",
            "1",
            "--out-dir",
            "runs/r",
        ]
    )
    monkeypatch.chdir(b)
    grpo.main(
        [
            "--resume",
            str(a / "runs" / "r"),
            "--steps",
            "2",
            "--reward",
            f"{a / 'reward.py'}:score",
            "--data-path",
            str(a / "train.jsonl"),
        ]
    )
    grpo.main(["--resume", str(a / "runs" / "r"), "--steps", "3"])
    assert (a / "runs" / "r" / "ckpt" / "COMPLETE").read_text() == "3"
    saved = json.loads((a / "runs" / "r" / "ckpt" / "run_config.json").read_text())
    assert saved["data_path"] == str(a / "train.jsonl") and saved["reward"] == f"{a / 'reward.py'}:score"
    (a / "reward.py").write_text("def score(completion, record):\n    return 0.5\n")
    with pytest.raises(SystemExit):  # a changed file: still refused
        grpo.main(["--resume", str(a / "runs" / "r"), "--steps", "4"])
    assert "changed since the run recorded it" in capsys.readouterr().err
