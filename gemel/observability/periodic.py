"""A function run every few seconds on the event loop (the dashboard's sampler, the stats log)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("gemel.observability")


class Periodic:
    """Calls ``fn`` every ``interval_s`` seconds between ``start()`` and ``stop()``; a failing
    call is logged and the next one still runs."""

    def __init__(self, fn: Callable[[], None], interval_s: float, name: str):
        self.fn = fn
        self.interval_s = interval_s
        self.name = name
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.fn()
            except Exception:
                log.exception("%s failed", self.name)
