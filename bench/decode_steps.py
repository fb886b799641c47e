"""Milliseconds a decode step: B sequences decoding together, timed on the engine itself.

What a C=B round spends between its prompt waves: B random prompts of --input-len tokens
(distinct starts, so no prefix sharing) are prefilled, --warmup decode steps run, then --reps
runs of --steps decode steps each are timed around ``EngineCore.step`` (so the scheduler,
input preparation, the forward, the LM head and sampling, no HTTP). The contexts grow by one
token a step, from --input-len on. A shared machine only ever slows a run down, so the table
gives the fastest run and the median.

    python bench/decode_steps.py                       # SmolLM2, batch 32, 192-token prompts
    python bench/decode_steps.py --batch 1 --input-len 128
    python bench/decode_steps.py --model ~/.cache/gemel/models/gemma-3-270m-q4_k_m.gguf
    python bench/decode_steps.py --batch 1 --input-len 128 --parts   # layers, LM head, the rest

With ``--parts`` each run's step is also split into the layers' one C++ call (where the step
takes it), the LM head's greedy argmax and the rest (input preparation, the embedding, the
scheduler and outputs in Python), timed around those two calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from offline_throughput import random_prompts  # bench/, the script's own folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=25, help="decode steps per timed run")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    ap.add_argument("--parts", action="store_true", help="also split each step into layers, LM head and the rest")
    args = ap.parse_args()

    import torch

    from gemel import LLM, SamplingParams
    from gemel.layers.kernel_plan import cpu_info

    llm = LLM(os.path.expanduser(args.model), max_num_seqs=args.batch)
    engine = llm.engine
    vocab = engine.core.loaded.arch.vocab_size
    # Sequences whose prompts finish first start decoding first: enough tokens for every one to
    # outlast the timed steps however the prompts' steps fall (each has at least one token).
    total = args.warmup + args.steps * args.reps + args.batch * args.input_len + 1
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.batch, args.input_len, vocab, seed=0)):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    core = engine.core
    spent = {"layers": 0.0, "head": 0.0}
    if args.parts:
        time_calls(spent)
    core.step()
    while core.last_step_tokens != args.batch:  # the prompts' steps
        core.step()
    for _ in range(args.warmup):
        core.step()
    times, parts = [], []
    for _ in range(args.reps):
        spent.update(layers=0.0, head=0.0)
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
            if core.last_step_tokens != args.batch:
                raise SystemExit(f"a timed step ran {core.last_step_tokens} tokens, not {args.batch} decodes")
        times.append((time.perf_counter() - start) * 1000 / args.steps)
        parts.append((spent["layers"] * 1000 / args.steps, spent["head"] * 1000 / args.steps))

    print(cpu_info().describe())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model}")
    print(f"batch {args.batch}, prompts of {args.input_len} tokens, {args.reps} runs of {args.steps} decode steps")
    print()
    print("| ms a decode step | fastest run | median run | each run |")
    print("|---|---|---|---|")
    runs = " ".join(f"{t:.1f}" for t in times)
    print(f"| batch {args.batch} | {min(times):.1f} | {statistics.median(times):.1f} | {runs} |")
    if args.parts:
        print()
        print("| each run, ms a step | step | layers (one C++ call) | LM head (greedy) | the rest |")
        print("|---|---|---|---|---|")
        for t, (layers, head) in zip(times, parts):
            print(f"| | {t:.2f} | {layers:.2f} | {head:.2f} | {t - layers - head:.2f} |")
    return 0


def time_calls(spent: dict[str, float]) -> None:
    """Adds the time of each call of the layers' C++ step and of the greedy LM head to ``spent``."""
    from gemel.layers.decode_layers import DecodeLayers
    from gemel.layers.linear import Linear

    def timed(cls, name: str, key: str) -> None:
        inner = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(self, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        setattr(cls, name, wrapper)

    timed(DecodeLayers, "__call__", "layers")
    timed(Linear, "argmax", "head")


if __name__ == "__main__":
    sys.exit(main())
