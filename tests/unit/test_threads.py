"""The served engine's adaptive CPU thread count (gemel.engine.threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from gemel.engine.core_proc import adaptive_threads
from gemel.engine.threads import AdaptiveThreads, CpuSample, read_cpu_sample

HZ = 100  # ticks a second per CPU


class FakeMachine:
    """Counters of a machine with ``cores`` CPUs, advanced by hand: each second, how many cores'
    worth the engine's own processes and everything else used."""

    def __init__(self, cores: int):
        self.cores, self.t = cores, 0.0
        self.sample = CpuSample(total=0, busy=0, own=0)

    def run(self, seconds: float, own: float, others: float) -> None:
        s = self.sample
        self.sample = CpuSample(
            total=s.total + round(seconds * HZ * self.cores),
            busy=s.busy + round(seconds * HZ * (own + others)),
            own=s.own + round(seconds * HZ * own),
        )
        self.t += seconds


def policy(machine: FakeMachine, calls: list[int]) -> AdaptiveThreads:
    return AdaptiveThreads(machine.cores, own_pids=[], interval_s=1.0, set_threads=calls.append,
                           read=lambda: machine.sample, clock=lambda: machine.t)


def test_every_core_from_the_start_and_a_busy_neighbour_takes_one():
    machine, calls = FakeMachine(4), []
    p = policy(machine, calls)
    assert calls == [4] and p.threads == 4  # an engine's first requests get every core
    machine.run(0.5, own=2.9, others=1.0)
    p.poll()  # within the interval: nothing measured yet
    assert calls == [4]
    machine.run(0.5, own=2.9, others=1.0)  # a busy loop beside the engine
    p.poll()
    assert calls == [4, 3] and p.others == pytest.approx(1.0, abs=0.01)
    machine.run(1.0, own=3.0, others=0.35)  # between the thresholds: no flapping
    p.poll()
    assert calls == [4, 3]
    machine.run(1.0, own=3.0, others=0.1)  # the neighbour is gone
    p.poll()
    assert calls == [4, 3, 4] and p.others == pytest.approx(0.1, abs=0.01)
    machine.run(1.0, own=3.0, others=0.35)
    p.poll()
    assert calls == [4, 3, 4]


def test_a_neighbour_that_stops_gives_the_core_back_within_the_window():
    """Polled every quarter window: the core comes back as soon as the last window is no longer
    busy and the last quarter is idle, not a whole quiet window later."""
    machine, calls = FakeMachine(2), []
    p = policy(machine, calls)
    for _ in range(4):
        machine.run(0.25, own=1.0, others=1.0)
        p.poll()
    assert calls == [2, 1]
    seen = []
    for _ in range(4):  # the neighbour has stopped
        machine.run(0.25, own=2.0, others=0.0)
        p.poll()
        seen.append(p.threads)
    assert seen == [1, 1, 2, 2] and calls == [2, 1, 2]
    machine.run(0.25, own=1.0, others=0.4)  # a light neighbour: between the thresholds at worst
    p.poll()
    assert calls == [2, 1, 2]


def test_the_engines_own_processes_do_not_count_as_neighbours():
    machine, calls = FakeMachine(2), []
    p = policy(machine, calls)
    for _ in range(3):
        machine.run(1.0, own=2.0, others=0.0)  # engine and front end use every core themselves
        p.poll()
    assert p.threads == 2 and calls == [2]


def test_a_window_that_spans_an_idle_spell_is_not_judged():
    machine, calls = FakeMachine(2), []
    p = policy(machine, calls)
    machine.run(60.0, own=0.0, others=0.0)  # the engine sat idle (it polls only while it steps)
    machine.run(1.0, own=0.0, others=1.0)  # and a neighbour started just now
    p.poll()
    assert calls == [2]  # a fresh window starts instead of averaging the neighbour away
    machine.run(1.0, own=1.0, others=1.0)
    p.poll()
    assert calls == [2, 1] and p.others == pytest.approx(1.0, abs=0.01)


def test_counters_from_proc_follow_this_processes_cpu_time():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc")
    cpus = sorted(os.sched_getaffinity(0))
    before = read_cpu_sample(cpus, [os.getpid()])
    start = time.process_time()
    while time.process_time() - start < 0.3:  # 0.3 s of this process's CPU time
        pass
    after = read_cpu_sample(cpus, [os.getpid()])
    assert after.total > before.total and 0 <= after.busy - before.busy <= after.total - before.total
    assert after.own - before.own >= 20  # 30 ticks at 100 Hz, less rounding
    assert read_cpu_sample(cpus, [2**22 + 12345]).own == 0  # a process that is gone counts nothing


def test_a_real_busy_neighbour_is_seen_and_takes_a_core():
    cores = len(os.sched_getaffinity(0))
    if cores < 2 or not os.path.exists("/proc/stat"):
        pytest.skip("needs 2 cores and /proc")
    calls: list[int] = []
    p = AdaptiveThreads(cores, own_pids=[os.getpid()], interval_s=0.25, set_threads=calls.append)
    p.threads = cores  # as if the machine had been idle
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 10
        while p.threads == cores and time.monotonic() < deadline:
            time.sleep(0.05)
            p.poll()
    finally:
        neighbour.kill()
        neighbour.wait()
    assert p.threads == cores - 1 and calls[-1] == cores - 1 and p.others >= 0.5


def test_only_an_unset_thread_count_on_cpu_adapts():
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        unset = SimpleNamespace(config=SimpleNamespace(num_threads=None), device=torch.device("cpu"))
        got = adaptive_threads(unset, os.getppid())
        assert (got is None) if cores < 2 else (isinstance(got, AdaptiveThreads) and got.threads == cores)
        fixed = SimpleNamespace(config=SimpleNamespace(num_threads=2), device=torch.device("cpu"))
        assert adaptive_threads(fixed, os.getppid()) is None
        gpu = SimpleNamespace(config=SimpleNamespace(num_threads=None), device=torch.device("cuda"))
        assert adaptive_threads(gpu, os.getppid()) is None
    finally:
        torch.set_num_threads(before)


def test_the_engine_loop_polls_the_thread_count_while_idle():
    """Before the first request (and after any idle spell) the window must stay fresh: a loop
    that polled only while stepping judged its first window stale and kept one core idle for
    the first second of every burst of requests."""
    from gemel.engine.core_proc import EngineLoop, Shutdown

    class Inbox:  # nothing for one idle wait, then Shutdown
        def __init__(self):
            self.polls = 0

        def poll(self, timeout=None):
            self.polls += 1
            return self.polls > 2

        def recv(self):
            self.polls = -100  # one message only
            return Shutdown()

    class Polls:
        count = 0

        def poll(self):
            Polls.count += 1

    core = SimpleNamespace(has_unfinished=lambda: False, stats=lambda: None)
    sent: list = []
    loop = EngineLoop(core, Inbox(), SimpleNamespace(send=sent.append), stats_interval_s=0.01,
                      parent_pid=os.getppid(), threads=Polls())
    loop.run()
    assert Polls.count >= 2 and not loop.running
