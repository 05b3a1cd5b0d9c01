"""The C++ library of the CPU kernels: compiled at first use, cached, loaded with ctypes.

The sources in csrc/ (`kernels.cpp`: magnitude statistics and selections;
`thc_kernels.cpp`: FWHT and THC's encoding; `common.h`) form one plain C-ABI library with
no torch headers. It is compiled with the system C++ compiler (about a second) into a
cache folder, under a name keyed by the sources, the compiler's version, the CPU's
instruction set and the flags, so a library built for other sources or another CPU is
never reused; `ABI_VERSION` must match what the library reports. Nothing here raises:
without a compiler, on a failed build, or with GRADCOMP_NATIVE=0, `load()` answers None
and every caller takes the pure-torch reference path (compressors/kernels/ops.py).

Environment:
  GRADCOMP_NATIVE=0          never build or load the library, nor use the Triton kernels
  GRADCOMP_NATIVE_CACHE=DIR  where the built library is kept (default
                             $XDG_CACHE_HOME/gradcomp-repro or ~/.cache/gradcomp-repro)
  CXX                        the compiler (default: c++, then g++, then clang++)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("kernels.cpp", "thc_kernels.cpp")
HEADERS = ("common.h",)
# What gc_abi_version() returns: raised whenever an exported function changes.
ABI_VERSION = 18
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off")
# Tried in order: OpenMP first (the kernels then run on torch's own OpenMP workers,
# common.h) and the host's instruction set first; then without either.
ARCH_FLAGS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def enabled_by_environment() -> bool:
    """False where GRADCOMP_NATIVE says 0/false/no/off (read at every call)."""
    value = os.environ.get("GRADCOMP_NATIVE")  # (unset: enabled, without parsing)
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    explicit = os.environ.get("GRADCOMP_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradcomp-repro"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: a library built for another CPU is never reused."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    text += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return text


def compile_library(cxx: str, target: Path, source_dir: Path = SOURCE_DIR,
                    arch: tuple[str, ...] | None = None) -> None:
    """Compile the sources of `source_dir` into `target` with the package's flags: `arch`,
    or the first of ARCH_FLAGS the compiler accepts. RuntimeError with each command's
    errors when none does."""
    errors = []
    for flags in (ARCH_FLAGS if arch is None else (arch,)):
        cmd = [cxx, *BASE_FLAGS, *flags, *(str(source_dir / name) for name in SOURCES),
               "-o", str(target)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            return
        errors.append(f"{' '.join(cmd)}:\n{done.stderr.strip()[-2000:]}")
    raise RuntimeError("\n".join(errors))


def check_owned(path: Path) -> None:
    """Refuse a cache folder or library that another user owns or may write: the library
    is loaded into this process, so whoever can replace it runs code here."""
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise RuntimeError(f"{path} belongs to user id {st.st_uid}, not this user "
                           f"({os.getuid()}); set GRADCOMP_NATIVE_CACHE to a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "any user" if st.st_mode & stat.S_IWOTH else "its group"
        raise RuntimeError(f"{path} may be written by {who} (mode {stat.filemode(st.st_mode)});"
                           " remove that permission (chmod go-w) or set GRADCOMP_NATIVE_CACHE to "
                           "a folder of your own")


def _build(cxx: str) -> Path:
    source = b"".join((SOURCE_DIR / name).read_bytes() for name in SOURCES + HEADERS)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    key = hashlib.sha256(source + version.encode() + _cpu_signature().encode()
                         + " ".join(BASE_FLAGS).encode()).hexdigest()[:16]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_owned(folder)
    target = folder / f"gradcomp_kernels_{ABI_VERSION}_{key}.so"
    if target.exists():
        check_owned(target)
        return target
    # Built under a private name, then renamed: concurrent first uses (several ranks,
    # pytest workers) never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        compile_library(cxx, Path(tmp))
        os.replace(tmp, target)
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def open_library(path: str | Path) -> ctypes.CDLL:
    """A built library, checked against ABI_VERSION (RuntimeError when it differs)."""
    lib = ctypes.CDLL(str(path))
    lib.gc_abi_version.restype = ctypes.c_int
    if lib.gc_abi_version() != ABI_VERSION:
        raise RuntimeError("stale library in the cache (ABI version differs)")
    return lib


def load() -> ctypes.CDLL | None:
    """The library, building it on first use; None (with the reason in `error()`) when
    disabled or unavailable. Never raises: a missing compiler means the reference path."""
    global _lib, _tried, _error
    if not enabled_by_environment():
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            cxx = compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            _lib = open_library(_build(cxx))
        except Exception as exc:  # any failure: fall back, say why once
            _error = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"gradcomp native kernels unavailable, using the pure-torch "
                          f"paths ({_error})", RuntimeWarning, stacklevel=2)
            _lib = None
        _tried = True
    return _lib


def available() -> bool:
    return load() is not None


def error() -> str | None:
    """Why the library could not be built or loaded (None when it was, or not tried)."""
    return _error


def use(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """Make `lib` (a library open_library returned) the one every kernel calls, and
    return the one it replaces: for a benchmark that compares two builds in one process."""
    global _lib, _tried
    with _lock:
        old, _lib, _tried = _lib, lib, True
    return old
