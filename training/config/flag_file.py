"""A file of flags: a --config YAML or JSON file, or a run's run_config.json, read as {key: value} entries of
a flat dataclass's fields, before any of its values is judged.

    lr: 1e-5          <- a YAML file (.json: JSON) of the same flags the command line takes; its keys the
    top-k: 50            field names with dashes or underscores (top-k, top_k)

`words` reads the file and its keys, and turns each value into the word the command line would give for it
(config_word): one sentence naming the file (and the key) for a file that cannot be read or parsed, that is
not a mapping, for an unknown key (with the nearest field's name), a key given twice or a value no flag takes.
training/config/flags.py's read_config then runs each word through the command line's own parser, so a file
and a command line are checked by the same code (an int field refuses 1.5 as --seed 1.5 is refused).

Run: python -m pytest -q tests/config/test_flag_file.py
"""

import dataclasses
import difflib
import json
from pathlib import Path

import yaml


def words(path, cls) -> list:
    """[(key as written, its word)] of a YAML or JSON file (.json: JSON, else YAML) of `cls`'s flags, in the
    file's order (config_word: `--lr=1e-05`); ValueError naming the file (and the key) when it cannot be read
    or parsed, is not a mapping, or has an unknown key, one given twice (with dashes and with underscores) or
    a value no flag takes. An empty file: []."""
    try:
        text = Path(path).read_text()
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except (ValueError, yaml.YAMLError) as e:  # json's errors are ValueErrors
        why = " ".join(str(e).split())[:200]
        raise ValueError(
            f"{path}: not a {'JSON' if str(path).endswith('.json') else 'YAML'} file ({why})"
        ) from None
    if not isinstance(raw, dict) and raw is not None:
        raise ValueError(f"{path}: expected a mapping of flags (lr: 1e-5), got a {type(raw).__name__}")
    fields, out, seen = {f.name: f for f in dataclasses.fields(cls)}, [], set()
    for key, value in (raw or {}).items():
        name = str(key).replace("-", "_")
        if name not in fields:
            near = difflib.get_close_matches(name, fields, n=1)
            raise ValueError(
                f"{path}: unknown key {key!r} (not a flag of {cls.__name__}"
                + (f"; did you mean {near[0]!r}?)" if near else ")")
            )
        if name in seen:
            raise ValueError(f"{path}: the key {key!r} is given twice (with dashes and with underscores)")
        try:
            out.append((key, config_word(fields[name], value)))
        except ValueError as e:
            raise ValueError(f"{path}: {key}: {e}") from None
        seen.add(name)
    return out


def config_word(f, value):
    """The command-line argument a config file's value stands for: --flag / --no-flag for a bool, else
    `--flag=<the value as written>` (a str as is, a number as JSON writes it); ValueError for a value no
    flag takes (null, a list, a mapping, a bool for a field that is not one, a number for a bool)."""
    name = f.name.replace("_", "-")  # the flag: --top-k
    if f.type in (bool, "bool"):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return f"--{name}" if value else f"--no-{name}"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected {type(f.default).__name__}, got {json.dumps(value, default=str)[:80]}")
    return f"--{name}={value if isinstance(value, str) else json.dumps(value)}"
