"""The request path every surface shares, from a parsed request to the engine and back.

Gemini REST (``api/gemini.py``), OpenAI (``api/openai_api.py``) and gRPC
(``api/grpc_server.py``) only parse their wire format into a ``GenerationRequest`` (or the
texts of an embedding or token-counting request) and render what comes back. The steps in
between happen here, in this order:

1. ``resolve``: the model a request names (id or alias), or 404 in the surface's words;
   a generation or embedding method on the other kind of model is a 400. A generation for
   a route's name (``route_or_resolve``, ``gemel.api.routes``) gets the target the route
   chooses, or its fallback model when that target cannot serve in time.
2. The deadline (``Deadline``, made by the surface from its header or its call's deadline)
   and a ``Guard``: how the surface waits, bounded by the deadline and, over HTTP, by the
   client's presence (``http_guard``; gRPC cancels a departed call itself, ``deadline_guard``).
3. ``start_generation``: wait until the engine is ready, tokenise each prompt once, take
   the tenant's priority class, pass the gateway's admission (class queue, tokens/min),
   start one engine request per prompt and meter each stream for the gateway. With the
   response cache on (``gemel.cache``), a cached answer is looked up once the prompts are
   tokenised and, on a hit, replayed as the engine's streams (no readiness wait, no
   admission); a miss's answer is stored when its last output is out.
4. The answer: ``finish`` for a unary one (every prompt's final output), ``relay`` for a
   stream (the first output awaited before the response starts, so an early failure still
   gets its status; a later one arrives as one last in-band error).

Embeddings (``embed``) and token counting (``count_chat_tokens``, ``count_text_tokens``)
take the same resolve / deadline / guard steps.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from gemel.api.errors import APIError, as_api_error
from gemel.api.lifecycle import Collector, Deadline, guarded
from gemel.api.routes import USER_HEADER, RouteDecision, principal_of, routing_of
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


def route_or_resolve(
    state: ServerState, name: str, surface: str, api_version: str = "v1beta", kind: ModelKind = "generate",
    method: str = "", principal: Principal | None = None, user: str | None = None,
) -> tuple[ServedModel, RouteDecision | None]:
    """``resolve``, except that a generation for a route's name gets the model its route
    decides on (with the decision, which the request carries to ``start_generation``)."""
    routing = routing_of(state)
    if kind == "generate" and routing is not None:
        decision = routing.decide(name, principal, user)
        if decision is not None:
            return decision.model, decision
    return resolve(state, name, surface, api_version, kind, method), None


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
    route: RouteDecision | None = None  # set when ``name`` was a route's


def http_call(
    request: Request, name: str, surface: str, api_version: str = "v1beta", kind: ModelKind = "generate",
    method: str = "", user: str | None = None,
) -> HttpCall:
    """Steps 1 and 2 for an HTTP route; the response headers name the model (x-model-id) and,
    when a route's fallback answers, that fallback (x-gemel-fallback). ``user``: the caller's
    user id for a route that keeps users on one target (else the x-gemel-user header)."""
    state = state_of(request)
    principal = principal_of(request.scope.get("state", {}))
    user = user or request.headers.get(USER_HEADER)
    model, decision = route_or_resolve(state, name, surface, api_version, kind, method, principal, user)
    mark_model(request, model)
    if decision is not None and decision.fallback is not None:
        request.state.fallback_model = decision.fallback.id
    deadline = Deadline.from_request(request, state.config.server)
    return HttpCall(state, model, deadline, http_guard(request, deadline), decision)


# -- 3. generation ----------------------------------------------------------------------------------
@dataclass
class PromptInput:
    """One prompt as the engine takes it: token ids, and the text when there is one (OpenAI
    echo and the traces show it; a prompt sent as token ids has none)."""

    text: str | None
    token_ids: list[int]


Prompter = Callable[["Tokenizer"], list[PromptInput]]

# Prompts longer than this (characters) are rendered and tokenised on a worker thread, so the
# event loop every request shares keeps running while the tokenizer works (as far as it
# releases the GIL).
OFF_LOOP_CHARS = 100_000


async def off_loop(chars: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` (tokenisation of ``chars`` characters), off the event loop when long."""
    if chars > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def message_chars(messages: list[dict]) -> int:
    return sum(len(m.get("content") or "") for m in messages)


@functools.cache
def longest_token(tokenizer: Tokenizer) -> int:
    """The most characters one token covers (the longest vocabulary piece): a text of more
    than ``context x this`` characters cannot fit a context, and need not be tokenised to know."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.id_to_token(i)))
        except IndexError:
            pass
    return longest


class ChatPrompt:
    """The prompt of a conversation, rendered with the model's chat template once; its
    ``messages`` stay readable (the response cache's semantic match embeds them)."""

    def __init__(self, messages: list[dict]):
        self.messages = messages

    def __call__(self, tokenizer: Tokenizer) -> list[PromptInput]:
        text = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        return [PromptInput(text, tokenizer.encode_rendered(text))]


def chat_prompt(messages: list[dict]) -> Prompter:
    """The prompt of a conversation, rendered with the model's chat template once."""
    return ChatPrompt(messages)


@dataclass
class GenerationRequest:
    """What a surface parsed from its wire format, ready for the engine."""

    model: ServedModel
    params: SamplingParams
    deadline: Deadline
    prompts: Prompter  # run once the tokenizer is there; may raise APIError for bad prompts
    priority: int | None = None  # a class the caller asked for; never above the tenant's
    prompt_chars: int = 0  # the prompts' length in characters: long ones are tokenised off the event loop
    route: RouteDecision | None = None  # the route that chose ``model``, told how the request went
    no_cache: bool = False  # Cache-Control: no-cache: a fresh answer, not the response cache's
    no_store: bool = False  # Cache-Control: no-store: nor is the answer kept


class Generation:
    """A request running in the engine: its prompts and one metered output stream each."""

    def __init__(self, request: GenerationRequest, prompts: list[PromptInput], streams: list[AsyncIterator[RequestOutput]]):
        self.request = request
        self.prompts = prompts
        self.streams = streams
        self.collectors = [Collector() for _ in streams]
        self.cache: str | None = None  # x-gemel-cache: exact | semantic | miss; None while the cache is off
        self.on_finished: Callable[[list[RequestOutput | None]], None] | None = None  # given the final outputs

    def _finished(self, outs: list) -> list[RequestOutput]:
        if self.on_finished is not None:
            self.on_finished(outs)
        return outs

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
            return self._finished([await runs[0]])
        tasks = [asyncio.ensure_future(r) for r in runs]
        try:
            return self._finished(await asyncio.gather(*tasks))
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
        last: list[RequestOutput | None] = [None] * len(self.streams)
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                last[0] = out
                yield 0, out
            self._finished(last)
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
                    last[i] = item
                    yield i, item
            self._finished(last)
        finally:  # cancelling a pump closes its stream, which aborts the request in the engine
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def start_generation(state: ServerState, req: GenerationRequest, principal: Principal, guard: Guard) -> Generation:
    """Step 3: readiness, tokenisation, priority, the response cache, admission, then the engine
    requests. A cached answer needs only the tokenizer (loaded before the weights) and takes no
    tokens/min and no class-queue place: it is replayed as the engine's streams."""
    engine = req.model.engine
    cache = getattr(state, "response_cache", None)
    if cache is None or engine.tokenizer is None:
        await guard(engine.wait_ready(min(req.deadline.remaining(), state.config.server.engine_ready_timeout_s)))
    if req.prompt_chars > engine.max_model_len and engine.max_model_len > 0:
        chars_per_token = await asyncio.to_thread(longest_token, engine.tokenizer)
        if req.prompt_chars > engine.max_model_len * chars_per_token:
            raise APIError(
                400, f"the prompt has more than {engine.max_model_len} tokens; this model's context is {engine.max_model_len} tokens"
            )
    prompts = await off_loop(req.prompt_chars, req.prompts, engine.tokenizer)
    params = req.params
    params.priority = principal.priority_for(req.priority)
    lookup = None
    if cache is not None:
        lookup = await guard(cached_answer(cache, req, prompts, principal))
        if lookup.outputs is not None:
            gen = Generation(req, prompts, lookup.streams())
            gen.cache = lookup.result
            return gen
        await guard(engine.wait_ready(min(req.deadline.remaining(), state.config.server.engine_ready_timeout_s)))
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    overflow = req.route is not None and req.route.overflow  # a queue-full fallback: it waits on another engine
    await principal.admit_generation(prompt_tokens, params.max_tokens * params.n * len(prompts), overflow=overflow)
    streams = [
        principal.meter(
            engine.generate(uuid.uuid4().hex, p.text, p.token_ids, params, principal.tenant, req.deadline.at, quota=principal.quota),
            i,
        )
        for i, p in enumerate(prompts)
    ]
    if req.route is not None:
        streams = req.route.observe(streams)  # time to first output and failures, for a canary's SLO
    gen = Generation(req, prompts, streams)
    if lookup is not None:
        gen.cache, gen.on_finished = lookup.result, lookup.finished
    return gen


def cached_answer(cache, req: GenerationRequest, prompts: list[PromptInput], principal: Principal):
    """The response cache's lookup for a tokenised request (``gemel.cache.response``)."""
    messages = getattr(req.prompts, "messages", None)
    if messages is not None:
        from gemel.cache.semantic import conversation_text

        text = conversation_text(messages)
    else:
        text = None
    route = req.route.route.name if req.route is not None else None
    return cache.lookup(
        principal.tenant, req.model.id, req.model.version, [(p.text, p.token_ids) for p in prompts], req.params,
        semantic_text=text, names=(route,), no_cache=req.no_cache, no_store=req.no_store,
    )


async def start_http_generation(request: Request, call: HttpCall, req: GenerationRequest, principal: Principal) -> Generation:
    """Step 3 for an HTTP route: the request's ``Cache-Control`` directs the response cache,
    and the answer's ``x-gemel-cache`` header says what it did."""
    from gemel.cache.keys import cache_directives

    req.no_cache, req.no_store = cache_directives(request.headers.get("cache-control"))
    gen = await start_generation(call.state, req, principal, call.guard)
    if gen.cache is not None:
        request.state.response_cache = gen.cache
    return gen


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
    return len(await off_loop(message_chars(messages), engine.tokenizer.encode_chat, messages, True))


async def count_text_tokens(state: ServerState, model: ServedModel, texts: Sequence[str], deadline: Deadline, guard: Guard) -> int:
    """Tokens an embedding model reads of ``texts`` (after its truncation)."""
    encoder = await encoder_of(state, model, deadline, guard)
    return sum(await off_loop(sum(map(len, texts)), encoder.count_tokens, list(texts)))
