"""runtime/host_malloc.py: a rank's freed host buffers stay mapped ([Note: glibc's mmap threshold]).

Each case runs in a fresh interpreter, because mallopt settings last for the process. glibc's
`mallinfo2` shows where an allocation came from: `hblkhd` counts the bytes in chunks that got their
own mmap, `keepcost` the free bytes at the top of the heap that a trim would give back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUFFER_MIB = 16

SCRIPT = f"""
import ctypes, json, sys
from runtime.host_malloc import keep_freed_memory_mapped

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = MallInfo2
configured = keep_freed_memory_mapped() if sys.argv[1] == "configure" else None
buf = libc.malloc({BUFFER_MIB} << 20)
mapped_alone = libc.mallinfo2().hblkhd
libc.free(buf)
print(json.dumps({{"configured": configured, "mapped_alone_bytes": mapped_alone,
                  "kept_after_free_bytes": libc.mallinfo2().keepcost}}))
"""


def run_script(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


pytestmark = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                                reason="mallopt's parameters are glibc's")


def test_glibc_default_maps_a_fresh_process_large_buffer_and_returns_it() -> None:
    """The behaviour the settings change: a fresh process mmaps a 16 MiB buffer of its own."""
    result = run_script("default")
    assert result["mapped_alone_bytes"] >= BUFFER_MIB << 20, result
    assert result["kept_after_free_bytes"] < BUFFER_MIB << 20, result


def test_configured_process_serves_large_buffers_from_the_heap_and_keeps_them() -> None:
    result = run_script("configure")
    assert result["configured"] is True
    assert result["mapped_alone_bytes"] < BUFFER_MIB << 20, result
    assert result["kept_after_free_bytes"] >= BUFFER_MIB << 20, result


def test_users_own_glibc_tunables_win() -> None:
    result = run_script("configure", MALLOC_MMAP_THRESHOLD_="65536")
    assert result["configured"] is False
    assert result["mapped_alone_bytes"] >= BUFFER_MIB << 20, result
