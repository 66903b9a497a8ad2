"""Where the Triton kernels can run: a CUDA device, Triton, and a C compiler for its launcher.

Triton builds a launcher for each kernel with the host's C compiler at the first call ($CC, else gcc, else
clang: the order of triton/runtime/build.py, which raises "Failed to find C compiler" without one). Runtime
images often have none, so a kernel is chosen only where `unavailable` finds nothing missing.
"""
import importlib.util
import os
import shutil

import torch


def c_compiler():
    """The host C compiler Triton builds its launcher with, or None: $CC, else gcc, else clang."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def unavailable(device):
    """Why a compiled Triton kernel cannot run on `device`, as a few words, or None when it can: a CUDA
    device, Triton importable, and a C compiler for its launcher."""
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not c_compiler():
        return "no C compiler for Triton's launcher ($CC, gcc, clang)"
    return None
