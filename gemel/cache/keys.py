"""What makes two requests the same request, for the response cache.

A key is the SHA-256 of a canonical JSON of the request as the engine sees it: tenant,
served model (id and version, after alias resolution), the prompts' token ids (the chat
template already turned Gemini contents and OpenAI messages into the same tokens) and every
``SamplingParams`` field that can change the answer. Nothing of the surface is in it, so a
Gemini and an OpenAI request for the same thing share an entry. The tenant is always in it:
no tenant reads another's answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

from gemel.sampling_params import SamplingParams

# Fields that never change the answer: the scheduling class decides when, not what.
NOT_IN_KEY = frozenset({"priority"})
# Fields greedy decoding never reads (the argmax is taken after the penalties alone).
SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p", "seed")


def deterministic(params: SamplingParams) -> bool:
    """Only answers that would come out the same again are cached: greedy, or seeded sampling."""
    return params.greedy or params.seed is not None


def params_fingerprint(params: SamplingParams) -> dict:
    """The fields of ``params`` that can change the answer, normalised (every field of the
    dataclass unless listed in ``NOT_IN_KEY``, so a new knob is part of the key by default)."""
    out: dict = {}
    for f in dataclasses.fields(params):
        if f.name in NOT_IN_KEY:
            continue
        value = getattr(params, f.name)
        if f.name == "structured_output":
            value = None if value is None else [value.kind, value.spec]
        elif f.type == "float":
            value = float(value)  # 1 and 1.0 are one temperature
        out[f.name] = value
    if params.greedy:
        for name in SAMPLING_ONLY:
            out.pop(name, None)
        out["temperature"] = 0.0
    return out


def _digest(obj: dict) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def exact_key(tenant: str, model_id: str, model_version: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> str:
    """The entry of this exact request: same tenant, model, prompt tokens and answer-changing knobs."""
    return _digest(
        {
            "kind": "exact",
            "tenant": tenant,
            "model": [model_id, model_version],
            "prompts": [list(p) for p in prompts],
            "params": params_fingerprint(params),
        }
    )


def partition_key(tenant: str, model_id: str, model_version: str, params: SamplingParams) -> str:
    """The semantic index a one-prompt request searches: same tenant, model and knobs, any prompt."""
    return _digest(
        {"kind": "semantic", "tenant": tenant, "model": [model_id, model_version], "params": params_fingerprint(params)}
    )


def cache_directives(value: str | None) -> tuple[bool, bool]:
    """(skip the read, skip the write) of a request's ``Cache-Control``: ``no-cache`` asks for
    a fresh answer (which is then stored), ``no-store`` also keeps it out of the cache."""
    if not value:
        return False, False
    directives = {d.strip().split("=", 1)[0].lower() for d in value.split(",")}
    no_store = "no-store" in directives
    return no_store or "no-cache" in directives, no_store
