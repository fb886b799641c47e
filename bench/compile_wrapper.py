"""``engine.compile_cpp_wrapper``: decode step time at batch 1 with the compiled step's
kernels called from Python (inductor's default) and from C++ (``cpp_wrapper``).

Two engines of the latency configuration (checkpoint 4-bit weights, int8 activations,
compile) in one process, each decoding one 128-token prompt; they take turns, 5 steps at a
time, so both see the machine in the same state. Also prints each engine's start-up time
(compiling, or loading inductor's on-disk cache).

    python bench/compile_wrapper.py --threads 2
"""

from __future__ import annotations

import argparse
import random
import time

from gemel import LLM, SamplingParams
from gemel.benchmark.steps import print_step_table, steps_in_turns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40, help="turns of 5 steps per engine")
    args = ap.parse_args()
    kw = dict(num_threads=args.threads, weight_quant="checkpoint", compile=True, int8_activations=True,
              itl_target_ms=None)
    engines, startup = {}, {}
    for name, cpp in (("python wrapper", False), ("cpp_wrapper", True)):
        t = time.perf_counter()
        engines[name] = LLM(args.model, compile_cpp_wrapper=cpp, **kw).engine
        startup[name] = time.perf_counter() - t
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(128)]
    steps = args.rounds * 5 + 10
    for engine in engines.values():
        engine.add_request("a", prompt_token_ids=prompt,
                           params=SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True))
        for _ in range(10):
            engine.step()
    times = steps_in_turns(engines, args.rounds, steps_per_turn=5)
    print_step_table("compiled step", times, {"start-up (s)": {name: f"{s:.1f}" for name, s in startup.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
