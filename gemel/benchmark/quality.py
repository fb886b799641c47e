"""Teacher-forced quality of an engine configuration against a reference engine.

The reference (float32, say) generates greedy continuations of some chat prompts; every
configuration under test then reads those same token sequences in one prefill each, and we
count how often its next-token choice equals the reference's and the mean KL divergence of
its distribution from the reference's. Unlike comparing free-running outputs, one early
difference does not make the rest of a sequence incomparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


CHAT_PROMPTS = [
    "What is the capital of France?", "Name a colour.", "Count to five.", "Say hello in German.",
    "Explain photosynthesis in one sentence.", "Write a haiku about the sea.", "What is 12 times 7?",
    "Give me a tip for learning Python.", "Who wrote Hamlet?", "Describe a cat.", "List three fruits.",
    "Why is the sky blue?", "Tell me a joke.", "What is a prime number?", "How do planes fly?",
    "Translate 'thank you' to French.",
]


@dataclass
class ForcedCase:
    tokens: list[int]  # prompt + the reference's continuation
    start: int  # position whose logits predict the first continuation token
    reference_logits: torch.Tensor  # [continuation, vocab] float32


def reference_cases(reference, prompts: list[str], max_tokens: int = 64) -> list[ForcedCase]:
    """The reference ``LLM``'s greedy continuation of each chat prompt, with its logits."""
    from gemel import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cases = []
    for prompt in prompts:
        out = reference.chat([[{"role": "user", "content": prompt}]], sampling_params=params)[0]
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        start = len(out.prompt_token_ids) - 1
        cases.append(ForcedCase(tokens, start, reference.engine.core.prompt_logits(tokens)[start:-1].float()))
    return cases


def forced_scores(llm, cases: list[ForcedCase]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || llm)) over every continuation position."""
    agree = kl = count = 0.0
    for case in cases:
        logits = llm.engine.core.prompt_logits(case.tokens)[case.start : -1].float()
        ref = case.reference_logits
        agree += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        kl += F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum").item()
        count += len(ref)
    return agree / count, kl / count


def print_forced_table(model: str, variants: list[tuple[str, dict]], prompts: list[str] = CHAT_PROMPTS) -> None:
    """Score each (name, LLM keyword arguments) bf16 variant of ``model`` against float32, one table."""
    from gemel import LLM

    reference = LLM(model, dtype="float32")
    cases = reference_cases(reference, prompts)
    del reference
    width = max(len(name) for name, _ in variants)
    print(f"\n{'model':>{width}} {'top-1 agreement':>15} {'mean KL':>9}   (teacher-forced against float32)")
    for name, kwargs in variants:
        llm = LLM(model, dtype="bfloat16", **kwargs)
        agree, kl = forced_scores(llm, cases)
        print(f"{name:>{width}} {agree:15.3f} {kl:9.5f}")
        del llm
