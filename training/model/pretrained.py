"""A pretrained model's files, read into a model and its tokenizer: a directory written by save_pretrained,
or a Hugging Face hub name (the network, or the hub's local cache). Each failure is one ModelError, a
ValueError whose message names the file, directory or hub name and what to do (grpo.py / eval.py print one
line; training/model/load.py raises it for the names it loads itself). load.load_model reads this way a name
that is not one of its own (its aliases, a .gguf file, a LoRA checkpoint) and a GGUF file's cached plain
copy; load.load_tokenizer and load_config ask the hub as from_hub_or_dir does (offline_reason).

Departures (numbered):
  1. A hub name is first checked with one request to the hub (HF_ENDPOINT) without retries: unreachable (or
     HF_HUB_OFFLINE set), the model loads from the hub's local cache alone (local_files_only), or fails at
     once in one line saying what to do. Without it huggingface_hub retries each request 5 times over ~25 s
     (its http_backoff) before transformers gives up with a long message. With the network: unchanged.

Run: python -m pytest -q tests/model/test_load.py -k hub
"""

import contextlib
import os
from pathlib import Path

from huggingface_hub import constants as hub
from huggingface_hub import get_session
from huggingface_hub.errors import RepositoryNotFoundError
from transformers import AutoModelForCausalLM, AutoTokenizer

# The files a tokenizer is read from (fast: tokenizer.json; BPE: vocab.json + merges.txt; WordPiece:
# vocab.txt; SentencePiece: *.model; tiktoken): without any, transformers 5.23 builds an empty one (no ids).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")


class ModelError(ValueError):
    """A model that cannot be loaded: the message names the file or directory and what is wrong with it."""


def looks_local(name):
    """A path, not a hub id: a hub id is "name" or "org/name", so /x, ./x, ~/x, a/b/c and a\\b are paths."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or os.path.exists(name)


def hub_reachable(timeout=3.0):
    """Whether the Hugging Face hub (HF_ENDPOINT) answers one request, without retries (departure 1)."""
    try:
        get_session().head(hub.ENDPOINT, timeout=timeout)  # any HTTP answer: the hub is reachable
    except Exception:  # httpx's errors: no DNS, refused, timed out, a proxy that fails
        return False
    return True


def hub_problem(name, e, offline):
    """One line (< 200 characters for a hub id) saying why a hub model did not load and what to do;
    offline: why the hub was not asked ("": it was)."""
    if offline:
        todo = "unset it on a machine with network" if hub.HF_HUB_OFFLINE else "connect to the network"
        return (
            f"--model {name}: {offline} and the model is not in its cache; {todo}, or pass a local model "
            f"directory"
        )
    cause = e
    while cause is not None and not isinstance(cause, RepositoryNotFoundError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:  # 401 / 404: a wrong name, or a gated / private model
        return (
            f"--model {name}: no such model on the Hugging Face hub (or a gated one: hf auth login); "
            f"check the name, or pass a local directory"
        )
    why = " ".join(str(e).split())[:80]  # one line
    return f"--model {name}: could not load it from the Hugging Face hub ({type(e).__name__}: {why})"


def offline_reason(name):
    """Why the hub is not asked for `name` ("": it is): a local path never; HF_HUB_OFFLINE set, or a hub that
    does not answer (departure 1)."""
    return (
        ""
        if looks_local(name)
        else "HF_HUB_OFFLINE is set"
        if hub.HF_HUB_OFFLINE
        else ""
        if hub_reachable()
        else "the Hugging Face hub is unreachable"
    )


def from_hub_or_dir(name, dtype, attn_implementation, aliases, **kwargs):
    """(model, tokenizer) of a directory written by save_pretrained, or of a hub name (the network, else the
    hub's cache: departure 1); ModelError naming what is wrong. aliases: the names load.py makes itself
    (RANDOM_MODELS), which the messages offer; kwargs: from_pretrained's (a 4-bit read: quantize.py's)."""
    local, path = looks_local(name), Path(name).expanduser()
    if local and not path.is_dir():
        what = (
            "a symlink that leads nowhere (a loop or a missing target)"
            if path.is_symlink() and not path.exists()
            else "a file, not a model directory"
            if path.exists()
            else "no such model directory"
        )
        raise ModelError(
            f"--model {name}: {what}; give a directory written by save_pretrained, a .gguf file "
            f"or a name ({', '.join(['smollm2-135m', *aliases])})"
        )
    if local and (path / "config.json").is_file() and not any(any(path.glob(g)) for g in TOKENIZER_FILES):
        raise ModelError(
            f"--model {name}: the directory holds a model but no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); save one beside it (tokenizer.save_pretrained)"
        )
    offline = offline_reason(name)
    try:  # offline: the hub's cache alone, no request (departure 1)
        model = AutoModelForCausalLM.from_pretrained(
            path if local else name,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=bool(offline),
            **kwargs,
        )
        tok = AutoTokenizer.from_pretrained(path if local else name, local_files_only=bool(offline))
    except Exception as e:  # corrupted weights, a missing config, no network: one line naming it
        if not local:
            raise ModelError(hub_problem(name, e, offline)) from None
        why = " ".join(str(e).split()).rstrip(".")[:200]  # one line
        raise ModelError(
            f"could not load the model from the directory {name}: {type(e).__name__}: {why}; "
            f"pass a directory written by save_pretrained, a local .gguf file, 'smollm2-135m' "
            f"(the embedded model), or one of {', '.join(aliases)}"
        ) from None
    return model, tok


@contextlib.contextmanager
def quiet_bars():
    """transformers' progress bars off inside the block (save_pretrained's "Writing model shards" bar)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
