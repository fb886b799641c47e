"""The engine on a CUDA GPU: correctness against the CPU path, then throughput.

One prepared run for a machine with a GPU (CI has none). It needs torch with CUDA,
transformers, tokenizers, pydantic, pyyaml and gguf; no model package: every model is
made here with random weights, so nothing is downloaded and the weights fit anywhere.

1. Correctness, for the tiny Llama, Gemma 3 (sliding window) and Qwen2 checkpoints the unit
   tests use, and the tiny Llama written as a Q8_0 GGUF file (dequantised on the GPU):
   - gemel on CUDA in float32 against gemel on the CPU in float32 (the CPU path): prompt
     logits within 1e-3, greedy tokens equal;
   - gemel on CUDA in bf16 (the default there) against Hugging Face transformers on the
     CPU in float32: greedy tokens under tests/parity.py's bf16 rule (a divergence only
     where both tokens are in each side's top 5), and the largest logit difference;
   - a sampled batch (temperature, top-p, top-k, penalties, a seed) twice: the same tokens.
2. Throughput on a SmolLM2-135M-shaped Llama (random weights, bf16): output tokens per
   second of LLM.generate for 128-token prompts and 128 new tokens (EOS ignored) at
   several batch sizes, and transformers' batched ``generate`` on the same weights in
   the same run.

    python bench/gpu_check.py                     # on a machine with CUDA
    python bench/gpu_check.py --device cpu --quick  # the same script on the CPU (a dry run)

Prints two tables (and writes them as JSON to --json when given); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # conftest's model makers, parity's rule

# SmolLM2-135M-Instruct's shape (its config.json).
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


FP32_LOGITS_ATOL = 1e-3  # CUDA float32 against the CPU's: only summation order differs


def _prompts(n: int, length_choices, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.choice(length_choices))] for _ in range(n)]


def _greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    from gemel import SamplingParams

    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def _sampled(llm, prompts) -> list[list[int]]:
    from gemel import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, presence_penalty=0.2,
                            max_tokens=16, ignore_eos=True, seed=1234)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_model(name: str, source: str, device: str, hf_dir: str | None, steps: int) -> dict:
    """One checkpoint: the rows of the correctness table."""
    from parity import check_greedy, hf_logits

    from gemel import LLM

    prompts = _prompts(8, (1, 5, 9, 17, 33, 60), 300, seed=len(name))
    row: dict = {"model": name}
    kw = dict(block_size=4, num_kv_blocks=512, max_num_seqs=8)
    cpu = LLM(source, device="cpu", dtype="float32", **kw)
    cpu_logits = [cpu.engine.core.prompt_logits(p).float() for p in prompts]
    cpu_tokens = _greedy(cpu, prompts, steps)
    del cpu

    gpu32 = LLM(source, device=device, dtype="float32", **kw)
    diffs = [float((gpu32.engine.core.prompt_logits(p).float().cpu() - ref).abs().max())
             for p, ref in zip(prompts, cpu_logits)]
    row["fp32_logits_max_diff"] = max(diffs)
    gpu_tokens = _greedy(gpu32, prompts, steps)
    row["fp32_greedy_equal"] = f"{sum(a == b for a, b in zip(gpu_tokens, cpu_tokens))}/{len(prompts)}"
    first = _sampled(gpu32, prompts)
    row["sampled_repeatable"] = first == _sampled(gpu32, prompts)
    del gpu32

    bf16 = LLM(source, device=device, dtype="bfloat16", **kw)
    row["bf16_logits_max_diff"] = max(float((bf16.engine.core.prompt_logits(p).float().cpu() - ref).abs().max())
                                      for p, ref in zip(prompts, cpu_logits))
    bf16_tokens = _greedy(bf16, prompts, steps)
    if hf_dir is not None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        from parity import hf_greedy

        theirs = [hf_greedy(hf, p, steps) for p in prompts]
        results = [check_greedy(i, p, ours, ref, lambda ids: bf16.engine.core.prompt_logits(ids).float().cpu(), hf,
                                bf16=True) for i, (p, ours, ref) in enumerate(zip(prompts, bf16_tokens, theirs))]
        row["bf16_vs_hf_equal"] = f"{sum(r.equal for r in results)}/{len(results)} (rest near-ties)"
        row["hf_vs_cpu_logits_max_diff"] = max(float((hf_logits(hf, p) - ref).abs().max())
                                               for p, ref in zip(prompts, cpu_logits))
    else:
        row["bf16_greedy_equal_cpu"] = f"{sum(a == b for a, b in zip(bf16_tokens, cpu_tokens))}/{len(prompts)}"
    del bf16
    # What the CUDA path must meet (a bf16 divergence beyond the near-tie rule raised above).
    row["ok"] = (row["fp32_logits_max_diff"] <= FP32_LOGITS_ATOL and gpu_tokens == cpu_tokens
                 and row["sampled_repeatable"])
    return row


def correctness(device: str, work: str, steps: int) -> list[dict]:
    import conftest
    from parity import write_gguf

    rows = []
    makers = [("llama", conftest.make_tiny_llama), ("gemma3", conftest.make_tiny_gemma3),
              ("qwen2", conftest.make_tiny_qwen2)]
    for name, make in makers:
        directory = make(os.path.join(work, f"tiny-{name}"))
        rows.append(_guarded(check_model, f"tiny {name}", directory, device, directory, steps,
                             label={"model": f"tiny {name}"}))
        if name == "llama":
            gguf_path = write_gguf(directory, os.path.join(work, "tiny-llama-q8_0.gguf"), "llama", permute_qk=True,
                                   q8_0=True)
            rows.append(_guarded(check_model, "tiny llama Q8_0 GGUF", gguf_path, device, None, steps,
                                 label={"model": "tiny llama Q8_0 GGUF"}))
    return rows


def _guarded(fn, *args, label: dict):
    """fn(*args), or on an exception ``label`` with the error: one broken path must not hide
    the others' numbers."""
    try:
        return fn(*args)
    except Exception as exc:
        traceback.print_exc()
        return {**label, "error": f"{type(exc).__name__}: {exc}"[:300]}


def smollm2_shaped(work: str) -> str:
    """A SmolLM2-135M-shaped Llama with random bf16 weights under ``work`` (made once)."""
    import conftest
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = os.path.join(work, "smollm2-shaped")
    if not os.path.exists(directory):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE, eos_token_id=2, bos_token_id=None)).to(torch.bfloat16)
        model.save_pretrained(directory, safe_serialization=True)
        conftest._write_tokenizer(directory)
    return directory


def _engine_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "auto"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def throughput(device: str, work: str, batches: list[int], input_len: int, output_len: int,
               hf_batch: int | None, compile_up_to: int = 0) -> list[dict]:
    from gemel import LLM, SamplingParams

    directory = smollm2_shaped(work)
    vocab = SMOLLM2_SHAPE["vocab_size"]
    rows = []
    largest = max(batches)
    llm = LLM(directory, device=device, dtype=_engine_dtype(device), max_num_seqs=largest, max_num_batched_tokens=max(2048, input_len * min(largest, 64)),
              kv_cache_memory_mb=8192 if device == "cuda" else 2048,
              compile=compile_up_to > 0, compile_max_batch_size=max(compile_up_to, 1))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=_prompts(2, (16,), vocab, 0), sampling_params=SamplingParams(max_tokens=4),
                 use_tqdm=False)
    for batch in batches:
        prompts = _prompts(batch, (input_len,), vocab, seed=batch)
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        _sync(device)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        engine = f"gemel compiled to batch {compile_up_to}" if compile_up_to else "gemel"
        rows.append({"engine": engine, "batch": batch, "output_tok_s": round(produced / elapsed, 1),
                     "wall_s": round(elapsed, 2)})
        print(rows[-1], flush=True)
    del llm
    if hf_batch:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
        ids = torch.tensor(_prompts(hf_batch, (input_len,), vocab, seed=hf_batch), device=device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            hf.generate(ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False)
            _sync(device)
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False)
            _sync(device)
            elapsed = time.perf_counter() - start
        produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        rows.append({"engine": "transformers generate", "batch": hf_batch,
                     "output_tok_s": round(produced / elapsed, 1), "wall_s": round(elapsed, 2)})
        print(rows[-1], flush=True)
    return rows


def profile_decode(device: str, work: str, batches: list[int], steps: int = 16) -> None:
    """Where a decode step's time goes at each batch size: torch.profiler over ``steps``
    decode steps (after the prompts' prefill), the top ops by self CPU time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from gemel import LLM, SamplingParams

    llm = LLM(smollm2_shaped(work), device=device, dtype=_engine_dtype(device), max_num_seqs=max(batches))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for batch in batches:
        prompts = _prompts(batch, (32,), SMOLLM2_SHAPE["vocab_size"], seed=7)
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        _sync(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            _sync(device)
        elapsed = time.perf_counter() - start
        print(f"\n## profile, batch {batch}: {steps} tokens each in {elapsed * 1000:.0f} ms (profiled)", flush=True)
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        if device == "cuda":
            print(averages.table(sort_by="self_device_time_total", row_limit=12), flush=True)


def _table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) and k.endswith("diff") else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small throughput batches (a dry run on the CPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=None, help="transformers' batch (0 to skip)")
    ap.add_argument("--steps", type=int, default=24, help="greedy tokens per prompt in the correctness checks")
    ap.add_argument("--skip", choices=["correctness", "throughput"], default=None)
    ap.add_argument("--compile-up-to", type=int, default=0,
                    help="engine.compile for decode steps up to this batch (0: eager, the default)")
    ap.add_argument("--profile", action="store_true", help="then profile decode steps at each batch size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    batches = args.batches or ([1, 4] if args.quick else [1, 32, 256])
    hf_batch = args.hf_batch if args.hf_batch is not None else (4 if args.quick else 32)
    output_len = 16 if args.quick and args.output_len == 128 else args.output_len
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    print(env, flush=True)
    report: dict = {"env": env}
    with tempfile.TemporaryDirectory() as work:
        if args.skip != "correctness":
            t = time.perf_counter()
            report["correctness"] = correctness(args.device, work, args.steps)
            print(f"\n## correctness ({time.perf_counter() - t:.0f} s)\n" + _table(report["correctness"]), flush=True)
        if args.skip != "throughput":
            t = time.perf_counter()
            rows = _guarded(throughput, args.device, work, batches, args.input_len, output_len, hf_batch,
                            args.compile_up_to, label={"engine": "gemel"})
            report["throughput"] = [rows] if isinstance(rows, dict) else rows
            print(f"\n## throughput, {args.input_len} in / {output_len} out ({time.perf_counter() - t:.0f} s)\n"
                  + _table(report["throughput"]), flush=True)
        if args.profile:
            profile_decode(args.device, work, batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    rows = report.get("correctness", []) + report.get("throughput", [])
    failed = any("error" in r or r.get("ok") is False for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
