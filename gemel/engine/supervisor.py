"""When a dead or stalled engine process is started again, and when it is given up.

``AsyncLLM`` supervises its engine process: when the process dies (killed, a crash in a C++
kernel, the kernel's out-of-memory killer) or stalls (work queued and no step finished for
``stall_s``), it starts a fresh one and resubmits every unfinished request with the tokens
it already produced. This module holds the policy: exponential back-off between restarts and
at most ``max_restarts`` within ``window_s``, after which the model is marked failed (a crash
loop would otherwise burn the machine reloading weights forever).
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # within window_s; 0 turns restarting off
    window_s: float = 300.0
    stall_s: float = 30.0  # queued work and no finished step for this long: the engine is stuck
    first_delay_s: float = 0.5  # back-off before the first restart, doubled for each recent one
    max_delay_s: float = 30.0


class RestartBudget:
    """The restarts of the last ``window_s`` seconds and the back-off before the next one."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.times: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting now, or None when the budget is spent. Counts the
        restart it allows."""
        while self.times and now - self.times[0] > self.policy.window_s:
            self.times.popleft()
        if len(self.times) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.first_delay_s * 2 ** len(self.times), self.policy.max_delay_s)
        self.times.append(now)
        return delay

    @property
    def recent(self) -> int:
        return len(self.times)


def exit_reason(exitcode: int | None) -> tuple[str, str]:
    """(metric label, words) for an engine process that ended by itself or was killed.

    SIGKILL is what both ``kill -9`` and the kernel's out-of-memory killer send, so the words
    name both; the label stays ``killed``."""
    if exitcode is None:
        return "crash", "the engine process ended"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        if -exitcode == signal.SIGKILL:
            return "killed", "the engine process was killed (SIGKILL: kill -9 or out of memory)"
        return "crash", f"the engine process died of {name}"
    return "crash", f"the engine process exited with code {exitcode}"
