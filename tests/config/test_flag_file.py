"""Odd inputs get one clear error, or mean what their help says: config files of flags (flags.read_config),
paths of the wrong kind where a run writes (run.check_out_dir) and a model directory without a tokenizer
(load.load_model)."""

import argparse
import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

import grpo
from training.config import flags
from training.model.load import load_model
from training.model.pretrained import ModelError
from training.run import checkpoint as ckpt_io
from training.run import setup as run_mod


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
    from training.model import load

    monkeypatch.setattr(
        load.AutoModelForCausalLM,
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
