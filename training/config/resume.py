"""What a --resume reads from the saved run and what it may change: the rules flags.parse applies to the saved
run's flags (its run_config.json) and to the flags given with --resume, before any tensor.

  anchored       the run's relative files (--data-path, --eval-data-path) found from the directory it was
                 launched in, so a resume from another working directory reads the run's own files
  resume_flags   the flags given, as checkpoint.check_resume_config should judge them: the same --reward
                 functions or the same data file (another spelling) is no change; a LoRA flag that would
                 change the checkpoint's adapters is refused, even with --allow-config-change (ADAPTER);
                 another quantization of the base (QUANT) unless --allow-config-change
  reward_record  each --reward file's path and SHA-256 recorded (--reward-files); a resume whose reward file
                 moved or changed is refused unless --reward is given again

`resumed` applies them in order: the saved flags anchored, the flags given judged (another --model, --lr, ...:
refused, checkpoint.check_resume_config), then merged over the saved ones, the run in its own directory.

Run: python -m pytest -q tests/config/test_resume.py
"""

import dataclasses
from pathlib import Path

from training.run import checkpoint as ckpt_io
from training.usercode import reward_files

PATHS = ("data_path", "eval_data_path")  # the run's files, as given (relative: to where it was launched)

# The LoRA flags a checkpoint's adapters fix (peft's adapter_config.json: rank, alpha, targets, dropout):
# a --resume that gives other values would run with the checkpoint's, whatever run_config.json then says.
ADAPTER = {"lora_rank": 0, "lora_alpha": 32.0, "lora_targets": "all-linear", "lora_dropout": 0.0}
# The base the adapters trained on (training/model/quantize.py): another quantization is another function
# under the same adapters, refused unless --allow-config-change (a run saved before these flags: defaults).
QUANT = {"load_in_4bit": False, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False}


def resumed(saved, given, here) -> dict:
    """The flags of a resumed run: its saved flags (run_config.json) `anchored` to `here`, the run directory,
    the flags `given` with --resume judged (resume_flags, then checkpoint.check_resume_config: a flag that
    changes the run's meaning is refused without --allow-config-change) and merged over them; out_dir is
    `here`, where the run continues. ValueError for an --out-dir elsewhere."""
    here = Path(here)
    saved = anchored(saved, here)  # its files, from any working directory
    ckpt_io.check_resume_config(saved, resume_flags(saved, given))  # another --model ...: refused
    if "out_dir" in given and Path(given["out_dir"]).resolve() != here.resolve():
        raise ValueError(
            f"--resume continues the run in its own directory, {here}: leave out "
            f"--out-dir (copy the directory to continue a copy elsewhere)"
        )
    return {**saved, **given, "out_dir": str(here)}


def anchored(saved, here):
    """A saved run's flags with each relative path of PATHS made absolute from the directory the run was
    launched in, where that file is: the run directory `here` less the out_dir it recorded (runs/a in
    /w/runs/a: /w). A resume from another working directory reads the run's own files."""
    out, rel = dict(saved), Path(str(saved.get("out_dir") or ""))
    here = Path(here).resolve()
    n = len(rel.parts)
    base = (
        Path(*here.parts[:-n])
        if 0 < n < len(here.parts) and not rel.is_absolute() and here.parts[-n:] == rel.parts
        else None
    )
    for k in PATHS:
        p = Path(str(saved.get(k) or ""))
        if base is not None and saved.get(k) and not p.is_absolute() and (base / p).exists():
            out[k] = str(base / p)
    return out


def resume_flags(saved, given):
    """The flags given with --resume as check_resume_config should judge them: a --reward naming the same
    functions of the same files as the run's, or a --data-path / --eval-data-path naming its file (by path:
    another spelling, or the same relative path from another directory) is no change. ValueError, even with
    --allow-config-change, for a LoRA flag that would change the checkpoint's adapters (ADAPTER); without it,
    for another quantization of the base they trained on (QUANT)."""
    same = "reward" in given and reward_files.recorded_paths(
        given["reward"], saved.get("reward_files")
    ) == reward_files.recorded_paths(saved.get("reward") or "", saved.get("reward_files"))
    shape = [
        f"--{k.replace('_', '-')} {saved.get(k, d)!r} -> {given[k]!r}"
        for k, d in ADAPTER.items()
        if k in given and given[k] != saved.get(k, d)
    ]
    if shape:
        raise ValueError(
            f"--resume {given['resume']}: {'; '.join(shape)}: the checkpoint's LoRA adapters "
            f"keep the run's rank, alpha, targets and dropout (adapter_config.json), even with "
            f"--allow-config-change; leave them out, or start a new run with --out-dir"
        )
    quant = [
        f"--{k.replace('_', '-')} {saved.get(k, d)!r} -> {given[k]!r}"
        for k, d in QUANT.items()
        if k in given and given[k] != saved.get(k, d)
    ]
    if quant and not given.get("allow_config_change"):
        four = saved.get("load_in_4bit", False)
        base = f"{saved.get('bnb_4bit_quant_type', 'nf4')} 4-bit" if four else "16/32-bit"
        raise ValueError(
            f"--resume {given['resume']}: {'; '.join(quant)}: the checkpoint's adapters trained on its "
            f"{base} base, and on another base they compute another function; leave them out to continue "
            f"the run, or pass --allow-config-change"
        )
    same_path = {
        k
        for k in PATHS
        if given.get(k)
        and saved.get(k)
        and Path(given[k]).expanduser().resolve() == Path(saved[k]).expanduser().resolve()
    }
    unchanged = same_path | {k for k, d in QUANT.items() if k in given and given[k] == saved.get(k, d)}
    return {k: v for k, v in given.items() if not (k == "reward" and same) and k not in unchanged}


def reward_record(cfg, given):
    """cfg with --reward-files recording each --reward file as given, its resolved path and SHA-256
    (reward_files.fingerprint); ValueError for a file that cannot be read, or, on --resume without --reward
    on the command line, for a reward file that moved or changed since the run recorded it
    (reward_files.changed). A resume without --reward reads each file where the run recorded it
    (reward_files.as_recorded): from any working directory."""
    if cfg.reward and given.get("resume") and "reward" not in given:
        why = reward_files.changed(cfg.reward, cfg.reward_files)
        if why:
            raise ValueError(
                f"--resume {given['resume']}: {why}; give --reward {cfg.reward} again to "
                f"continue with the file as it is now (its new hash is recorded)"
            )
        cfg = dataclasses.replace(cfg, reward=reward_files.as_recorded(cfg.reward, cfg.reward_files))
    return dataclasses.replace(cfg, reward_files=reward_files.fingerprint(cfg.reward) if cfg.reward else "")
