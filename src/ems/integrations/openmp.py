"""GNU OpenMP's wait regime in an engine's process, and the one small op per thread
that sets it (:class:`OpenMpJoin`, used by SGLang's ``EmsStorage``).

**The mechanism** (libgomp, ``config/linux/wait.h``): a thread waiting at an OpenMP
barrier, or a worker waiting for the next parallel region, spins before it sleeps on a
futex: ``GOMP_SPINCOUNT`` iterations, 300,000 by default (``OMP_WAIT_POLICY`` unset),
but only 100 (the *throttled* count) while the process's managed threads exceed the
CPUs it may run on. Managed threads are 1 (the initial thread) plus every worker of
every thread's team. A thread's first parallel region gives it a team of its own
(torch's ``at::parallel_for`` always starts the full ``torch.get_num_threads()``
team; its workers live as long as that thread).

A CPU engine's forward runs on its scheduler thread with T = CPUs threads: T - 1
workers, 1 + (T - 1) = CPUs managed threads, *not* over the line. So every barrier of
the forward spins 300,000 iterations, and on a loaded host (another core busy, SGLang's
own threads, the pool daemon copying a backup) the spinning thread holds a CPU its
team-mate needs. SGLang's own ``file`` backend runs page-sized torch ops on its
prefetch thread (``torch.zeros`` of a page, a copy into the host pool): the first one
past torch's grain size (32,768 elements) gives that thread a team, the process goes
over the line, its forward's barriers spin 100 iterations and then sleep. ems copies
in its own C code and never did: measured in one run with one core kept busy, hit
TTFT ems 1.66 s against ``file`` 0.75 s (the issue's profile: ems's prefetch itself
completed in 10-30 ms against 30-750 ms for ``file``); with this op run once on each
SGLang storage thread, ems 0.56 s; with ``OMP_WAIT_POLICY=PASSIVE`` for both (no
spinning at all), ems 0.58 s and ``file`` 0.63 s. A cold prompt (a miss, its pages
backed up beside the forward) loses its time the same way: py-spy (``--native``, 50 Hz)
on the scheduler, one core kept busy, three 1056-token cold prompts: without this op
10.9% of the scheduler thread's samples sat in libgomp's spin (TTFT median 21.9 s);
with it 0.9% (19.8 s). The rest is the prefill itself (82-90% in torch's AVX2 bf16
dot); ems's own threads (lookup, health, socket watcher) and SGLang's backup thread
sampled only in their waits. The benchmark (``benchmarks/sglang_ttft.py``) records
each engine's OpenMP workers beside its TTFT.

**The fix**: the first time a thread calls the backend, one parallel fill of
:data:`WARMUP_ELEMENTS` floats (twice the grain size, ~0.1 ms after the team exists)
runs on it; from then on that thread owns a sleeping team of T - 1 workers, like the
``file`` backend's prefetch thread. Per thread (``threading.local``)::

    NEW --first join()--> JOINED        (the team lives and dies with the thread)

so the threads SGLang restarts (``flush_cache`` resets its storage threads) join again.
Where T = 1 (SGLang sets ``torch.set_num_threads(1)`` for every non-CPU device, so a
GPU engine) the fill runs on the calling thread alone and starts no team: nothing to
pay. ``OMP_WAIT_POLICY=PASSIVE`` in the engine's environment (read once, when
libgomp loads) makes every wait sleep at once and is the setting to use for CPU
deployments; this op is what a default environment gets.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["WARMUP_ELEMENTS", "OpenMpJoin"]

#: the warm-up fill's length: twice torch's parallel grain size (``at::internal::
#: GRAIN_SIZE``, 32768), so ``at::parallel_for`` goes parallel on any T > 1
WARMUP_ELEMENTS = 1 << 16


class OpenMpJoin:
    """Runs the warm-up op once on each thread that calls :meth:`join` (see the module
    docstring); a no-op where ``enabled`` is false. ``threads_joined`` counts them."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.threads_joined = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def join(self) -> bool:
        """Whether this call ran the op (the calling thread's first call)."""
        if not self.enabled or self._local.__dict__.get("joined"):
            return False
        self._local.joined = True
        torch.empty(WARMUP_ELEMENTS).fill_(1.0)
        with self._lock:
            self.threads_joined += 1
        return True
