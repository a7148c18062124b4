"""``OpenMpJoin`` and ``openmp_threads`` against a real torch in a child process: the
warm-up op gives each calling thread its own OpenMP team, once, and the count read
from ``/proc`` sees it (the SGLang e2e test reads the same count of a real scheduler).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ems.testing.openmp import openmp_threads

pytest.importorskip("torch")
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc"),
              pytest.mark.timeout(120)]

# Each step prints its name and waits for a line on stdin: the parent counts between.
CHILD = textwrap.dedent("""
    import sys, threading
    import torch
    from ems.integrations.openmp import OpenMpJoin

    def step(name):
        print(name, flush=True)
        sys.stdin.readline()

    torch.set_num_threads(2)          # a team of 2, whatever the host's CPUs
    end = threading.Event()
    joined = []

    def helper(j):
        joined.append((j.join(), j.join()))
        end.wait(60)

    torch.empty(1 << 20).fill_(1.0)   # the main thread's team (an engine's forward)
    step("main")
    off, on = OpenMpJoin(enabled=False), OpenMpJoin()
    threads = []
    for name, j in (("off", off), ("on", on)):
        threads.append(threading.Thread(target=helper, args=(j,)))
        threads[-1].start()
        while len(joined) < len(threads):
            threading.Event().wait(0.01)
        step(name)
    assert joined == [(False, False), (True, False)], joined  # once per thread
    assert (off.threads_joined, on.threads_joined) == (0, 1)
    end.set()
    for t in threads:
        t.join()
    step("ended")
""")


def _workers(pid: int, settle: bool) -> int:
    """The workers seen in a 0.3 s window; with ``settle``, the first window (of at
    most 30) that is not larger than the one after it. Python's ``join`` returns
    before the thread's pthread destructors run, and libgomp ends a team in one of
    them, so its worker can outlive the join: on a loaded CI host it was once still
    asleep in libgomp through the first window after it."""
    seen = openmp_threads(pid, sample_s=0.3).workers
    for _ in range(30 if settle else 0):
        after = openmp_threads(pid, sample_s=0.3).workers
        if after >= seen:
            break
        seen = after
    return seen


def test_the_warmup_gives_each_thread_one_team_which_ends_with_it() -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")  # sleeping workers, at once
    seen = {}
    with subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for name in ("main", "off", "on", "ended"):
                assert proc.stdout.readline().strip() == name
                seen[name] = _workers(proc.pid, settle=name == "ended")
                proc.stdin.write("next\n")
                proc.stdin.flush()
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # the main thread's team of 2: one worker; the disabled join adds none; the
    # warm-up adds the helper's team (one worker); it ends with the helper thread
    assert seen == {"main": 1, "off": 1, "on": 2, "ended": 1}, seen


def test_the_count_of_a_process_without_openmp_is_zero() -> None:
    t = openmp_threads(os.getpid(), sample_s=0.0)
    assert t.cpus == len(os.sched_getaffinity(0))
    assert t.managed == 1 + t.workers and t.throttled == (t.managed > t.cpus)
