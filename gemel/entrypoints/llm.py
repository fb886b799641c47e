"""Offline batch API, as vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``, ``LLM(...).chat(...)``."""

from __future__ import annotations

import itertools

from gemel.config import EngineConfig
from gemel.engine.llm_engine import LLMEngine
from gemel.engine.output_processor import RequestOutput
from gemel.sampling_params import SamplingParams

# A prompt: text, a chat conversation (a list of {"role", "content"} messages), or vLLM's prompt
# dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": [...]} (TokensPrompt).
Prompt = str | list[dict] | dict


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _prompt_item(prompt) -> tuple[str | list[dict] | None, list[int] | None]:
    """(text or conversation, token ids) for one prompt in any of the accepted shapes."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise TypeError("prompt_token_ids must be a list of ints")
            text = prompt.get("prompt")  # the text the ids came from, when the caller has it
            return (text if isinstance(text, str) else None), list(ids)
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError("a {'prompt': ...} dict takes a string")
            return prompt["prompt"], None
        raise TypeError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
    if isinstance(prompt, str) or _is_conversation(prompt):
        return prompt, None
    raise TypeError(f"unsupported prompt {type(prompt).__name__}: use text, a prompt dict or a chat conversation")


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
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. As in vLLM, a prompt is text,
        ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, one of them or a list of them;
        a chat conversation (a list of messages) is one prompt too (``chat`` is the clearer
        call). ``prompt_token_ids=`` (vLLM's older keyword) and ``use_tqdm`` (no progress bar
        here) are accepted; LoRA adapters are refused."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported by gemel")
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass prompts or prompt_token_ids, not both")
            items: list = [(None, list(ids)) for ids in prompt_token_ids]
        else:
            if isinstance(prompts, (str, dict)) or _is_conversation(prompts):
                prompts = [prompts]
            items = [_prompt_item(p) for p in prompts or []]
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
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them; one output each. The
        keywords are vLLM's: ``add_generation_prompt`` (the assistant turn's header),
        ``continue_final_message`` (the model continues the last message instead of
        answering it), ``tools`` and ``chat_template_kwargs`` (template variables, e.g.
        ``enable_thinking``). A custom ``chat_template`` and LoRA adapters are refused."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported by gemel")
        if chat_template is not None:
            raise ValueError("a custom chat_template is not supported: gemel uses the model's own template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            if not _is_conversation(conversation):
                raise TypeError("chat takes a conversation (a list of {'role', 'content'} messages) or a list of them")
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tools=tools, **(chat_template_kwargs or {})
            )
            if continue_final_message:
                text = _cut_after_final_message(text, conversation[-1])
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode_rendered(text)})
        return self.generate(prompts, sampling_params)


def _cut_after_final_message(text: str, final: dict) -> str:
    """The rendered conversation up to the end of its last message's content, so the model
    writes on inside that message (what transformers' ``continue_final_message`` does)."""
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    content = (content or "").strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise ValueError("continue_final_message: the final message's content is not in the rendered prompt")
    return text[: at + len(content)]
