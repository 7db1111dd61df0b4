"""
How things are measured: interleaved medians of two callables, the peak memory a
call adds, the machine's name (bench/bench.py), and its copy bandwidth (the
memory-bound reference of the decode step). The trainers' matmul rate, Meter and
Logger live in training.py.

    t_a, t_b, (result_a, result_b) = timed_pair(fa, fb, repeats=5, device="cpu")
    peak_bytes = peak_of(fn, device="cpu")
"""
import json
import math
import os
import platform
import statistics
import threading
import time

import torch

from scaleout import distributed


def cpu_name():
    # the CPU model as lscpu shows it (Linux), else what platform knows
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_pair(fa, fb, repeats, device="cpu"):
    """(median a, median b, last results) with a and b interleaved a, b, a, b, ...: on
    a shared machine both see the same background load, so their ratio is steadier
    than either time"""
    fa(), fb()
    ta, tb, out = [], [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        ra = fa()
        sync(device)
        t1 = time.perf_counter()
        rb = fb()
        sync(device)
        tb.append(time.perf_counter() - t1)
        ta.append(t1 - t0)
        out = (ra, rb)
    return statistics.median(ta), statistics.median(tb), out


class PeakMemory:
    """The most memory a block of code added: resident memory sampled every millisecond by
    a thread (CPU, after handing freed memory back to the OS), or the allocator's peak
    (CUDA). Bytes above what was in use when the block began."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        # so that what the block allocates shows up as resident memory it adds
        release_free_memory()
        self.base = self.top = rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.done.wait(0.001):
            self.top = max(self.top, rss())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.done.set()
            self.thread.join()
            self.peak = max(self.top, rss()) - self.base


def release_free_memory():
    # glibc keeps freed memory resident for reuse; malloc_trim hands it back to the OS
    # (elsewhere: a no-op)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mib(n):
    return f"{n / 2 ** 20:,.0f}"


def peak_of(fn, device="cpu"):
    with PeakMemory(device) as m:
        fn()
    return m.peak


def available_bytes(device="cpu"):
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


_COPY_RATE = {}


def measure_copy_bandwidth(device="cpu"):
    """Bytes/s moved by a copy of a buffer far larger than any cache (bytes read + bytes
    written), timed once per process: the memory-bound reference of a decode step."""
    if str(device) not in _COPY_RATE:
        # 1 GiB | 128 MiB
        n = (2 ** 30 if torch.device(device).type == "cuda" else 2 ** 27) // 4
        a, b = torch.ones(n, device=device), torch.empty(n, device=device)
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        (b.copy_(a), sync())
        reps, t0 = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t0 < 0.2:
            b.copy_(a)
            reps += 1
        sync()
        _COPY_RATE[str(device)] = 2 * 4 * n * reps / (time.perf_counter() - t0)
    return _COPY_RATE[str(device)]
