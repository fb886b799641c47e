"""A torch.compile'd forward pass, replayed per step shape without Dynamo's per-call guards.

At batch 1 on CPU a compiled decode step takes about 7.5 ms, and entering it through
Dynamo costs about 0.75 ms of that: its guards check some 250 tensors and 1,000 module
attributes on every call, and after a step has streamed the weights through the caches
each of those reads is a cache miss. vLLM dispatches to its compiled code directly for the
same reason, and so does this: the runner names each step's shape with a key (the batch
size: see ``ModelRunner._forward_for``), the first call with a new key goes through
torch.compile as usual (compiling if it must) and then records which of Dynamo's cache
entries passed their guards for it, and later calls with that key run that entry's code as
a plain function. It is what CUDA graph replay is on GPU. The key must therefore cover
everything that can change between the runner's calls; nothing else (weights, module
attributes, grad mode) changes after start-up. Where this PyTorch does not expose its cache
entries, every call goes through torch.compile.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


class CompiledForward:
    """``torch.compile(model.forward, **options)``, called as ``(key, *args)``."""

    def __init__(self, model: nn.Module, **options: Any):
        self.model = model
        self.options = options
        self.compiled = torch.compile(model.forward, **options)
        self.signature = inspect.signature(type(model).forward)  # "self", then forward's own
        self.replay: dict[Hashable, Callable] = {}  # step key -> the compiled code that serves it

    def __call__(self, key: Hashable, *args: Any) -> Any:
        fn = self.replay.get(key)
        if fn is not None:
            return fn(self.model, *args)
        out = self.compiled(*args)
        fn = self._entry_for(args)
        if fn is not None:
            self.replay[key] = fn
        return out

    def _entry_for(self, args: tuple) -> Callable | None:
        """The code of the cache entry whose guards pass for ``args`` (as Dynamo would pick it)."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entries = _debug_get_cache_entry_list(type(self.model).forward.__code__)
            bound = self.signature.bind(self.model, *args)
            bound.apply_defaults()  # the guards check the defaulted arguments too
            frame_locals = dict(bound.arguments)
            forward = type(self.model).forward
            for entry in entries:
                if entry.guard_manager.check(frame_locals):
                    if entry.code.co_freevars:  # would need closure cells only Dynamo can supply
                        return None
                    return types.FunctionType(entry.code, forward.__globals__, "compiled_forward", forward.__defaults__)
        except (ImportError, AttributeError, RuntimeError, TypeError) as exc:
            log.info("compiled code is called through torch.compile on every step: %s", exc)
        return None
