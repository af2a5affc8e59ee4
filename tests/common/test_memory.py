"""`share_one_heap`: the threads a process starts afterwards allocate from glibc's one main heap."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

HEAPS_AFTER_THREADS = """
import ctypes, sys, tempfile, threading
from services.common.memory import share_one_heap
if sys.argv[1] == "one":
    share_one_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
held, started = [], threading.Barrier(4)
def allocate():
    started.wait()  # all four at once: each needs an arena while the others hold theirs
    held.append(libc.malloc(64 << 10))
threads = [threading.Thread(target=allocate) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
with tempfile.NamedTemporaryFile("r") as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(out.read().count("<heap nr="))
"""


def heaps(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", HEAPS_AFTER_THREADS, mode], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_threads_started_after_share_one_heap_allocate_from_the_main_heap():
    assert heaps("default") > 1  # glibc gives concurrent threads arenas of their own
    assert heaps("one") == 1
