"""Engine step times for the bench/ scripts that compare engine variants in one process."""

from __future__ import annotations

import statistics
import time
from typing import Protocol


class Steppable(Protocol):
    def step(self) -> object: ...


def steps_in_turns(engines: dict[str, Steppable], turns: int, steps_per_turn: int = 1) -> dict[str, list[float]]:
    """Seconds of each engine's steps, sorted. The engines take turns, ``steps_per_turn``
    steps at a time, so every variant sees the machine in the same state (it drifts by
    20-30% over minutes here, more than most differences being measured)."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(turns):
        for name, engine in engines.items():
            for _ in range(steps_per_turn):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    return {name: sorted(values) for name, values in times.items()}


def p50_p90_ms(sorted_seconds: list[float]) -> tuple[float, float]:
    return 1e3 * statistics.median(sorted_seconds), 1e3 * sorted_seconds[int(0.9 * len(sorted_seconds))]


def print_step_table(first_column: str, times: dict[str, list[float]], extra: dict[str, dict[str, str]] | None = None) -> None:
    """A markdown table of each engine's step p50/p90, after ``extra``'s columns (name -> value per engine)."""
    extra = extra or {}
    print("| " + " | ".join([first_column, *extra, "step p50 (ms)", "p90 (ms)"]) + " |")
    print("|" + "---|" * (len(extra) + 3))
    for name, values in times.items():
        p50, p90 = p50_p90_ms(values)
        print("| " + " | ".join([name, *(column[name] for column in extra.values()), f"{p50:.2f}", f"{p90:.2f}"]) + " |")
