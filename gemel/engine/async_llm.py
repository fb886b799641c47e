"""Front end of one engine process: asyncio streams over an EngineCore running in a child.

The event loop tokenises (in the API layer), owns the ``OutputProcessor`` (incremental
detokenisation, stop strings, n candidates) and hands each request its outputs through a
small per-request stream. Two threads move pickled messages so the loop never blocks on a
pipe: a writer drains an outbox into the child's input pipe, and a reader waits on the
child's output pipe and its process sentinel, so a dead engine is noticed at once and every
waiting request fails with ``EngineDeadError`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from gemel.config import EngineConfig
from gemel.engine.core_proc import AbortRequests, AddRequests, Failed, Ready, Shutdown, StepResult, run_engine_core
from gemel.engine.output_processor import OutputProcessor, RequestOutput, RequestState, child_params
from gemel.engine.protocol import EngineCoreRequest, EngineStats, TenantQuota
from gemel.loader.tokenizer import Tokenizer
from gemel.observability.stats import EngineObserver, IterationStats
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


class AsyncLLM:
    """One model served by one engine process."""

    def __init__(self, config: EngineConfig, stats_interval_s: float = 0.5, log_level: str = "info"):
        self.config = config
        self.stats_interval_s = stats_interval_s
        self.log_level = log_level
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = config.max_model_len or 0
        self.info: Ready | None = None
        self.state = "created"  # created -> starting -> ready -> dead | failed | stopped
        self.error: str | None = None
        self.stats = EngineStats()
        self.last_report = 0.0  # monotonic time of the engine's last message
        self._streams: dict[str, _RequestStream] = {}
        self._processor: OutputProcessor | None = None
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._conn = None
        self.observers: list[EngineObserver] = []  # metrics, tracing, dashboard (gemel.observability)

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and load the tokenizer; the model loads in the background."""
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        child_in, to_engine = ctx.Pipe(duplex=False)
        self._conn, child_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.config.model_dump(), child_in, child_out, self.stats_interval_s, self.log_level),
            name="gemel-engine",
            daemon=True,
        )
        self.state = "starting"
        self._proc.start()
        child_in.close()
        child_out.close()
        threading.Thread(target=self._write_loop, args=(to_engine,), name="gemel-engine-writer", daemon=True).start()
        self.tokenizer, model_len = await asyncio.to_thread(load_tokenizer, self.config.model)
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self._processor = OutputProcessor(self.tokenizer)
        threading.Thread(target=self._read_loop, name="gemel-engine-reader", daemon=True).start()

    async def shutdown(self, timeout: float = 5.0) -> None:
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
        if self.state == "ready":
            return
        if self.state in ("starting", "created"):
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                raise EngineNotReadyError("the model is still loading; retry shortly") from None
        self.check_alive()

    def check_alive(self) -> None:
        if self.state == "ready":
            return
        if self.state in ("starting", "created"):
            raise EngineNotReadyError("the model is still loading; retry shortly")
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas merged if the consumer lags). Closing or
        cancelling the iterator before the end, or passing ``deadline`` (monotonic; raises
        TimeoutError), aborts the request in the engine. ``quota`` is the tenant's engine
        quota, from the gateway."""
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
        self._processor.add(state)
        arrival = time.monotonic()
        self._send(
            AddRequests(
                [
                    EngineCoreRequest(
                        c.seq_id, prompt_ids, child_params(params, i), arrival, tenant, quota=quota,
                        fork_of=state.candidates[0].seq_id if i > 0 else None,  # share the prompt's KV
                    )
                    for i, c in enumerate(state.candidates)
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
        for obs in self.observers:
            try:
                obs.on_iteration(it)
            except Exception:
                log.exception("observer %r failed", obs)
        for fs in it.finished:
            for obs, handle in zip(self.observers, fs.observer_handles):
                try:
                    obs.end_request(handle, fs)
                except Exception:
                    log.exception("observer %r failed at request end", obs)

    # -- the pipes (threads) ---------------------------------------------------------------
    def _send(self, msg) -> None:
        """Queue a message for the engine; never blocks the event loop."""
        if self.state in ("starting", "ready"):
            self._outbox.put(msg)

    def _write_loop(self, conn) -> None:
        """Writer thread: pickle and send each queued message (a full pipe blocks only here)."""
        while True:
            msg = self._outbox.get()
            try:
                conn.send(msg)
            except (BrokenPipeError, EOFError, OSError):  # the engine is gone; the reader reports it
                return
            if isinstance(msg, Shutdown):
                conn.close()
                return

    def _read_loop(self) -> None:
        """Reader thread: forward each message to the event loop; report the process's end."""
        conn, sentinel = self._conn, self._proc.sentinel
        while True:
            ready = mp.connection.wait([conn, sentinel])
            if conn not in ready:
                break
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if not self._call_soon(self._on_message, msg):
                return
        self._proc.join(timeout=1.0)  # reap it, so its exit code is known
        self._call_soon(self._on_exit)

    def _call_soon(self, fn, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the event loop is closed: the server is gone
            return False

    def _on_message(self, msg) -> None:
        self.last_report = time.monotonic()
        if isinstance(msg, StepResult):
            self._on_step(msg)
        elif isinstance(msg, Ready):
            self.info = msg
            self.max_model_len = msg.max_model_len
            if self.state == "starting":
                self.state = "ready"
            log.info("engine process %d ready: %s on %s/%s in %.1fs", msg.pid, self.config.model, msg.device, msg.dtype, msg.load_time_s)
            self._ready.set()
        elif isinstance(msg, Failed):
            self.state, self.error = "failed", msg.error
            log.error("engine failed to start: %s", msg.error)
            self._ready.set()

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

    def _on_exit(self) -> None:
        code = self._proc.exitcode if self._proc else None
        if self.state not in ("stopped", "failed"):
            self.state = "dead"
            self.error = f"engine process exited with code {code}"
            log.error("%s; failing %d in-flight requests", self.error, len(self._streams))
        self._ready.set()
        self._outbox.put(Shutdown())  # let the writer thread end
        self._fail_all(EngineDeadError(f"the engine is unavailable ({self.error or self.state})"))

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
