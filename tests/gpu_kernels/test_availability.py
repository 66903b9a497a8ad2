"""gpu_kernels/availability.py on the CPU: what Triton's launcher needs is found as the installed Triton finds
it (a compiler, Python.h, libcuda), and each one missing is named."""

import os

import pytest

from gpu_kernels import availability

LIB = "libcuda.so.1"


# ----------------------------------------------------------------------------- what Triton's launcher needs
@pytest.fixture
def gpu_box(monkeypatch, tmp_path):
    """A machine where everything Triton needs is present: gcc, Python.h, libcuda via TRITON_LIBCUDA_PATH."""
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / LIB).write_bytes(b"")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(availability.shutil, "which", {"gcc": "/usr/bin/gcc"}.get)
    monkeypatch.setattr(availability, "python_headers", lambda: "/usr/include/python3.11")
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path / "cuda"))
    assert availability.unavailable("cuda") is None
    return tmp_path


def test_a_missing_compiler_headers_or_libcuda_is_named(gpu_box, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent")  # Triton would take it, and fail
    assert "no C compiler" in availability.unavailable("cuda")
    monkeypatch.delenv("CC")
    monkeypatch.setattr(availability, "python_headers", lambda: None)
    assert "no Python.h" in availability.unavailable("cuda")


def test_python_headers_are_looked_for_where_tritons_build_looks(monkeypatch, tmp_path):
    """build.py's include directory: sysconfig's default scheme (posix_local read as posix_prefix)."""
    seen = []
    monkeypatch.setattr(availability.sysconfig, "get_default_scheme", lambda: "posix_local")
    monkeypatch.setattr(
        availability.sysconfig,
        "get_paths",
        lambda scheme=None: seen.append(scheme) or {"include": str(tmp_path)},
    )
    assert availability.python_headers() is None and seen == ["posix_prefix"]
    (tmp_path / "Python.h").write_text("")
    assert availability.python_headers() == str(tmp_path)


def fake_ldconfig(tmp_path, monkeypatch, listing):
    script = tmp_path / "ldconfig"
    script.write_text("#!/bin/sh\ncat <<'EOF'\n" + listing + "\nEOF\n")
    script.chmod(0o755)
    monkeypatch.setattr(availability, "LDCONFIG", str(script))


def test_libcuda_is_found_as_tritons_driver_finds_it(gpu_box, monkeypatch):
    """TRITON_LIBCUDA_PATH first (a directory without the library: none), else the directories `ldconfig -p`
    lists, else LD_LIBRARY_PATH's; without ldconfig at all, none (Triton's driver raises there). The rule
    (`search`) with a fake ldconfig, and libcuda_dirs (the installed Triton's own search, else the rule)."""
    cuda, other = str(gpu_box / "cuda"), str(gpu_box / "other")
    os.mkdir(other)
    assert availability.search() == availability.libcuda_dirs() == [cuda]
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", other)
    assert availability.search() == availability.libcuda_dirs() == []
    assert "no libcuda.so.1" in availability.unavailable("cuda")
    monkeypatch.delenv("TRITON_LIBCUDA_PATH")
    fake_ldconfig(gpu_box, monkeypatch, f"1 libs found\n\t{LIB} (libc6,x86-64) => {cuda}/{LIB}")
    assert availability.search() == [cuda]
    fake_ldconfig(gpu_box, monkeypatch, "0 libs found")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{other}:{cuda}")
    assert availability.search() == [cuda]
    monkeypatch.setattr(availability, "LDCONFIG", str(gpu_box / "no-ldconfig"))
    assert availability.search() == []


def test_libcuda_dirs_agree_with_the_installed_triton(gpu_box, monkeypatch):
    """The installed Triton's own libcuda_dirs (its /sbin/ldconfig, this machine's) against the rule it is
    written from (`search`, the fallback for a Triton without one): the same directories that hold the
    library (it returns $TRITON_LIBCUDA_PATH unchecked, and its link then fails), none where it raises."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    if not os.path.exists(availability.LDCONFIG):
        pytest.skip("no /sbin/ldconfig here")
    cuda, other = str(gpu_box / "cuda"), str(gpu_box / "other")
    os.mkdir(other)

    def triton_dirs():
        try:
            return [d for d in driver.libcuda_dirs.__wrapped__() if os.path.exists(os.path.join(d, LIB))]
        except (AssertionError, OSError):
            return []

    for env in (
        {"TRITON_LIBCUDA_PATH": cuda},
        {"TRITON_LIBCUDA_PATH": other},
        {"TRITON_LIBCUDA_PATH": None, "LD_LIBRARY_PATH": f"{other}:{cuda}"},
    ):
        for k, v in env.items():
            monkeypatch.delenv(k) if v is None else monkeypatch.setenv(k, v)
        assert availability.search() == triton_dirs() == availability.libcuda_dirs(), env
