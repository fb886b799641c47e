"""``gemel info``: the machine as gemel sees it. CPU model and flags, the instruction-set level
the kernels run at, threads, the kernel plan an engine would start with, and which kernel
builds are cached. The engine logs the same plan once at start-up."""

from __future__ import annotations

import argparse
import json
import sys


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="gemel.yaml whose engine section to plan for (default: the defaults)")
    p.add_argument("--cpu-isa", default=None, choices=["auto", "portable", "avx2", "avx512", "amx"],
                   help="plan for this instruction-set level (overrides engine.cpu_isa)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="plan for this dtype (overrides engine.dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def gather(config_path: str | None = None, cpu_isa: str | None = None, dtype: str | None = None) -> dict:
    """Everything ``gemel info`` prints, as plain data."""
    import torch

    from gemel.config import load_config
    from gemel.layers import cpu_kernels, kernel_plan, stream_prefetch
    from gemel.loader.model_loader import stores_weight_groups
    from gemel.platform import select_device, select_dtype

    engine = load_config(config_path).engine
    if cpu_isa is not None:
        engine.cpu_isa = cpu_isa
    if dtype is not None:
        engine.dtype = dtype
    cpu = kernel_plan.cpu_info()
    cache = {level: str(cpu_kernels.library_path(level)) if built else None
             for level, built in cpu_kernels.cached_levels().items()}
    device = select_device(engine.device)
    level = kernel_plan.resolve_isa(engine.cpu_isa)
    groups, model_note = False, None
    if engine.dtype == "auto" and device.type == "cpu":
        try:
            groups = stores_weight_groups(engine.model)
        except (FileNotFoundError, ValueError) as exc:
            model_note = f"model {engine.model!r} not readable ({exc}); dtype auto shown for dense weights"
    chosen = select_dtype(engine.dtype, device, engine.cpu_isa, weight_groups=lambda: groups)
    if engine.num_threads:
        torch.set_num_threads(engine.num_threads)
    plan, warnings = kernel_plan.plan_for_config(engine, device, chosen)
    if model_note:
        warnings.append(model_note)
    return {
        "cpu": {"model": cpu.model, "machine": cpu.machine, "flags": cpu.relevant_flags(), "best_isa": cpu.best_isa},
        "isa": level,
        "kernels_loaded": cpu_kernels.loaded_isa(),
        "threads": torch.get_num_threads(),
        "threads_note": "gemel serve with engine.num_threads unset adapts: all cores while other processes leave "
                        "them idle, one fewer while they keep them busy",
        "model": engine.model,
        "weight_groups": groups,
        "device": str(device),
        "dtype": str(chosen).removeprefix("torch."),
        "plan": [{"rows": rows, "kernel": kernel} for rows, kernel in plan.rows_table()],
        "weight_quant": plan.weight_quant,
        # the AVX2 and AVX-512 tiles' asking ahead for streamed weights: decided by timing when an engine starts
        "stream_prefetch": ("timed at engine start: calls of 1-2 rows ask for their weights ahead where that is faster "
                            "on this CPU, for 8-bit and 4-/5-bit codes apart (the engine logs what it chose)"
                            if stream_prefetch.applies(plan) else None),
        "warnings": warnings,
        "kernel_cache": cache,
    }


def run_info(args: argparse.Namespace) -> int:
    try:
        info = gather(args.config, args.cpu_isa, args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"gemel info: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cpu = info["cpu"]
    print(f"CPU:      {cpu['model']} ({cpu['machine']})")
    print(f"flags:    {' '.join(cpu['flags']) or '-'}")
    print(f"level:    {info['isa']} (this CPU runs up to {cpu['best_isa']}; kernels loaded: {info['kernels_loaded'] or 'none'})")
    print(f"threads:  {info['threads']} ({info['threads_note']})")
    print(f"model:    {info['model']}" + (" (projections in quantised groups)" if info["weight_groups"] else ""))
    print(f"device:   {info['device']}, dtype {info['dtype']}, weight_quant {info['weight_quant']}")
    print("kernel plan (a projection with the checkpoint's groups; others take the dense GEMM):")
    for row in info["plan"]:
        print(f"  rows {row['rows']:>7}: {row['kernel']}")
    if info["stream_prefetch"]:
        print(f"  prefetch: {info['stream_prefetch']}")
    for warning in info["warnings"]:
        print(f"  note: {warning}")
    print("kernel cache:")
    for level, path in info["kernel_cache"].items():
        print(f"  {level:<9} {path or 'not built (built on first use, or by scripts/install.sh)'}")
    return 0
