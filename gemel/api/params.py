"""The decoding knobs each surface exposes, in one table, and how their errors are named.

A knob has one name inside gemel (the ``SamplingParams`` field) and one on each surface:
Gemini's ``generationConfig`` field, OpenAI's body field (vLLM's extras such as ``top_k``
included). Surfaces read plain knobs from the table, and a ``SamplingParamError`` is
rendered with the name the caller used, so adding a knob means a ``SamplingParams`` field
and a row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gemel.api.errors import invalid
from gemel.sampling_params import SamplingParamError, SamplingParams

Surface = Literal["gemini", "openai"]


@dataclass(frozen=True)
class Knob:
    name: str  # the SamplingParams field
    gemini: str | None  # the generationConfig field (proto name); None where Gemini has none
    openai: str | None  # the body field; None where OpenAI has none
    plain: bool = True  # copied as sent when present; else the surface reads it with its own rules


KNOBS: tuple[Knob, ...] = (
    Knob("n", "candidate_count", "n"),
    Knob("temperature", "temperature", "temperature"),
    Knob("top_p", "top_p", "top_p"),
    Knob("top_k", "top_k", "top_k", plain=False),  # Gemini refuses a negative topK; vLLM reads it as "off"
    Knob("min_p", None, "min_p"),
    Knob("presence_penalty", "presence_penalty", "presence_penalty"),
    Knob("frequency_penalty", "frequency_penalty", "frequency_penalty"),
    Knob("repetition_penalty", None, "repetition_penalty"),
    Knob("seed", "seed", "seed"),
    Knob("max_tokens", "max_output_tokens", "max_tokens", plain=False),  # checked against the model's limit
    Knob("min_tokens", None, "min_tokens"),
    Knob("stop", "stop_sequences", "stop", plain=False),  # a string or a list on OpenAI
    Knob("logprobs", "logprobs", "logprobs", plain=False),  # needs responseLogprobs / logprobs: true
    Knob("ignore_eos", None, "ignore_eos"),
    Knob("priority", None, "priority"),  # a class the caller asks for; the tenant's class caps it
)
_BY_NAME = {k.name: k for k in KNOBS}


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


def public_name(field: str, surface: Surface) -> str:
    """What ``surface`` calls the SamplingParams field ``field``."""
    knob = _BY_NAME.get(field)
    if surface == "gemini":
        return f"generationConfig.{camel(knob.gemini)}" if knob and knob.gemini else field
    return knob.openai if knob and knob.openai else field


def plain_knobs(surface: Surface) -> list[tuple[str, str]]:
    """(surface name, SamplingParams field) of the knobs a surface copies as sent."""
    return [(getattr(k, surface), k.name) for k in KNOBS if k.plain and getattr(k, surface)]


def gemini_fields() -> set[str]:
    """The generationConfig fields that are decoding knobs."""
    return {k.gemini for k in KNOBS if k.gemini}


def make_params(values: dict, surface: Surface, sent_as: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from a surface's values; a bad one answers 400 under the name the caller
    used (``sent_as`` names fields sent under another name, e.g. ``max_completion_tokens``)."""
    try:
        return SamplingParams(**values)
    except SamplingParamError as e:
        name = (sent_as or {}).get(e.field) or public_name(e.field, surface)
        raise invalid(e.message_for(name), param=name) from None
