"""Where the Triton kernels can run: a CUDA device, Triton, and what Triton's launcher is built with.

At a kernel's first call Triton compiles a C launcher and loads the CUDA driver through it. Each need is
looked for here the way the installed Triton looks for it (triton/runtime/build.py, triton/backends/nvidia/
driver.py; the same in Triton 3.0 to 3.9), so a missing one is named at setup, not raised inside the first
update after minutes of generation:
  compiler  $CC, else gcc, else clang (build.py's _find_compiler); $CC must name a program that exists
  headers   Python.h in sysconfig's include directory of the default scheme (posix_prefix for Debian's
            posix_local), which build.py passes to the compiler: a venv on a Python without its headers
            (python3-dev) has none
  libcuda   libcuda.so.1 in $TRITON_LIBCUDA_PATH when set, else in a directory that `/sbin/ldconfig -p`
            lists, else in one of $LD_LIBRARY_PATH's (driver.py's libcuda_dirs, called itself where the
            installed Triton has it; a container without ldconfig's cache fails there)
Runtime images often lack one of them: a kernel is chosen only where `unavailable` finds nothing missing,
and training/memory/preflight.py still runs each chosen kernel once at setup (what this cannot see: a driver
too old for the kernel, a compiler that fails).

Run: CC=/nonexistent python -c "from gpu_kernels.availability import unavailable; print(unavailable('cuda'))"
"""

import importlib.util
import os
import shutil
import subprocess
import sysconfig

import torch

LDCONFIG = "/sbin/ldconfig"  # the path Triton's driver runs (absolute: not looked up on $PATH)


def c_compiler():
    """The host C compiler Triton builds its launcher with, as a path, or None: $CC, else gcc, else clang
    (a $CC that names no program is None: Triton would take it and fail)."""
    cc = os.environ.get("CC")
    if cc is not None:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def python_headers():
    """The directory whose Python.h Triton's launcher includes, or None where it has none."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # as build.py
    include = sysconfig.get_paths(scheme=scheme)["include"]
    return include if os.path.exists(os.path.join(include, "Python.h")) else None


def has_libcuda(directory):
    return os.path.exists(os.path.join(directory, "libcuda.so.1"))


def libcuda_dirs():
    """The directories that hold libcuda.so.1 among those the installed Triton's driver searches ([] where
    its search raises): its own libcuda_dirs where it has one (triton.backends.nvidia.driver, Triton >= 3.0;
    newer ones read $LD_LIBRARY_PATH when ldconfig is missing too), else `search`, its rule."""
    try:
        from triton.backends.nvidia.driver import libcuda_dirs as triton_search
    except ImportError:
        return search()
    try:
        found = triton_search.__wrapped__()  # not its cache: the env may change
    except Exception:  # noqa: BLE001 (its assert, no ldconfig)
        return []
    return [d for d in found if has_libcuda(d)]  # $TRITON_LIBCUDA_PATH is returned unchecked


def search():
    """Triton's driver's search for libcuda.so.1 ([] where it finds none): $TRITON_LIBCUDA_PATH when set,
    else the directories `/sbin/ldconfig -p` lists, else those of $LD_LIBRARY_PATH."""
    has = has_libcuda
    env = os.environ.get("TRITON_LIBCUDA_PATH")
    if env:
        return [env] if has(env) else []
    try:
        listed = subprocess.run([LDCONFIG, "-p"], capture_output=True, check=True).stdout
        listed = listed.decode(errors="ignore")
    except (OSError, subprocess.CalledProcessError):
        return []  # Triton's check_output raises here
    dirs = [os.path.dirname(line.split()[-1]) for line in listed.splitlines() if "libcuda.so.1" in line]
    if not dirs:
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and has(d)]
    return [d for d in dirs if has(d)]


def unavailable(device):
    """Why a compiled Triton kernel cannot run on `device`, as a few words, or None when it can: a CUDA
    device, Triton importable, a C compiler, Python's headers and libcuda for its launcher (docstring)."""
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not c_compiler():
        return "no C compiler for Triton's launcher ($CC, gcc, clang)"
    if not python_headers():
        return (
            f"no Python.h for Triton's launcher in {sysconfig.get_paths()['include']} (install this "
            "Python's headers, e.g. python3-dev)"
        )
    if not libcuda_dirs():
        return (
            "Triton's driver finds no libcuda.so.1 ($TRITON_LIBCUDA_PATH, `/sbin/ldconfig -p`, "
            "$LD_LIBRARY_PATH)"
        )
    return None
