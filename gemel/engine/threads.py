"""CPU threads of a served engine: all of its cores while nothing else keeps them busy, one
fewer while something does.

Why: a decode step on CPU is bound by memory bandwidth, which one core cannot use up alone (a
batch-1 step on a 2-core Xeon takes ~1.7x as long on one thread as on two). But torch's
threads meet at a barrier after every op, so when another busy process takes a core from one
of them, the other waits at each barrier for it: a completion that takes 1.1 s on one thread
took 2.7-3.3 s on two beside one busy loop (docs/configuration.md). So the engine watches how
much CPU the rest of the machine uses on its cores (``/proc/stat`` less its own processes) and
switches between the two counts, with some hysteresis so that it does not flap.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger("gemel.engine")


@dataclass(frozen=True)
class CpuSample:
    """Cumulative clock ticks (USER_HZ) since boot: of the CPUs watched, all and busy; of the
    engine's own processes (every thread), user + system."""

    total: int
    busy: int
    own: int


def read_cpu_sample(cpus: Iterable[int], pids: Iterable[int]) -> CpuSample | None:
    """The counters now, from ``/proc``; None where there is no ``/proc/stat`` (not Linux)."""
    wanted = {f"cpu{c}" for c in cpus}
    total = busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name not in wanted:
                    continue
                ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    except OSError:
        return None
    own = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone: its ticks simply stop counting
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
        own += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return CpuSample(total, busy, own)


class AdaptiveThreads:
    """Polled once per engine loop iteration; every ``interval_s`` it measures how many cores'
    worth of CPU other processes used on the engine's cores and sets the thread count: ``cores``
    at first, ``cores - 1`` once that reaches ``busy_above``, ``cores`` again once it falls under
    ``idle_below``."""

    def __init__(
        self,
        cores: int,
        own_pids: Iterable[int],
        interval_s: float = 1.0,
        busy_above: float = 0.5,
        idle_below: float = 0.25,
        set_threads: Callable[[int], None] | None = None,
        read: Callable[[], CpuSample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if cores < 2:
            raise ValueError("adaptive threads need at least 2 cores")
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(cores))
        pids = list(own_pids)
        self.cores = cores
        self.interval_s, self.busy_above, self.idle_below = interval_s, busy_above, idle_below
        self._set = set_threads or _torch_set_num_threads
        self._read = read or (lambda: read_cpu_sample(cpus, pids))
        self._clock = clock
        # Every core from the start: an engine that starts beside a busy neighbour loses one
        # window (interval_s) of slow steps, where starting with one fewer made the common case,
        # an idle machine, run its first requests at half speed until a window judged it idle
        # (a fresh server's first burst of 32 prompts ran its first 512-token steps in 0.50-0.54 s
        # instead of 0.27-0.29 s on a 2-core Zen 5).
        self.threads = cores
        self.others = 0.0  # cores' worth of CPU others used in the last window
        self._set(self.threads)
        self._last = self._read()
        self._last_t = clock()

    def poll(self) -> None:
        now = self._clock()
        if now - self._last_t < self.interval_s:
            return
        sample = self._read()
        if sample is None or self._last is None:
            self._last, self._last_t = sample, now
            return
        stale = now - self._last_t > 3 * self.interval_s  # e.g. after an idle spell: start a fresh window
        d_total = sample.total - self._last.total
        d_others = (sample.busy - self._last.busy) - (sample.own - self._last.own)
        self._last, self._last_t = sample, now
        if stale or d_total <= 0:
            return
        self.others = max(0.0, d_others / d_total * self.cores)
        wanted = self.threads
        if self.others >= self.busy_above:
            wanted = self.cores - 1
        elif self.others < self.idle_below:
            wanted = self.cores
        if wanted != self.threads:
            log.info("engine threads %d -> %d (other processes used %.2f cores)", self.threads, wanted, self.others)
            self.threads = wanted
            self._set(wanted)


def _torch_set_num_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
