"""training/config/flags.py's notices: a flag that cannot take effect gets one notice line and the run goes on
(flags.unused); a --config file's values are not judged. Every flag's help: tests/config/test_help.py;
grpo.py's errors: tests/test_grpo_cli.py."""

import pytest
from conftest import TINY_RUN

import grpo

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
