"""The engine core's own process: a loop that batches every pending input into the next step.

As in vLLM V1, the child owns the scheduler and the model runner and sees only token ids;
the front end (``async_llm``) tokenises, detokenises and streams. Two one-way pipes carry
pickled dataclasses. The loop blocks on its input pipe when it has nothing to run (no busy
spin), drains every pending input before each step, and sends one message back per step:
the step's outputs, rejected requests, and the stats (also every ``stats_interval_s`` when
idle, as a heartbeat).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from gemel.engine.allocator import in_use as allocator_in_use
from gemel.engine.protocol import EngineCoreOutput, EngineCoreRequest, EngineStats

log = logging.getLogger("gemel.engine.proc")


# -- messages, front end -> core ---------------------------------------------------------
@dataclass
class AddRequests:
    requests: list[EngineCoreRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


# -- messages, core -> front end ---------------------------------------------------------
@dataclass
class Ready:
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    load_time_s: float
    pid: int


@dataclass
class Failed:
    error: str


@dataclass
class StepResult:
    outputs: list[EngineCoreOutput]
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    stats: EngineStats = field(default_factory=EngineStats)
    time: float = 0.0  # monotonic clock of the child when sent
    iteration_tokens: list[int] = field(default_factory=list)  # tokens of each step run since the last message


def run_engine_core(
    config: dict[str, Any], input_conn: Any, output_conn: Any, stats_interval_s: float, log_level: str, attempt: int = 0
) -> None:
    """Child-process entry point (spawn context): load the model, then serve steps until Shutdown.
    ``attempt`` counts the engine processes started before this one for the same model."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which stops us
    parent = os.getppid()
    try:
        from gemel.config import EngineConfig
        from gemel.engine.core import EngineCore

        engine_config = EngineConfig(**config)
        if engine_config.num_threads is None and engine_config.compile:
            # compiled kernels keep the thread count they were compiled with, so none adapts
            # later: leave one core to the front end, as a busy one would take it anyway
            engine_config = engine_config.model_copy(update={"num_threads": max(1, _cores() - 1)})
        log.info("memory allocator: %s", allocator_in_use())
        core = EngineCore(engine_config)
        core.runner.prefault_kv()  # a server's memory is resident from the start
        freeze_heap()
    except Exception as e:  # the front end reports it and /readyz stays red
        log.exception("engine failed to start")
        output_conn.send(Failed(f"{type(e).__name__}: {e}"))
        return
    stats = core.stats()
    output_conn.send(
        Ready(
            max_model_len=core.max_model_len,
            vocab_size=core.loaded.arch.vocab_size,
            num_blocks=stats.num_blocks,
            block_size=core.config.block_size,
            device=str(core.device),
            dtype=str(core.dtype).removeprefix("torch."),
            load_time_s=core.load_time_s,
            pid=os.getpid(),
        )
    )
    fault = parse_fault(engine_config.fault_injection) if attempt == 0 else None
    EngineLoop(core, input_conn, output_conn, stats_interval_s, parent, threads=adaptive_threads(core, parent), fault=fault).run()
    core.close()


FAULT_ENV = "GEMEL_FAULT_INJECTION"


@dataclass(frozen=True)
class Fault:
    """A failure the engine injects into itself so tests can watch it recover."""

    kind: str  # "crash": the process dies as under kill -9; "stall": it stops stepping
    after_steps: int


def parse_fault(spec: str | None) -> Fault | None:
    """``engine.fault_injection`` ("crash_after_steps=N" or "stall_after_steps=N"), honoured
    only when $GEMEL_FAULT_INJECTION is 1, so a configuration file can never do it alone."""
    if not spec or os.environ.get(FAULT_ENV) != "1":
        return None
    name, _, value = spec.partition("=")
    kinds = {"crash_after_steps": "crash", "stall_after_steps": "stall"}
    if name not in kinds or not value.isdigit():
        raise ValueError(f"fault_injection: expected crash_after_steps=N or stall_after_steps=N, got {spec!r}")
    log.warning("fault injection on: %s", spec)
    return Fault(kinds[name], int(value))


def freeze_heap() -> None:
    """Move every object alive now (the model, its tensors, the modules imported) out of the
    cyclic garbage collector's reach, as vLLM does after start-up: a full collection otherwise
    walks them all again every few hundred steps' worth of allocations, on the thread that runs
    the steps (about 2% of an offline batch-32 round on a 2-core CPU, where perf put the
    collector at 2.5% of the samples)."""
    import gc

    gc.collect()
    gc.freeze()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def adaptive_threads(core: Any, front_end_pid: int) -> Any:
    """With ``num_threads`` unset, a CPU engine of a machine with 2 or more cores gets all of them
    while no other process keeps them busy and one fewer while one does (``engine/threads.py``)."""
    if core.config.num_threads is not None or getattr(core.device, "type", "cpu") != "cpu":
        return None
    cores = _cores()
    if cores < 2:
        return None
    from gemel.engine.threads import AdaptiveThreads

    return AdaptiveThreads(cores, own_pids=[os.getpid(), front_end_pid])


class EngineLoop:
    def __init__(self, core: Any, input_conn: Any, output_conn: Any, stats_interval_s: float, parent_pid: int,
                 threads: Any = None, fault: Fault | None = None):
        self.core = core
        self.fault = fault
        self.threads = threads  # AdaptiveThreads, or None: the thread count stays as configured
        self.input_conn = input_conn
        self.output_conn = output_conn
        self.stats_interval_s = stats_interval_s
        self.parent_pid = parent_pid
        self.running = True

    def run(self) -> None:
        last_sent = 0.0
        iteration_tokens: list[int] = []  # kept until a message carries them: no step goes uncounted
        while self.running:
            idle = not self.core.has_unfinished()
            messages = self._receive(block=idle)
            if idle and not messages and os.getppid() != self.parent_pid:
                log.warning("front end is gone; engine exits")
                return
            rejected: list[tuple[str, str]] = []
            changed = self._handle(messages, rejected)
            if self.threads is not None:
                # Idle iterations too (one every stats_interval_s): the window stays fresh, so
                # after start-up or an idle spell an idle machine has every core before the
                # next requests arrive rather than a second into them.
                self.threads.poll()
            outputs = []
            if self.core.has_unfinished():
                steps = getattr(self.core, "num_steps", 0)
                outputs = self.core.step()
                if getattr(self.core, "num_steps", 0) != steps:
                    iteration_tokens.append(self.core.last_step_tokens)
                    if self.fault is not None and self.core.num_steps >= self.fault.after_steps:
                        self._inject(self.fault)
            now = time.monotonic()
            if outputs or rejected or changed or now - last_sent >= self.stats_interval_s:
                try:
                    self.output_conn.send(StepResult(outputs, rejected, self.core.stats(), now, iteration_tokens))
                except (BrokenPipeError, EOFError, OSError):
                    return
                iteration_tokens = []
                last_sent = now

    @staticmethod
    def _inject(fault: Fault) -> None:
        log.warning("fault injection: %s now", fault.kind)
        if fault.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # a stall: alive, silent, stepping nothing
            time.sleep(3600)

    def _receive(self, block: bool) -> list:
        """Every message waiting now; when idle, wait (up to the stats interval) for the first."""
        messages = []
        conn = self.input_conn
        try:
            if block and not conn.poll(self.stats_interval_s):
                return messages
            while conn.poll():
                messages.append(conn.recv())
        except (EOFError, OSError):  # the front end is gone
            self.running = False
        return messages

    def _handle(self, messages: list, rejected: list[tuple[str, str]]) -> bool:
        changed = False
        for msg in messages:
            if isinstance(msg, AddRequests):
                for req in msg.requests:
                    try:
                        self.core.add_request(req)
                    except ValueError as e:
                        rejected.append((req.request_id, str(e)))
                changed = True
            elif isinstance(msg, AbortRequests):
                self.core.abort(msg.request_ids)
                changed = True
            elif isinstance(msg, Shutdown):
                self.running = False
        return changed
