"""Odd inputs get one clear error, or mean what their help says: config files of flags (flags.read_config),
paths of the wrong kind where a run writes (checkpoint.check_out_dir), a model directory without a tokenizer
(models.load_model), eval.py's numbers and metrics files, and a memory snapshot that is never unpickled."""
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

import grpo
from evaluation import memtrace
from training import checkpoint as ckpt_io
from training import flags, runlog
from training.models import ModelError, load_model

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Toy:
    # run
    lr: float = 1e-6                   # learning rate
    seed: int = 0                      # seed
    name: str = "a"                    # a name
    fast: bool = False                 # go fast
    mode: str = "x"                    # x or y


TOY_CHOICES = {"mode": ("x", "y")}


# ----------------------------------------------------------------------------- flags.read_config
@pytest.mark.parametrize("values, key", [
    ({"lr": "abc"}, "lr"), ({"seed": 1.5}, "seed"), ({"seed": "1.5"}, "seed"), ({"seed": True}, "seed"),
    ({"fast": "maybe"}, "fast"), ({"fast": 1}, "fast"), ({"mode": "z"}, "mode"), ({"name": [1]}, "name"),
    ({"seed": None}, "seed"), ({"lrr": 1.0}, "lrr"), ({"top-k": 3}, "top-k"),
])
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_bad_config_value_is_one_error_naming_the_file_and_the_key(tmp_path, values, key, suffix):
    f = tmp_path / f"run{suffix}"
    f.write_text(json.dumps(values))                        # JSON is YAML too
    with pytest.raises(ValueError) as e:
        flags.read_config(f, Toy, TOY_CHOICES)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ") and key in msg and "\n" not in msg, msg


@pytest.mark.parametrize("key, word", [("lr", "abc"), ("lr", "1e-5"), ("lr", "3"), ("seed", "1.5"),
                                       ("seed", "-2"), ("seed", "1e3"), ("mode", "y"), ("mode", "z"),
                                       ("name", "-dash x")])
def test_a_config_value_is_taken_exactly_as_the_same_flag_on_the_command_line(tmp_path, key, word):
    parser = flags.add_fields(argparse.ArgumentParser(exit_on_error=False), Toy, TOY_CHOICES)
    try:
        want = getattr(parser.parse_args([f"--{key}={word}"]), key)
    except argparse.ArgumentError:
        want = None
    f = tmp_path / "c.yaml"
    f.write_text(f"{key}: {json.dumps(word)}\n")            # the word, quoted: a YAML str
    try:
        got = flags.read_config(f, Toy, TOY_CHOICES)[key]
    except ValueError:
        got = None
    assert got == want and type(got) is type(want)


def test_config_keys_take_dashes_or_underscores_in_yaml_or_json(tmp_path):
    y, j = tmp_path / "c.yaml", tmp_path / "c.json"
    y.write_text("top-k: 50\nlr: 1e-5\nshare_prefix: false\ncredit: random\npad-id: -1\n")   # 1e-5: a str
    j.write_text(json.dumps({"top_k": 50, "lr": 1e-5, "share-prefix": False, "credit": "random",
                             "pad_id": -1}))
    want = {"top_k": 50, "lr": 1e-5, "share_prefix": False, "credit": "random", "pad_id": -1}
    for f in (y, j):
        got = flags.read_config(f, grpo.Config, grpo.CHOICES)
        assert got == want and type(got["lr"]) is float and type(got["top_k"]) is int
    y.write_text("top-k: 5\ntop_k: 6\n")
    with pytest.raises(ValueError, match="given twice"):
        flags.read_config(y, grpo.Config, grpo.CHOICES)
    y.write_text("")                                         # an empty file sets nothing
    assert flags.read_config(y, grpo.Config, grpo.CHOICES) == {}
    for text, word in (("- 1\n", "a mapping"), ("a: [\n", "not a YAML file")):
        y.write_text(text)
        with pytest.raises(ValueError, match=word):
            flags.read_config(y, grpo.Config, grpo.CHOICES)


def test_a_runs_own_run_config_json_reads_back_equal(tmp_path):
    """Written by the checkpoint's writer, read back through the command line's checks: the same Config."""
    cfg = grpo.Config(lr=3e-5, top_k=7, credit="random", share_prefix=False, data_path="my data.jsonl",
                      pad_id=-1, temperature=0.7, seed=12, out_dir=str(tmp_path / "run"))
    model, tok = load_model("tiny-llama")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    runlog.save_checkpoint(tmp_path / "run" / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    got = flags.read_config(tmp_path / "run" / "ckpt" / ckpt_io.RUN_CONFIG, grpo.Config, grpo.CHOICES)
    assert got == dataclasses.asdict(cfg) and grpo.Config(**got) == cfg


# ----------------------------------------------------------------------------- the run directory
@pytest.mark.parametrize("name, kind", [("curves.png", "dir"), ("metrics.jsonl", "dir"), (".lock", "dir"),
                                        ("rollouts", "file"), ("ckpt", "file"), ("ckpt.tmp", "file"),
                                        ("ckpt.old", "file"), ("ckpt", "dangling link")])
@pytest.mark.parametrize("resume, overwrite, claim", [(False, False, False), (False, True, True),
                                                      (True, False, True)])
def test_a_path_of_the_wrong_kind_where_the_run_writes_is_one_error(tmp_path, name, kind, resume, overwrite,
                                                                    claim):
    p = tmp_path / name
    if kind == "dir":
        p.mkdir()
    elif kind == "file":
        p.write_text("mine")
    else:
        p.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ckpt_io.RunError) as e:
        ckpt_io.check_out_dir(tmp_path, resume=resume, overwrite=overwrite, claim=claim)
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    assert p.is_symlink() or p.exists()                      # --overwrite deleted nothing
    assert not (tmp_path / ".lock").is_file()                # checked before the lock is taken


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
    model.save_pretrained(tmp_path / "m")                    # config.json and weights, no tokenizer
    from training import models
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded before the tokenizer check"))
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path / "m"))
    assert str(tmp_path / "m") in str(e.value) and "no tokenizer" in str(e.value) and "tokenizer.json" in \
        str(e.value)


def test_a_tokenizer_that_encodes_text_to_no_ids_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    model, _ = load_model("tiny-qwen3")
    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={}, merges=[])),
                                    eos_token="<|im_end|>")                      # a vocabulary of one special
    model.save_pretrained(tmp_path / "m")
    empty.save_pretrained(tmp_path / "m")                    # tokenizer.json is there
    with pytest.raises(ModelError, match="to no token ids") as e:
        load_model(str(tmp_path / "m"))
    assert str(tmp_path / "m") in str(e.value)


# ----------------------------------------------------------------------------- eval.py from the command line
def run_eval(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *map(str, argv)], cwd=cwd, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_error(p, *words):
    """Exit 2, exactly one `eval.py: error:` line holding `words`, and no traceback."""
    lines = [x for x in p.stderr.splitlines() if x.startswith("eval.py: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_eval_bench_top_k_0_is_off(tmp_path):
    p = run_eval("bench", "--model", "tiny-qwen3", "--benchmarks", "countdown", "--n-problems", "1",
                 "--n", "2", "--ks", "1", "--max-new-tokens", "3", "--top-k", "0", "--out", tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["args"]["top_k"] == 0 and res["benchmarks"]["countdown"]["n_problems"] == 1


@pytest.mark.parametrize("argv, words", [
    (["learn", "--seeds", "99999999999999999999"], ["--seeds", "at most"]),
    (["learn", "--seeds", "0,99999999999999999999"], ["--seeds"]),
    (["bench", "--max-new-tokens", "99999999999999999999"], ["--max-new-tokens", "int64"]),
    (["recall", "--n-responses", "-99999999999999999999"], ["--n-responses", "int64"]),
    (["answer-forms", "--percents", "10", "99999999999999999999"], ["--percents"]),
    (["plot", "--metrics"], ["--metrics"]),
    (["plot", "--figures", "curves"], ["--metrics"]),
])
def test_eval_out_of_range_numbers_and_missing_files_are_one_error_line(tmp_path, argv, words):
    one_error(run_eval(*argv, "--out" if argv[0] != "learn" else "--out-dir", tmp_path / "o"), *words)


def test_eval_max_new_tokens_past_the_models_context_is_one_error_line(tmp_path):
    one_error(run_eval("bench", "--model", "tiny-qwen3", "--benchmarks", "countdown", "--n-problems", "1",
                       "--max-new-tokens", "100000", "--out", tmp_path), "--max-new-tokens 100000", "2048")


@pytest.mark.parametrize("line", ['{"step": null, "acc": 0.2}', '{"step": "2", "acc": 0.2}',
                                  '{"step": 1.5, "acc": 0.2}', 'step 2 acc 0.2', '[2, 0.2]'])
def test_eval_plot_names_the_file_and_line_of_a_malformed_metrics_line(tmp_path, line):
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(f'{{"step": 1, "acc": 0.5}}\n{line}\n{{"step": 3, "acc": 0.7}}\n')
    one_error(run_eval("plot", "--metrics", m, "--keys", "acc", "--out", tmp_path / "o"), f"{m}, line 2")
    assert not (tmp_path / "o" / "curves.png").exists()


def test_eval_plot_keeps_two_runs_of_the_same_name_apart(tmp_path):
    paths = []
    for d, acc in (("a", 0.25), ("b", 0.75)):
        m = tmp_path / d / "run" / "metrics.jsonl"
        m.parent.mkdir(parents=True)
        m.write_text(json.dumps({"step": 1, "acc": acc}) + "\n")
        paths.append(m)
    p = run_eval("plot", "--metrics", *paths, "--keys", "acc", "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-2000:]
    ema = json.loads((tmp_path / "o" / "plot.json").read_text())["curves"]["final_peak_ema"]
    assert sorted(ema.values()) == [0.25, 0.75]                # two curves, not one overwritten by the other


# ----------------------------------------------------------------------------- memory snapshots
class Evil:
    """A pickle that creates a file when it is loaded: what a crafted snapshot could do."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_snapshot_is_read_back_from_its_json_summary_never_unpickled(tmp_path):
    frames = [{"filename": "/x/policy.py", "line": 183, "name": "piece"}]
    snap = {"base_allocated": 10 ** 9, "window_peak": 15 * 10 ** 8, "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 4 * 10 ** 8, "frames": frames},          # 1.4 GB
        {"action": "alloc", "addr": 2, "size": 10 ** 8, "frames": []},                  # 1.5 GB: the peak
        {"action": "free_requested", "addr": 2, "size": 10 ** 8, "frames": []}]]}
    path = tmp_path / "snap" / "backward.pickle"
    memtrace.save_snapshot(snap, str(path))
    assert path.read_bytes() == pickle.dumps(snap)                    # the pickle is memory_viz's
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps(Evil(marker)))                      # swapped for a crafted one
    out = memtrace.report_held(str(path), 12 * 10 ** 8).splitlines()
    assert not marker.exists()                                         # nothing was unpickled
    assert "peak 1.50 GB" in out[0] and "estimated 1.20" in out[0] and "1.00 GB of it from before" in out[0]
    assert [x.split()[:2] for x in out[2:]] == [["0.400", "1"], ["0.100", "1"]]
    assert out[2].endswith("- | - | policy.py:183 piece")
    Path(str(path) + ".json").unlink()
    with pytest.raises(ValueError, match=r"backward\.pickle\.json"):
        memtrace.report_held(str(path), 1200)
    src = (ROOT / "evaluation" / "memtrace.py").read_text() + (ROOT / "eval.py").read_text()
    assert "pickle.load" not in src
