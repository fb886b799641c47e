"""The request path every surface shares, from a parsed request to the engine and back.

Gemini REST (``api/gemini.py``), OpenAI (``api/openai_api.py``) and gRPC
(``api/grpc_server.py``) only parse their wire format into a ``GenerationRequest`` (or the
texts of an embedding or token-counting request) and render what comes back. The steps in
between happen here, in this order:

1. ``resolve``: the model a request names (id or alias), or 404 in the surface's words;
   a generation or embedding method on the other kind of model is a 400.
2. The deadline (``Deadline``, made by the surface from its header or its call's deadline)
   and a ``Guard``: how the surface waits, bounded by the deadline and, over HTTP, by the
   client's presence (``http_guard``; gRPC cancels a departed call itself, ``deadline_guard``).
3. ``start_generation``: wait until the engine is ready, tokenise each prompt once, take
   the tenant's priority class, pass the gateway's admission (class queue, tokens/min),
   start one engine request per prompt and meter each stream for the gateway.
4. The answer: ``finish`` for a unary one (every prompt's final output), ``relay`` for a
   stream (the first output awaited before the response starts, so an early failure still
   gets its status; a later one arrives as one last in-band error).

Embeddings (``embed``) and token counting (``count_chat_tokens``, ``count_text_tokens``)
take the same resolve / deadline / guard steps.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from gemel.api.errors import APIError, as_api_error
from gemel.api.lifecycle import Collector, Deadline, guarded
from gemel.api.state import ServedModel, ServerState, mark_model, state_of
from gemel.engine.output_processor import RequestOutput
from gemel.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from gemel.gateway.principal import Principal
    from gemel.loader.tokenizer import Tokenizer

T = TypeVar("T")
Guard = Callable[[Awaitable[T]], Awaitable[T]]
ModelKind = Literal["generate", "embed", "any"]


# -- 1. the model, 2. the deadline and how to wait ----------------------------------------------
def resolve(
    state: ServerState, name: str, surface: str, api_version: str = "v1beta", kind: ModelKind = "generate", method: str = ""
) -> ServedModel:
    """The served model ``name`` refers to, checked to be of ``kind`` for ``method``."""
    if kind == "generate":
        return state.generative(name, surface, api_version, method or "generateContent")
    if kind == "embed":
        return state.embedding(name, surface, api_version, method or "embedContent")
    return state.resolve(name, surface, api_version)


def http_guard(request: Request, deadline: Deadline) -> Guard:
    """Waits for HTTP: cancelled (and so aborted in the engine) at the deadline (504) or when
    the client disconnects."""
    return lambda work: guarded(request, work, deadline)


def deadline_guard(deadline: Deadline) -> Guard:
    """Waits bounded by the deadline alone (TimeoutError when it passes)."""
    return lambda work: asyncio.wait_for(work, max(0.0, deadline.remaining()))


@dataclass
class HttpCall:
    """An HTTP request's share of the pipeline: the server state, its model, deadline, guard."""

    state: ServerState
    model: ServedModel
    deadline: Deadline
    guard: Guard


def http_call(request: Request, name: str, surface: str, api_version: str = "v1beta", kind: ModelKind = "generate", method: str = "") -> HttpCall:
    """Steps 1 and 2 for an HTTP route; the response headers name the model (x-model-id)."""
    state = state_of(request)
    model = resolve(state, name, surface, api_version, kind, method)
    mark_model(request, model)
    deadline = Deadline.from_request(request, state.config.server)
    return HttpCall(state, model, deadline, http_guard(request, deadline))


# -- 3. generation ----------------------------------------------------------------------------------
@dataclass
class PromptInput:
    """One prompt as the engine takes it: token ids, and the text when there is one (OpenAI
    echo and the traces show it; a prompt sent as token ids has none)."""

    text: str | None
    token_ids: list[int]


Prompter = Callable[["Tokenizer"], list[PromptInput]]


def chat_prompt(messages: list[dict]) -> Prompter:
    """The prompt of a conversation, rendered with the model's chat template once."""

    def prompts(tokenizer: Tokenizer) -> list[PromptInput]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return [PromptInput(text, tokenizer.encode_rendered(text))]

    return prompts


@dataclass
class GenerationRequest:
    """What a surface parsed from its wire format, ready for the engine."""

    model: ServedModel
    params: SamplingParams
    deadline: Deadline
    prompts: Prompter  # run once the tokenizer is there; may raise APIError for bad prompts
    priority: int | None = None  # a class the caller asked for; never above the tenant's


class Generation:
    """A request running in the engine: its prompts and one metered output stream each."""

    def __init__(self, request: GenerationRequest, prompts: list[PromptInput], streams: list[AsyncIterator[RequestOutput]]):
        self.request = request
        self.prompts = prompts
        self.streams = streams
        self.collectors = [Collector() for _ in streams]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def deadline(self) -> Deadline:
        return self.request.deadline

    async def results(self) -> list[RequestOutput]:
        """Every prompt's final output; the first failure cancels (and so aborts) the rest."""
        runs = [c.run(s) for c, s in zip(self.collectors, self.streams)]
        if len(runs) == 1:
            return [await runs[0]]
        tasks = [asyncio.ensure_future(r) for r in runs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    def progress(self) -> str:
        """How far generation got, for a deadline's message."""
        if len(self.collectors) == 1:
            return self.collectors[0].progress()
        done = [c.last for c in self.collectors if c.last is not None]
        n = sum(len(o.token_ids) for out in done for o in out.outputs)
        return f"after {n} generated token{'s' if n != 1 else ''}" if done else "before the first token"

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every prompt as they come, each with its prompt's position."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:  # re-raised in the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:  # cancelling a pump closes its stream, which aborts the request in the engine
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def start_generation(state: ServerState, req: GenerationRequest, principal: Principal, guard: Guard) -> Generation:
    """Step 3: readiness, tokenisation, priority, admission, then the engine requests."""
    engine = req.model.engine
    await guard(engine.wait_ready(min(req.deadline.remaining(), state.config.server.engine_ready_timeout_s)))
    prompts = req.prompts(engine.tokenizer)
    params = req.params
    params.priority = principal.priority_for(req.priority)
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    await principal.admit_generation(prompt_tokens, params.max_tokens * params.n * len(prompts))
    streams = [
        principal.meter(
            engine.generate(uuid.uuid4().hex, p.text, p.token_ids, params, principal.tenant, req.deadline.at, quota=principal.quota),
            i,
        )
        for i, p in enumerate(prompts)
    ]
    return Generation(req, prompts, streams)


# -- 4. the answer ----------------------------------------------------------------------------------
async def finish(gen: Generation, guard: Guard) -> list[RequestOutput]:
    """A unary answer's outputs, one per prompt; a deadline says how far generation got."""
    try:
        return await guard(gen.results())
    except TimeoutError:
        raise gen.deadline.exceeded(gen.progress()) from None
    except APIError as e:
        if e.status == 504:
            raise gen.deadline.exceeded(gen.progress()) from None
        raise


async def relay(gen: Generation, guard: Guard) -> AsyncIterator[tuple[int, RequestOutput] | APIError]:
    """A streamed answer's outputs. Awaits the first before returning, so that a failure up to
    then is raised while the response can still carry its status; a failure after it becomes
    the stream's last item, an ``APIError`` for the surface to send in-band."""
    outputs = gen.outputs()
    first = await guard(outputs.__anext__())

    async def items() -> AsyncIterator[tuple[int, RequestOutput] | APIError]:
        try:
            item = first
            while True:
                yield item
                item = await outputs.__anext__()
        except StopAsyncIteration:
            pass
        except TimeoutError:
            yield gen.deadline.exceeded("mid-stream")
        except Exception as e:
            yield as_api_error(e)
        finally:
            await outputs.aclose()

    return items()


def stream_response(events: AsyncIterator[str], media_type: str = "text/event-stream") -> StreamingResponse:
    """A streamed HTTP answer, unbuffered by proxies (nginx honours X-Accel-Buffering)."""
    return StreamingResponse(events, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- embeddings and token counts ---------------------------------------------------------------------
async def encoder_of(state: ServerState, model: ServedModel, deadline: Deadline, guard: Guard):
    """The loaded embedding model (its size and tokenizer are needed to validate a request)."""
    return await guard(state.encoder(model, deadline.remaining()))


async def embed(state: ServerState, model: ServedModel, texts: list[str], deadline: Deadline, guard: Guard) -> torch.Tensor:
    """Unit vectors [len(texts), dims], computed off the event loop."""
    return await guard(state.embed(model, texts, deadline.remaining()))


async def count_chat_tokens(state: ServerState, model: ServedModel, messages: list[dict], guard: Guard) -> int:
    """Tokens of a conversation's prompt, as generation would count them (the tokenizer loads
    before the weights, so this rarely waits)."""
    engine = model.engine
    if engine.tokenizer is None:
        await guard(engine.wait_ready(state.config.server.engine_ready_timeout_s))
    return len(engine.tokenizer.encode_chat(messages, add_generation_prompt=True))


async def count_text_tokens(state: ServerState, model: ServedModel, texts: Sequence[str], deadline: Deadline, guard: Guard) -> int:
    """Tokens an embedding model reads of ``texts`` (after its truncation)."""
    encoder = await encoder_of(state, model, deadline, guard)
    return sum(encoder.count_tokens(list(texts)))
