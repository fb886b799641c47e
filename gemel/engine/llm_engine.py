"""In-process engine: tokeniser + engine core + output processor, driven by ``step()``."""

from __future__ import annotations

import time

from gemel.config import EngineConfig
from gemel.engine.core import EngineCore
from gemel.engine.output_processor import OutputProcessor, RequestOutput, RequestState, child_params
from gemel.engine.protocol import EngineCoreRequest
from gemel.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None):
        self.core = core or EngineCore(config or EngineConfig())
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer)

    def encode(self, prompt: str | list[dict] | None, prompt_token_ids: list[int] | None = None) -> tuple[str | None, list[int]]:
        """Text, chat messages or ids -> (prompt text, prompt ids)."""
        if prompt_token_ids is not None:
            return (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return text, self.tokenizer.encode_rendered(text)
        if not isinstance(prompt, str):
            raise TypeError("prompt must be a string, a list of chat messages, or token ids")
        return prompt, self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[dict] | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "",
    ) -> None:
        params = params or SamplingParams()
        text, ids = self.encode(prompt, prompt_token_ids)
        state = RequestState(request_id, text, ids, params, self.tokenizer)
        arrival = time.monotonic()
        for i, cand in enumerate(state.candidates):
            leader = state.candidates[0].seq_id if i > 0 else None
            self.core.add_request(
                EngineCoreRequest(cand.seq_id, ids, child_params(params, i), arrival, tenant, fork_of=leader)
            )
        self.processor.add(state)

    def abort(self, request_id: str) -> None:
        self.core.abort(self.processor.remove(request_id))

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished() or bool(self.processor.requests)
