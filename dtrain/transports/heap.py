"""Keep freed heap memory for reuse, so that a bulk receive does not fault in fresh pages.

Every message grpcio hands to Python is new memory: the core's read slices, then the
bytes of the message built from them (``ReceiveMessageOperation``: one ``bytearray``
grown slice by slice, copied into ``bytes``). A 1 MiB message is freed as soon as its
chunk is decoded, and glibc's allocator returns the top of its heaps to the kernel
once more than ``M_TRIM_THRESHOLD`` bytes are free there (and serves blocks above
``M_MMAP_THRESHOLD`` with ``mmap`` / ``munmap`` of their own): the next message then
faults in every page again. On this project's VMs a page fault costs about as much as
copying the page several times (docs/DECISIONS.md, "gRPC", bulk path), so a receiver
spent more CPU on faults than on copies.

:func:`keep_freed_memory` raises both thresholds once per process (``mallopt``), so
freed message buffers stay mapped and are reused: the process's heap keeps up to
``keep_bytes`` of freed memory (not returned to the kernel until it is reused or the
process exits) and blocks up to ``keep_bytes`` come from the heap. It does nothing
where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

__all__ = ["keep_freed_memory"]

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above half its heap size (32 MiB on 64-bit).
_MAX_MMAP_THRESHOLD = 32 << 20

_lock = threading.Lock()
_done: int | None = None  # the keep_bytes already set in this process


def keep_freed_memory(keep_bytes: int) -> bool:
    """Let glibc's allocator keep up to ``keep_bytes`` bytes of freed heap memory and serve
    blocks up to ``min(keep_bytes, 32 MiB)`` from its heaps (``M_TRIM_THRESHOLD``,
    ``M_MMAP_THRESHOLD``), for the whole process.

    Args:
        keep_bytes: bytes, >= 0; 0 leaves the allocator's own (dynamic) thresholds alone.

    Returns:
        True when the thresholds are set (now or by an earlier call in this process),
        False when ``keep_bytes`` is 0 or the C library has no ``mallopt`` (not glibc).
    """
    global _done
    if keep_bytes <= 0:
        return False
    with _lock:
        if _done is not None and _done >= keep_bytes:
            return True
        mallopt = _mallopt()
        if mallopt is None:
            return False
        ok = mallopt(_M_MMAP_THRESHOLD, min(keep_bytes, _MAX_MMAP_THRESHOLD)) == 1
        ok = mallopt(_M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1)) == 1 and ok
        if ok:
            _done = keep_bytes
            log.debug("malloc keeps up to %d freed bytes (mallopt)", keep_bytes)
        else:
            log.info("mallopt refused the thresholds for keep_bytes=%d; fresh buffers may fault", keep_bytes)
        return ok


def _mallopt():
    """glibc's ``mallopt``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn
