"""Compile one of dtrain's C sources on first use, cache the library, load it (standard library only).

dtrain has two: the datagram path's batch loop (``transports/dgram_native.c``, see
:mod:`dtrain.transports.datagram_native`) and the blockwise codecs' kernels
(``codecs/kernels.c``, see :mod:`dtrain.codecs.native`). Each is built once with
``$CC`` (default ``gcc``) into ``$DTRAIN_NATIVE_CACHE`` (default ``~/.cache/dtrain-native``)
under a name that hashes the source, compiler, flags and libraries, so a changed source or
compiler builds a new file and later processes load the cached one at once. A build
compiles into a temporary file next to the target and renames it, so concurrent builds are
safe. Any failure (no compiler, no headers, a library that does not load, a version symbol
that does not answer as expected) is returned as a reason, never raised: each caller keeps
a pure-Python path that produces the same bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["COMPILE_TIMEOUT_S", "build_and_load", "cache_dir", "compile_c"]

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$DTRAIN_NATIVE_CACHE`` or ``~/.cache/dtrain-native``."""
    env = os.environ.get("DTRAIN_NATIVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dtrain-native"


def build_and_load(
    source: Path, *, stem: str, cflags: Sequence[str], libs: Sequence[str], version_fn: str, version: int
) -> tuple[ctypes.CDLL | None, str]:
    """``(library, "")``, or ``(None, reason)`` when it cannot be built or loaded.

    Args:
        source: the C file.
        stem: the cached file's name before its hash (``lib<stem>-<hash>.so``).
        cflags, libs: compiler flags and ``-l`` options (part of the hash).
        version_fn: a ``int f(void)`` symbol the library must export ...
        version: ... and the value it must return (a stale or foreign file is refused).
    """
    cc = shlex.split(os.environ.get("CC") or "gcc")
    key = hashlib.sha256(source.read_bytes() + repr((cc, list(cflags), list(libs))).encode()).hexdigest()[:16]
    out = cache_dir() / f"lib{stem}-{key}.so"
    try:
        if not out.exists():
            compile_c(cc, source, cflags, libs, out)
        lib = ctypes.CDLL(str(out))  # CDLL: the GIL is released for every call
        fn = getattr(lib, version_fn)
        fn.restype, fn.argtypes = ctypes.c_int, []
        if fn() != version:
            raise RuntimeError(f"{out} has version {fn()}, expected {version}")
        return lib, ""
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return None, str(e)


def compile_c(
    cc: Sequence[str], source: Path, cflags: Sequence[str], libs: Sequence[str], out: Path, *, executable: bool = False
) -> None:
    """Compile ``source`` to ``out`` (a shared library, or with ``executable`` a program made
    executable): into a temporary file next to ``out``, then renamed (safe against concurrent
    builds). Also netem's delayer's build (``netem/_cdelay.py``).

    Raises:
        RuntimeError: the compiler failed (its rc and the end of its stderr) or wrote nothing.
        OSError, subprocess.SubprocessError: it could not run, or ran past ``COMPILE_TIMEOUT_S``.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*cc, *cflags, "-o", tmp, str(source), *libs], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if proc.returncode != 0:
            raise RuntimeError(f"`{shlex.join(cc)}` failed with rc {proc.returncode}: {proc.stderr.strip()[-500:]}")
        if os.path.getsize(tmp) == 0:
            raise RuntimeError(f"`{shlex.join(cc)}` wrote nothing")
        if executable:
            os.chmod(tmp, 0o755)
        os.replace(tmp, out)
        log.info("compiled %s: %s", source.name, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
