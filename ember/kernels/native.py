"""The C++ kernels (csrc/: paged attention and RMSNorm in attention.cpp, int4 linear layers in
q4_linear.cpp, the captured decoder step and its elementwise ops in decoder_step.cpp, a MoE step's
routed experts in moe.cpp), built on first use with the system C++ compiler into one library in the
user cache, keyed by the sources,
the flags and the CPU's flags (`-march=native`; -ffp-contract=off and no fast-math keep the bits
the same on any x86 build), and called through ctypes, which releases the GIL. Without a compiler
the engine keeps its torch paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ember.cache import cache_dir

log = logging.getLogger("ember.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "attention.cpp", CSRC / "q4_linear.cpp", CSRC / "decoder_step.cpp", CSRC / "moe.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c++17", "-pthread"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed = False


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        tmp = Path(work) / target.name
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is as good


def library() -> ctypes.CDLL | None:
    """The built kernels, or None when they cannot be built here (logged once)."""
    global _library, _failed
    with _lock:
        if _library is not None or _failed:
            return _library
        try:
            code = b"".join(f.read_bytes() for f in sorted(CSRC.glob("*.*")))  # sources and headers
            digest = hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()[:16]
            target = cache_dir() / "kernels" / f"cpu_kernels-{digest}-{_cpu_key()}.so"
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or e
            log.warning("C++ kernels unavailable, using the torch paths: %s", detail)
            _failed = True
            return None
        fn = lib.ember_paged_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                       ctypes.c_int64, ctypes.c_int]
        norm = lib.ember_rms_norm
        norm.restype = ctypes.c_int
        norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_float]
        q4 = lib.ember_q4_linear
        q4.restype = ctypes.c_int
        q4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        for name, args in (("ember_rope_store", [p, i64, i64, i64, i64, p, p, p, p, p, p]),
                           ("ember_silu_mul", [p, i64, i64, p, ctypes.c_int]),
                           ("ember_moe_dense", [p, i64, i64, p, i64, i64, p, p, ctypes.c_int, p, ctypes.c_int]),
                           ("ember_moe_int4", [p, i64, i64, p, i64, i64, p, p, p, p, p, ctypes.c_int]),
                           ("ember_decoder_step", [p, p, i64, p, p, p, i64, p, i64, f32, f32, i64, p, ctypes.c_int,
                                                   ctypes.c_int])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, args
        _library = lib
        return lib


def available() -> bool:
    return library() is not None
