"""training/config/flag_file.py through flags.read_config: a config file of flags gets one clear error naming
the file and the key, or means what the same flag means on the command line; its keys take dashes or
underscores in YAML or JSON, and a run's own run_config.json reads back equal."""

import argparse
import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

import grpo
from training.config import flags
from training.model.load import load_model
from training.run import checkpoint as ckpt_io


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
    model, tok = load_model("tiny-llama", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt_io.save_checkpoint(tmp_path / "run" / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    got = flags.read_config(tmp_path / "run" / "ckpt" / ckpt_io.RUN_CONFIG, grpo.Config, flags.CHOICES)
    assert got == dataclasses.asdict(cfg) and grpo.Config(**got) == cfg
