"""Offline batch API (SPEC F23): ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools

from gemel.config import EngineConfig
from gemel.engine.llm_engine import LLMEngine
from gemel.engine.output_processor import RequestOutput
from gemel.sampling_params import SamplingParams

Prompt = str | list[dict]


class LLM:
    """Loads one model and runs many prompts through the continuously batched engine.

    Keyword arguments are :class:`gemel.config.EngineConfig` fields
    (``LLM("gemma3-270m", dtype="float32", max_num_seqs=32)``).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_kwargs):
        # Offline work is about throughput: no step-time target unless asked for (serving has one).
        engine_kwargs.setdefault("itl_target_ms", None)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[Prompt] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt may be text or a list of chat messages."""
        if prompt_token_ids is not None:
            items: list = [(None, ids) for ids in prompt_token_ids]
        else:
            if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
                prompts = [prompts]
            items = [(p, None) for p in prompts or []]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise ValueError("need one SamplingParams per prompt")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(items)
        order = []
        for (prompt, ids), p in zip(items, params):
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, p, prompt_token_ids=ids)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(order):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in order]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(conversations, sampling_params)
