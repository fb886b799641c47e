"""Front end of one engine process: asyncio streams over an EngineCore running in a child.

The event loop tokenises (in the API layer), owns the ``OutputProcessor`` (incremental
detokenisation, stop strings, n candidates) and hands each request its outputs through a
small per-request stream. Two threads move pickled messages so the loop never blocks on a
pipe: a writer drains an outbox into the child's input pipe, and a reader waits on the
child's output pipe and its process sentinel, so a dead engine is noticed at once.

A dead or stalled engine is started again (``engine/supervisor.py`` says when and how
often) and every unfinished request is resubmitted with the tokens it had produced, so its
client sees a pause, not an error. Past the restart budget, or with restarting off, every
waiting request fails with ``EngineDeadError`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from gemel.config import EngineConfig
from gemel.engine import allocator
from gemel.engine.core_proc import AbortRequests, AddRequests, Failed, Ready, Shutdown, StepResult, run_engine_core
from gemel.engine.output_processor import OutputProcessor, RequestOutput, RequestState, child_params
from gemel.engine.protocol import EngineCoreRequest, EngineStats, TenantQuota
from gemel.engine.supervisor import RestartBudget, RestartPolicy, exit_reason
from gemel.loader.tokenizer import Tokenizer
from gemel.observability.stats import EngineObserver, IterationStats, notify_observers
from gemel.sampling_params import SamplingParams

log = logging.getLogger("gemel.engine.async")


class EngineDeadError(RuntimeError):
    """The engine process is gone (crashed, killed or failed to load): retry later."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class RequestRejected(ValueError):
    """The engine refused the request (e.g. the prompt does not fit the context)."""


def load_tokenizer(source: str) -> tuple[Tokenizer, int]:
    """The model's tokenizer and context size, read without loading its weights."""
    from gemel.loader import sources
    from gemel.loader.model_loader import read_arch_and_tokenizer

    arch, tokenizer = read_arch_and_tokenizer(sources.resolve(source))
    return tokenizer, arch.max_position_embeddings


class _RequestStream:
    """Outputs of one request waiting for its consumer; a slow consumer gets them merged."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.event = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self, deadline: float | None = None) -> RequestOutput:
        """The next (merged) output; TimeoutError once ``deadline`` (time.monotonic()) passes."""
        while not self.outputs and self.error is None:
            self.event.clear()
            if deadline is None:
                await self.event.wait()
            else:
                async with asyncio.timeout_at(deadline):  # the loop's clock is time.monotonic()
                    await self.event.wait()
        if self.outputs:
            outs, self.outputs = self.outputs, []
            return merge_outputs(outs)
        raise self.error  # type: ignore[misc]


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Fold consecutive outputs of one request into one whose deltas cover them all."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    merged = []
    for i, cand in enumerate(last.outputs):
        parts = [o.outputs[i] for o in outs]
        merged.append(
            replace(
                cand,
                delta_text="".join(p.delta_text for p in parts),
                delta_token_ids=[t for p in parts for t in p.delta_token_ids],
                delta_logprobs=[lp for p in parts for lp in p.delta_logprobs],
            )
        )
    return replace(last, outputs=merged)


@dataclass
class _Submission:
    """What a request was submitted with, to submit it again to a restarted engine."""

    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    quota: TenantQuota | None
    arrival: float


class AsyncLLM:
    """One model served by one engine process, restarted when it dies or stalls."""

    def __init__(
        self,
        config: EngineConfig,
        stats_interval_s: float = 0.5,
        log_level: str = "info",
        restart: RestartPolicy | None = None,
    ):
        self.config = config
        self.stats_interval_s = stats_interval_s
        self.log_level = log_level
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = config.max_model_len or 0
        self.info: Ready | None = None
        # created -> starting -> ready (-> restarting -> ready)* -> dead | failed | stopped
        self.state = "created"
        self.error: str | None = None
        self.stats = EngineStats()
        self.last_report = 0.0  # monotonic time of the engine's last message
        self.restart_policy = restart or RestartPolicy()
        self.restarts: dict[str, int] = {}  # restarts so far, by reason ("killed", "crash", "stall")
        self._budget = RestartBudget(self.restart_policy)
        self._attempt = 0  # engine processes started before the current one
        self._stalled = False  # the watchdog killed the current process
        self._last_progress = 0.0  # monotonic: last finished step, or when work arrived at an idle engine
        self._tasks: list[asyncio.Task] = []  # the watchdog and a pending restart
        self._streams: dict[str, _RequestStream] = {}
        self._submissions: dict[str, _Submission] = {}
        self._processor: OutputProcessor | None = None
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.observers: list[EngineObserver] = []  # metrics, tracing, dashboard (gemel.observability)

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and load the tokenizer; the model loads in the background."""
        self._loop = asyncio.get_running_loop()
        self.state = "starting"
        conn = self._spawn()
        self.tokenizer, model_len = await asyncio.to_thread(load_tokenizer, self.config.model)
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self._processor = OutputProcessor(self.tokenizer)
        self._start_reader(conn)
        self._tasks.append(asyncio.ensure_future(self._watch_for_stalls()))

    def _spawn(self):
        """Start an engine process and its writer thread; returns the pipe its messages come on
        (the caller starts the reader on it). Each process gets an outbox of its own, so nothing
        queued for a dead one reaches its successor."""
        ctx = mp.get_context("spawn")
        # PyTorch's CPU allocator backs tensors of 2 MB and more with huge pages when this is
        # set (read once, at the child's first allocation). Without it every step's fresh
        # logits (Gemma 3 at batch 32: 33.5 MB, past glibc's 32 MB mmap ceiling) are mapped
        # anew and faulted in 4 KB at a time: 12 ms against 2 ms on a Zen 5 VM. Set it to 0
        # to opt out.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        child_in, to_engine = ctx.Pipe(duplex=False)
        conn, child_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.config.model_dump(), child_in, child_out, self.stats_interval_s, self.log_level, self._attempt),
            name="gemel-engine",
            daemon=True,
        )
        with allocator.preloaded_for_child(self.config.memory_allocator):  # jemalloc, for the engine alone
            self._proc.start()
        child_in.close()
        child_out.close()
        self._outbox = queue.SimpleQueue()
        self._stalled = False
        args = (to_engine, self._outbox)
        threading.Thread(target=self._write_loop, args=args, name="gemel-engine-writer", daemon=True).start()
        return conn

    def _start_reader(self, conn) -> None:
        args = (conn, self._proc)
        threading.Thread(target=self._read_loop, args=args, name="gemel-engine-reader", daemon=True).start()

    async def shutdown(self, timeout: float = 20.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self._proc is None:
            return
        if self.state in ("starting", "ready"):
            self._send(Shutdown())
        self.state = "stopped"
        await asyncio.to_thread(self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def wait_ready(self, timeout: float) -> None:
        """Until the engine is ready: while it loads, and while it restarts after a crash."""
        if self.state == "ready":
            return
        if self.state in ("starting", "created", "restarting"):
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                raise EngineNotReadyError(self._not_ready_message()) from None
        self.check_alive()

    def _not_ready_message(self) -> str:
        if self.state == "restarting":
            return f"the model's engine is restarting ({self.error}); retry shortly"
        return "the model is still loading; retry shortly"

    def check_alive(self) -> None:
        if self.state == "ready":
            return
        if self.state in ("starting", "created"):
            raise EngineNotReadyError(self._not_ready_message())
        raise EngineDeadError(f"the engine is unavailable ({self.error or self.state})")

    # -- requests -----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str = "",
        deadline: float | None = None,
        quota: TenantQuota | None = None,
        resume: RequestOutput | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas merged if the consumer lags). Closing or
        cancelling the iterator before the end, or passing ``deadline`` (monotonic; raises
        TimeoutError), aborts the request in the engine. ``quota`` is the tenant's engine
        quota, from the gateway. ``resume``: the last output a consumer saw of this request
        from another engine that died (a replica, ``gemel.scale``); its tokens count as output,
        as on a restart here, so the request goes on exactly where it stopped."""
        if self.state != "restarting":  # a request arriving mid-restart is submitted with the others
            self.check_alive()
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} tokens"
            )
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already running")
        stream = _RequestStream()
        self._streams[request_id] = stream
        state = RequestState(request_id, prompt, prompt_ids, params, self.tokenizer, tenant)
        state.observer_handles = self._begin_observers(request_id, state.tenant, params)
        if resume is not None:
            state.resume_from(resume)
        self._processor.add(state)
        arrival = time.monotonic()
        self._submissions[request_id] = _Submission(prompt_ids, params, tenant, quota, arrival)
        if len(self._submissions) == 1:
            self._last_progress = arrival  # an idle engine is not stalled: its clock starts now
        self._send(
            AddRequests(
                [
                    EngineCoreRequest(
                        c.seq_id, prompt_ids, child_params(params, i), arrival, tenant, quota=quota,
                        fork_of=state.candidates[0].seq_id if i > 0 and resume is None else None,  # share the prompt's KV
                        output_token_ids=list(c.out.token_ids),
                    )
                    for i, c in enumerate(state.candidates)
                    if not c.out.finished
                ]
            )
        )
        finished = False
        try:
            while True:
                out = await stream.get(deadline)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._submissions.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self._processor is None:
            return
        state = self._processor.requests.get(request_id)
        ids = self._processor.remove(request_id)
        if state is not None and not state.finished and self.observers:
            now = time.monotonic()
            self._notify(IterationStats(now, finished=[state.finished_stats(now, "abort")]))
        if ids:
            self._send(AbortRequests(ids))

    # -- observers (metrics, tracing, dashboard) ---------------------------------------------
    def _begin_observers(self, request_id: str, tenant: str, params: SamplingParams) -> list:
        handles = []
        for obs in self.observers:
            try:
                handles.append(obs.begin_request(request_id, tenant, params))
            except Exception:  # observability must never fail a request
                log.exception("observer %r failed at request start", obs)
                handles.append(None)
        return handles

    def _notify(self, it: IterationStats) -> None:
        notify_observers(self.observers, it)

    # -- the pipes (threads) ---------------------------------------------------------------
    def _send(self, msg) -> None:
        """Queue a message for the engine; never blocks the event loop. Nothing is queued
        while the engine restarts: the new one gets every unfinished request on start."""
        if self.state in ("starting", "ready"):
            self._outbox.put(msg)

    @staticmethod
    def _write_loop(conn, outbox: queue.SimpleQueue) -> None:
        """Writer thread: pickle and send each queued message (a full pipe blocks only here)."""
        while True:
            msg = outbox.get()
            try:
                conn.send(msg)
            except (BrokenPipeError, EOFError, OSError):  # the engine is gone; the reader reports it
                return
            if isinstance(msg, Shutdown):
                conn.close()
                return

    def _read_loop(self, conn, proc) -> None:
        """Reader thread of one engine process: forward each message to the event loop, then
        report the process's end."""
        sentinel = proc.sentinel
        while True:
            ready = mp.connection.wait([conn, sentinel])
            if conn not in ready:
                break
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if not self._call_soon(self._on_message, msg, proc):
                return
        proc.join(timeout=1.0)  # reap it, so its exit code is known
        self._call_soon(self._on_exit, proc)

    def _call_soon(self, fn, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the event loop is closed: the server is gone
            return False

    def _on_message(self, msg, proc) -> None:
        if proc is not self._proc:  # the last words of an engine already replaced
            return
        self.last_report = time.monotonic()
        if isinstance(msg, StepResult):
            if msg.iteration_tokens:
                self._last_progress = self.last_report
            self._on_step(msg)
        elif isinstance(msg, Ready):
            self.info = msg
            self.max_model_len = msg.max_model_len
            restarted = self.state == "restarting"
            if self.state in ("starting", "restarting"):
                self.state = "ready"
                self.error = None
            log.info("engine process %d ready: %s on %s/%s in %.1fs", msg.pid, self.config.model, msg.device, msg.dtype, msg.load_time_s)
            if restarted:
                self._resubmit_all()
            self._last_progress = time.monotonic()
            self._ready.set()
        elif isinstance(msg, Failed):
            self.state, self.error = "failed", msg.error
            log.error("engine failed to start: %s", msg.error)
            self._ready.set()
            self._fail_all(EngineDeadError(f"the engine is unavailable ({msg.error})"))

    def _on_step(self, msg: StepResult) -> None:
        self.stats = msg.stats
        it = IterationStats(msg.time, list(msg.iteration_tokens)) if self.observers else None
        for seq_id, reason in msg.rejected:
            entry = self._processor.child_to_request.get(seq_id)
            if entry is None:
                continue
            request_id = entry[0].request_id
            self._abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(RequestRejected(reason))
        if not msg.outputs:
            if it is not None and not it.empty:
                self._notify(it)
            return
        outputs, to_abort = self._processor.process(msg.outputs, it)
        if it is not None:
            self._notify(it)
        if to_abort:
            self._send(AbortRequests(to_abort))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _on_exit(self, proc) -> None:
        if proc is not self._proc:
            return
        self._outbox.put(Shutdown())  # let the writer thread end
        if self.state in ("stopped", "failed"):
            self._ready.set()
            self._fail_all(EngineDeadError(f"the engine is unavailable ({self.error or self.state})"))
            return
        reason, words = ("stall", f"the engine stalled (no step for {self.restart_policy.stall_s:g}s)") if self._stalled else exit_reason(proc.exitcode)
        self._engine_lost(reason, words)

    def _engine_lost(self, reason: str, words: str) -> None:
        """Restart after the back-off when the budget allows; else the model is failed."""
        delay = self._budget.next_delay(time.monotonic()) if self.restart_policy.max_restarts else None
        if delay is None:
            self.state = "dead" if not self.restart_policy.max_restarts else "failed"
            self.error = words if not self.restart_policy.max_restarts else (
                f"{words}; restarted {self._budget.recent} times in {self.restart_policy.window_s:g}s, not again"
            )
            log.error("%s; failing %d in-flight requests", self.error, len(self._streams))
            self._ready.set()
            self._fail_all(EngineDeadError(f"the engine is unavailable ({self.error})"))
            return
        self.state = "restarting"
        self.error = words
        self.restarts[reason] = self.restarts.get(reason, 0) + 1
        self._ready.clear()
        log.warning(
            "%s; restarting it in %.1fs (restart %d of at most %d in %gs); %d requests will resume",
            words, delay, self._budget.recent, self.restart_policy.max_restarts, self.restart_policy.window_s,
            len(self._submissions),
        )
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.ensure_future(self._restart_after(delay)))

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.state != "restarting":
            return
        self._attempt += 1
        self._start_reader(self._spawn())

    def _resubmit_all(self) -> None:
        """Every unfinished request goes to the new engine with the tokens it produced, which
        count as output: it goes on where it stopped (a greedy one exactly as if nothing happened)."""
        requests = []
        for request_id, state in self._processor.requests.items():
            sub = self._submissions.get(request_id)
            if sub is None:
                continue
            for i, cand in enumerate(state.candidates):
                if cand.out.finished:
                    continue
                requests.append(
                    EngineCoreRequest(
                        cand.seq_id, sub.prompt_ids, child_params(sub.params, i), sub.arrival, sub.tenant,
                        quota=sub.quota, output_token_ids=list(cand.out.token_ids),
                    )
                )
        if requests:
            log.info("resubmitted %d sequences to the new engine", len(requests))
            self._send(AddRequests(requests))

    async def _watch_for_stalls(self) -> None:
        """Kill an engine that has work and finishes no step for ``stall_s`` (a hang in a kernel,
        a deadlock): the exit handler then restarts it like a crash."""
        period = min(1.0, self.restart_policy.stall_s / 4)
        while True:
            await asyncio.sleep(period)
            if self.state != "ready" or not self._submissions or self._proc is None:
                continue
            silent = time.monotonic() - self._last_progress
            if silent > self.restart_policy.stall_s and not self._stalled:
                log.error("engine process %s finished no step for %.0fs with %d requests waiting; killing it",
                          self._proc.pid, silent, len(self._submissions))
                self._stalled = True
                self._proc.kill()

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        if self._processor is not None:
            now = time.monotonic()
            failed = []
            for request_id, state in list(self._processor.requests.items()):
                self._processor.remove(request_id)
                if not state.finished:
                    failed.append(state.finished_stats(now, "error"))
            if failed and self.observers:
                self._notify(IterationStats(now, finished=failed))
