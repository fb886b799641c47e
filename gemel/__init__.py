"""gemel: self-hosted inference for open LLMs (Gemini and OpenAI APIs over a paged-KV engine).

Import-light: the offline API is loaded on first use of ``LLM`` or ``SamplingParams``.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from gemel.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from gemel.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'gemel' has no attribute {name!r}")
