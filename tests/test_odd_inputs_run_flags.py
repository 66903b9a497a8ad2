"""Odd flags to a run get one clear line: flags that cannot take effect (a notice each), names of modules
that name nothing, a resume that would change the LoRA adapters, chat-template keywords that collide with the
project's, a cut weights file, a --gpu-gb past the card, and a resume from another working directory."""

import json

import pytest
import torch
from conftest import TINY_RUN

import eval as ev
import grpo
from evaluation import harness
from tasks import prompts
from training.memory import budget
from training.model import trainable
from training.model.load import load_model
from training.run import checkpoint as ckpt_io

# ----------------------------------------------------------------------------- flags that cannot take effect
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
    monkeypatch.setattr(trainable, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
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
        assert "the GPU has 10.0 GB free of 10.0 GB (torch.cuda.mem_get_info)" in str(e)
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
