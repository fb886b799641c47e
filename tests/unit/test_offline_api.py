"""The offline API takes the call shapes of vLLM's documentation: text, lists of text,
``{"prompt": ...}`` and ``{"prompt_token_ids": ...}`` dicts, one output per prompt, always;
``chat`` takes conversations. The older ``prompt_token_ids=`` keyword keeps working."""

from __future__ import annotations

import pytest

from gemel import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, num_kv_blocks=64)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_text_prompts_one_output_each(llm):
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    single = llm.generate("Hello, my name is", PARAMS)
    assert len(single) == 1 and _tokens(single) == _tokens(outputs[:1])


def test_prompt_dicts_as_vllm_takes_them(llm):
    """Fifteen dict prompts give fifteen outputs (they were once taken as one conversation)."""
    texts = [f"Prompt number {i}" for i in range(15)]
    ids = [llm.tokenizer.encode(t) for t in texts]
    by_text = llm.generate([{"prompt": t} for t in texts], PARAMS)
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], sampling_params=PARAMS)
    assert len(by_text) == len(by_ids) == 15
    assert _tokens(by_text) == _tokens(by_ids)
    assert [o.prompt_token_ids for o in by_ids] == ids
    legacy = llm.generate(prompt_token_ids=ids, sampling_params=PARAMS)
    assert _tokens(legacy) == _tokens(by_ids)
    one = llm.generate({"prompt_token_ids": ids[3]}, PARAMS)
    assert _tokens(one) == _tokens(by_ids[3:4])
    mixed = llm.generate([texts[0], {"prompt_token_ids": ids[1]}, {"prompt": texts[2]}], [PARAMS] * 3)
    assert _tokens(mixed) == _tokens(by_ids[:3])


def test_chat_takes_conversations(llm):
    conversation = [{"role": "user", "content": "Hi there"}]
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert len(llm.chat(conversation, PARAMS, use_tqdm=False)) == 1
    both = llm.chat([conversation, other], PARAMS)
    assert len(both) == 2
    assert _tokens(both[:1]) == _tokens(llm.chat(conversation, PARAMS))
    assert _tokens(llm.generate(conversation, PARAMS)) == _tokens(both[:1])  # a conversation is one prompt


@pytest.mark.parametrize(
    "bad",
    [[{"text": "no prompt key"}], [{"prompt_token_ids": "not ids"}], [{"prompt": 5}], [3.5]],
)
def test_malformed_prompts_are_named(llm, bad):
    with pytest.raises(TypeError, match="prompt"):
        llm.generate(bad, PARAMS)


def test_prompts_and_prompt_token_ids_together_are_refused(llm):
    with pytest.raises(ValueError, match="not both"):
        llm.generate(["x"], PARAMS, prompt_token_ids=[[1, 2]])
    with pytest.raises(TypeError, match="conversation"):
        llm.chat([["not", "messages"]], PARAMS)


def test_chat_takes_vllms_template_keywords(llm):
    """``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` shape
    the prompt as vLLM (and transformers) do; what gemel cannot honour is refused by name."""
    tok = llm.tokenizer
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, I am"}]
    answer = llm.chat(conversation[:1], PARAMS, use_tqdm=False)[0]
    assert answer.prompt == tok.apply_chat_template(conversation[:1], add_generation_prompt=True)
    bare = llm.chat(conversation[:1], PARAMS, add_generation_prompt=False)[0]
    assert bare.prompt == tok.apply_chat_template(conversation[:1], add_generation_prompt=False)
    cont = llm.chat(conversation, PARAMS, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("Hello, I am") and cont.prompt_token_ids == tok.encode_rendered(cont.prompt)
    assert _tokens([cont]) == _tokens(llm.generate({"prompt_token_ids": cont.prompt_token_ids}, PARAMS))
    with_vars = llm.chat(conversation[:1], PARAMS, chat_template_kwargs={"enable_thinking": False})[0]
    assert with_vars.prompt == answer.prompt  # a variable the template does not use changes nothing
    with pytest.raises(ValueError, match="cannot both"):
        llm.chat(conversation, PARAMS, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(conversation, PARAMS, chat_template="{{ messages }}")
    with pytest.raises(ValueError, match="LoRA"):
        llm.chat(conversation, PARAMS, lora_request=object())
