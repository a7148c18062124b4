"""How many GNU OpenMP worker threads a process holds, read from ``/proc`` (Linux).

    from ems.testing.openmp import openmp_threads

    t = openmp_threads(pid)   # OpenMpThreads(workers=3, cpus=2)
    t.throttled               # 1 + workers > cpus: libgomp's short spin (100 iterations)

A libgomp worker that waits for work sleeps in a ``futex`` system call that libgomp
issues itself (inline ``syscall`` in ``config/linux/x86/futex.h``, not through libc), so
``/proc/PID/task/TID/syscall`` shows it blocked with its instruction pointer inside a
mapping of ``libgomp*.so*``; no other thread's is. A worker that is still spinning
shows ``running`` and is not counted, so :func:`openmp_threads` samples for a while and
keeps the largest count (a team's workers fall asleep within milliseconds of its last
region). Reading another process's ``syscall`` file takes ptrace access: the caller
is its ancestor or root. Elsewhere (no ``/proc``, no access) it raises ``OSError``.
"""

from __future__ import annotations

import dataclasses
import os
import time

__all__ = ["OpenMpThreads", "openmp_threads"]


@dataclasses.dataclass(frozen=True)
class OpenMpThreads:
    """One process's OpenMP workers and the CPUs it may run on (its affinity mask, as
    libgomp counts them when it loads)."""

    workers: int
    cpus: int

    @property
    def managed(self) -> int:
        """libgomp's ``gomp_managed_threads``: the initial thread plus every worker."""
        return 1 + self.workers

    @property
    def throttled(self) -> bool:
        """Whether libgomp spins its throttled count (100) instead of 300,000."""
        return self.managed > self.cpus


def _libgomp_ranges(pid: int) -> list[tuple[int, int]]:
    ranges = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and "libgomp" in os.path.basename(parts[5]):
                low, high = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((low, high))
    return ranges


def _sleeping_workers(pid: int, ranges: list[tuple[int, int]]) -> int:
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                fields = f.read().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if len(fields) < 9 or fields[0] == "running":
            continue
        pc = int(fields[-1], 16)
        n += any(low <= pc < high for low, high in ranges)
    return n


def openmp_threads(pid: int, sample_s: float = 1.0, interval_s: float = 0.05
                   ) -> OpenMpThreads:
    """The OpenMP workers of ``pid``: the largest count seen in ``sample_s``."""
    cpus = len(os.sched_getaffinity(pid))
    deadline = time.monotonic() + sample_s
    workers = 0
    while True:
        ranges = _libgomp_ranges(pid)  # libgomp may load while we look
        workers = max(workers, _sleeping_workers(pid, ranges) if ranges else 0)
        if time.monotonic() >= deadline:
            return OpenMpThreads(workers=workers, cpus=cpus)
        time.sleep(interval_s)
