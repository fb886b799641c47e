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
from collections import deque
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
    """Polled once per engine loop iteration; it measures how many cores' worth of CPU other
    processes used on the engine's cores and sets the thread count: ``cores`` at first,
    ``cores - 1`` once a window of ``interval_s`` shows them at ``busy_above`` or more, ``cores``
    again once they fall under ``idle_below``. Giving the core back is judged on a quarter of
    the window: a neighbour that stops (a batch job ending, the other server of a benchmark
    finishing its round) would otherwise leave the engine's next requests on one thread for one
    to two seconds. Both decisions need evidence of a whole sub-window, and a neighbour between
    the thresholds changes nothing, so the count does not flap."""

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
        self.others = 0.0  # cores' worth of CPU others used in the last window judged
        self._set(self.threads)
        # Samples at least a quarter window apart, the newest last, reaching back one window.
        self._samples: deque[tuple[float, CpuSample]] = deque()
        first = self._read()
        if first is not None:
            self._samples.append((clock(), first))

    def _others(self, since: CpuSample, sample: CpuSample) -> float | None:
        d_total = sample.total - since.total
        if d_total <= 0:
            return None
        d_others = (sample.busy - since.busy) - (sample.own - since.own)
        return max(0.0, d_others / d_total * self.cores)

    def poll(self) -> None:
        now = self._clock()
        quarter = self.interval_s / 4
        if self._samples and now - self._samples[-1][0] < quarter:
            return
        sample = self._read()
        if sample is None:
            self._samples.clear()
            return
        if self._samples and now - self._samples[-1][0] > 3 * self.interval_s:
            self._samples.clear()  # e.g. after an idle spell: start fresh windows
        if not self._samples:
            self._samples.append((now, sample))
            return
        recent = self._others(self._samples[-1][1], sample)  # the last quarter window or more
        window = None  # the last whole window, once the samples reach back that far
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.interval_s:
            self._samples.popleft()
        if now - self._samples[0][0] >= self.interval_s:
            window = self._others(self._samples[0][1], sample)
        self._samples.append((now, sample))
        wanted = self.threads
        if window is not None and window >= self.busy_above:
            wanted, self.others = self.cores - 1, window
        elif recent is not None and recent < self.idle_below:
            wanted, self.others = self.cores, recent
        elif window is not None:
            self.others = window
        if wanted != self.threads:
            log.info("engine threads %d -> %d (other processes used %.2f cores)", self.threads, wanted, self.others)
            self.threads = wanted
            self._set(wanted)


def _torch_set_num_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
