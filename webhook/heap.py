"""Memory the C allocator holds, given back to the system.

Large request bodies and TLS buffers come and go in blocks of hundreds of KiB; glibc keeps
freed blocks in its heap for reuse, so a replica's resident memory would stay near its peak
after a flood of bodies or connections. Other C libraries (musl) have none of these knobs, and
then nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _glibc(function: str) -> Callable[..., int] | None:
    """A glibc memory-tuning function (other C libraries, such as musl, have none)."""
    try:
        found: Callable[..., int] = getattr(ctypes.CDLL(ctypes.util.find_library("c")), function)
    except (OSError, AttributeError):
        return None
    return found


_malloc_trim = _glibc("malloc_trim")
_mallopt = _glibc("mallopt")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_large_blocks_at_once() -> None:
    """Makes every allocation of 128 KiB or more (TLS buffers, 256 KiB per connection; bodies)
    its own mapping, unmapped when freed. glibc's default raises that threshold to the largest
    block freed so far, so after one large body such blocks stay in its heap, and resident
    memory never comes back down after a flood of connections or bodies."""
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def trim_available() -> bool:
    """Whether memory freed in the heap can be given back (glibc's ``malloc_trim``)."""
    return _malloc_trim is not None


def trim() -> None:
    """Gives freed heap memory back to the system. Tens of milliseconds on a fragmented heap:
    run it on a thread (ctypes releases the GIL), not on the event loop."""
    if _malloc_trim is None:
        return
    started = time.perf_counter()
    _malloc_trim(0)
    log.debug("memory given back", extra={"ms": round((time.perf_counter() - started) * 1e3)})
