"""The engine core: scheduler + model runner, one ``step()`` at a time.

It only sees token ids. Tokenising, detokenising and stop strings belong to the front
end (``output_processor``), so in ``gemel serve`` this object runs alone in a child
process and its loop never waits on Python work for the API.
"""

from __future__ import annotations

import logging
import time

import torch

from gemel.config import EngineConfig
from gemel.engine.block_manager import BlockManager
from gemel.engine.forking import CandidateForks
from gemel.engine.model_runner import ModelRunner, kv_bytes_per_token
from gemel.engine.protocol import EngineCoreOutput, EngineCoreRequest, EngineStats
from gemel.engine.scheduler import Scheduler, SchedulerConfig
from gemel.engine.sequence import FinishReason, Sequence, SequenceStatus
from gemel.engine.spec_decode import SpecStats, make_proposer
from gemel.engine.step_budget import StepTimeModel, prefill_keys
from gemel.layers import stream_prefetch
from gemel.layers.kernel_plan import plan_for_config
from gemel.layers.linear import apply_plan_
from gemel.loader.model_loader import LoadedModel, load_model, stores_weight_groups
from gemel.platform import select_device, select_dtype

log = logging.getLogger("gemel.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self._load_model(loaded)
        self._apply_kernel_plan()
        arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        self.seqs: dict[str, Sequence] = {}
        self.structured = None  # StructuredOutputManager, built on the first constrained request
        kv_dtype, num_blocks = self._build_kv_cache()
        self._build_scheduler()
        self._build_runner(num_blocks, kv_dtype)
        self._build_kv_tier(kv_dtype)
        self.forks = CandidateForks(self.scheduler, self.block_manager, self.runner, self.seqs.get)
        self.spec_stats = SpecStats()
        self.proposer = make_proposer(config, arch.num_layers, self.runner, self.block_manager)
        self.step_time_model = StepTimeModel()
        self.last_step_time_s = 0.0
        self.last_step_tokens = 0
        self.num_steps = 0  # forward passes run (the front end histograms each step's token count)
        self._log_ready(num_blocks)

    def _load_model(self, loaded: LoadedModel | None) -> None:
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = select_device(config.device)
        self.dtype = select_dtype(config.dtype, self.device, config.cpu_isa,
                                  weight_groups=lambda: stores_weight_groups(loaded.path if loaded else config.model))
        t0 = time.monotonic()
        self.loaded = loaded or load_model(config.model, self.dtype, self.device, config.max_model_len)
        self.load_time_s = time.monotonic() - t0

    def _apply_kernel_plan(self) -> None:
        self.plan, warnings = plan_for_config(self.config, self.device, self.dtype)
        for warning in warnings:
            log.warning(warning)
        log.info("kernel plan: %s", self.plan.describe())
        self.weight_quant = self.plan.weight_quant
        apply_plan_(self.loaded.model, self.plan, keep_dense=self.config.compile)
        prefetch = stream_prefetch.tune(self.loaded.model, self.plan)
        if prefetch is not None:
            log.info("int8_act_gemm tiles (%s): %s", self.plan.isa, prefetch.describe())

    def _build_kv_cache(self) -> tuple[torch.dtype, int]:
        """The KV cache's element type and size in blocks, and the block manager."""
        config = self.config
        if config.kv_cache_dtype == "float16" and self.dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype float16 needs dtype float32 (this engine computes in "
                             f"{str(self.dtype).removeprefix('torch.')}); use kv_cache_dtype auto")
        kv_dtype = {"int8": torch.int8, "float16": torch.float16}.get(config.kv_cache_dtype) or self.plan.kv_dtype or self.dtype
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_mb * 2**20 // (config.block_size * kv_bytes_per_token(self.loaded.arch, kv_dtype))
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        return kv_dtype, num_blocks

    def _build_scheduler(self) -> None:
        config = self.config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
            is_ready=self._is_ready,
        )

    def _build_runner(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """The model runner, with the optional CPU kernels, the compiled decode step and the
        seeded generator the configuration asks for."""
        config = self.config
        self.runner = ModelRunner(
            self.loaded.model, self.loaded.arch, num_blocks, config.block_size, self.dtype, self.device,
            kv_dtype=kv_dtype,
        )
        if config.cpu_attention_kernel and self.device.type == "cpu":
            log.info("C++ decode attention kernel: %s", "on" if self.runner.enable_decode_kernel() else "off")
        if config.cpu_fused_ops and self.device.type == "cpu":
            log.info("fused C++ element-wise ops: %s", "on" if self.runner.enable_fused_ops() else "off")
        if config.compile:
            t_compile = time.monotonic()
            self.runner.enable_compile(config.compile_max_batch_size, cpp_wrapper=config.compile_cpp_wrapper)
            log.info("compiled the decode step in %.1f s", time.monotonic() - t_compile)
        if config.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(config.seed)
            self.runner.sampler.shared_generator = gen

    def _log_ready(self, num_blocks: int) -> None:
        log.info(
            "engine ready: model=%s arch=%s device=%s dtype=%s kv_blocks=%d (x%d tokens) load=%.1fs threads=%d",
            self.loaded.path, self.loaded.arch.architecture, self.device, self.dtype, num_blocks,
            self.config.block_size, self.load_time_s, torch.get_num_threads(),
        )

    @property
    def num_forks(self) -> int:
        """Candidates that started from a fork of their leader's prompt KV."""
        return self.forks.num_forks

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    # -- requests ---------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.seqs:
            raise ValueError(f"request id {req.request_id!r} is already running")
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(req.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(req.prompt_token_ids)} tokens; this model's context is {self.max_model_len}"
            )
        vocab = self.loaded.arch.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(
            seq_id=req.request_id,
            token_ids=req.prompt_token_ids + req.output_token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            params=req.params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time,
            priority=req.params.priority,
            tenant=req.tenant,
            max_model_len=self.max_model_len,
            quota=req.quota,
        )
        if req.params.structured_output is not None:
            self._structured().add(req.request_id, req.params.structured_output, replay=req.output_token_ids)
        self.seqs[req.request_id] = seq
        leader = self.seqs.get(req.fork_of) if req.fork_of else None
        if not self.forks.hold(seq, leader):
            self.scheduler.add(seq)

    def _structured(self):
        if self.structured is None:
            from gemel.engine.structured_output import StructuredOutputManager

            self.structured = StructuredOutputManager(
                self.tokenizer.backend.to_str(), self.loaded.arch.vocab_size, list(self.eos_token_ids)
            )
            self.runner.structured = self.structured
        return self.structured

    def _is_ready(self, seq: Sequence) -> bool:
        return self.structured is None or self.structured.is_ready(seq.seq_id)

    def _release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        if self.structured is not None:
            self.structured.remove(seq_id)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is None:
                continue
            self.forks.abort(seq)
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self._release(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.forks.has_pending()

    # -- the step ---------------------------------------------------------------------
    def _update_token_budget(self) -> None:
        target = self.config.itl_target_ms
        max_tokens = self.config.max_num_batched_tokens
        if target is None:
            self.scheduler.set_token_budget(max_tokens)
            return
        running, queued = self.scheduler.running, self.scheduler.waiting
        prefilling = [s for s in running if s.num_uncomputed_tokens > 1]
        if not prefilling and not queued and not any(s.spec_token_ids for s in running):
            # One token a sequence, which any budget holds (it never falls below the decodes
            # and a chunk): the fit over recent steps (~50 us of Python) would bound nothing.
            self.scheduler.set_token_budget(max_tokens)
            return
        decoding = len(running) - len(prefilling)
        # The prompt a chunk would continue (running ones come first); a new prompt starts at 0.
        context = max((s.num_computed_tokens for s in prefilling), default=0)
        # the prompts in line, in the order the scheduler takes them (a few suffice for the floor)
        in_line = [s.num_uncomputed_tokens for s in prefilling[:8] + queued[: max(0, 8 - len(prefilling))]]
        budget = self.step_time_model.budget(
            target / 1000.0, decoding, max_tokens, context, len(queued) + len(prefilling), in_line
        )
        self.scheduler.set_token_budget(budget)

    def step(self) -> list[EngineCoreOutput]:
        if self.forks.has_pending():
            self.forks.fork_ready()
        self._update_token_budget()
        sched = self.scheduler.schedule()
        now = time.monotonic()
        outputs: dict[str, EngineCoreOutput] = {}
        for seq in sched.preempted:
            outputs[seq.seq_id] = EngineCoreOutput(seq.seq_id, [], events=[("preempted", now)])
        if sched.is_empty:
            if self.structured is not None and self.structured.pending:
                self.structured.wait_any(timeout=0.05)  # nothing else to run: don't spin
            return list(outputs.values())
        for seq in sched.first_scheduled:
            outputs.setdefault(seq.seq_id, EngineCoreOutput(seq.seq_id, [])).events.append(("scheduled", now))
        timed = self.config.itl_target_ms is not None  # the step-time model serves the target only
        keys = sum(prefill_keys(s.num_computed_tokens, n) for s, n in sched.scheduled if s.num_uncomputed_tokens > 1) if timed else 0
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        self.scheduler.update_after_step(sched, result.num_rejected)
        self.last_step_time_s = time.perf_counter() - t0
        self.last_step_tokens = sched.num_batched_tokens
        self.num_steps += 1
        if timed:
            self.step_time_model.observe(sched.num_batched_tokens, self.last_step_time_s, keys)
        for seq, _ in sched.scheduled:
            if seq.spec_token_ids:
                self.spec_stats.record(len(seq.spec_token_ids), len(seq.spec_token_ids) - result.num_rejected[seq.seq_id])
                seq.spec_token_ids = []
        if self.forks.has_pending():
            self.forks.fork_ready()
        done = time.monotonic()
        for i, seq in enumerate(result.seqs):
            if seq.status != SequenceStatus.RUNNING:
                continue
            out = outputs.setdefault(seq.seq_id, EngineCoreOutput(seq.seq_id, []))
            out.num_cached_tokens = seq.num_cached_tokens
            out.num_tier_tokens = seq.num_tier_tokens
            for j, token in enumerate(result.tokens[i]):
                seq.append_token(token)
                out.new_token_ids.append(token)
                out.new_logprobs.append(result.logprobs[i][j])
                out.new_top_logprobs.append(result.top_logprobs[i][j])
                if seq.num_output_tokens == 1:
                    out.events.append(("first_token", done))
                reason = seq.check_stop()
                if self.structured is not None and self.structured.accept(seq.seq_id, token) and reason is None:
                    reason = FinishReason.STOP  # the grammar is complete: nothing else may follow
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    self._release(seq.seq_id)
                    self.seqs.pop(seq.seq_id, None)
                    out.finish_reason = reason.value
                    out.stop_token_id = seq.stop_token_id
                    out.events.append(("finished", done))
                    break
        if self.proposer is not None:
            self.proposer.draft(self.scheduler.running, self.max_model_len)
        return list(outputs.values())

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``token_ids`` (scoring; tests compare them with HF)."""
        from gemel.engine.scheduler import SchedulerOutput
        from gemel.sampling_params import SamplingParams

        seq = Sequence(seq_id="__score__", token_ids=token_ids, params=SamplingParams())
        if not self.block_manager.allocate_slots(seq, len(token_ids)):
            raise RuntimeError("not enough free KV blocks to score this sequence")
        try:
            return self.runner.logits_for(SchedulerOutput(scheduled=[(seq, len(token_ids))]))
        finally:
            self.block_manager.free(seq)

    def _tier_stats(self) -> dict:
        tier = self.kv_tier
        if tier is None:
            return {}
        s = tier.stats
        return {
            "kv_tier_host_hits": s.host_hits, "kv_tier_disk_hits": s.disk_hits, "kv_tier_bytes_loaded": s.bytes_loaded,
            "kv_tier_bytes_saved": s.bytes_saved, "kv_tier_bytes_written": s.bytes_written,
        }  # fmt: skip

    def _build_kv_tier(self, kv_dtype: torch.dtype) -> None:
        """The host-memory and disk tiers behind the prefix cache, when configured."""
        self.kv_tier = None
        off = self.config.kv_offload
        if off is None or not self.config.enable_prefix_caching or (off.cpu_mb <= 0 and not off.disk_dir):
            return
        from gemel.engine.kv_tier import KVOffload, KVTier, fingerprint

        arch = self.loaded.arch
        key = fingerprint({
            "model": str(self.loaded.path), "arch": arch.architecture, "layers": arch.num_layers,
            "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab": arch.vocab_size,
            "kv_dtype": str(kv_dtype), "block_size": self.config.block_size, "device_dtype": str(self.dtype),
            "weights": _file_identity(self.loaded.path), "kernels": self.plan.describe(),
        })  # fmt: skip
        self.kv_tier = KVTier(off.cpu_mb << 20, off.disk_dir, int(off.disk_gb * 2**30), key)
        self.block_manager.offload = KVOffload(self.kv_tier, self.runner)
        log.info("KV tier: host %d MB, disk %s", off.cpu_mb, f"{off.disk_dir} ({off.disk_gb:g} GB)" if off.disk_dir else "off")

    def close(self) -> None:
        """Before the process ends: the disk tier gets every computed block still in the pool
        (so a restart finds what was hot, not only what had been evicted) and finishes its
        writes."""
        tier = self.kv_tier
        if tier is None:
            return
        if tier.dir is not None:
            saved = 0
            for block in self.block_manager.blocks:
                if block.block_hash is not None and not tier.on_disk(block.block_hash):
                    tier.write(block.block_hash, block.token_ids, self.runner.read_block(block.block_id))
                    saved += 1
            if saved:
                log.info("KV tier: writing %d blocks of the pool to disk before exiting", saved)
        tier.flush()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            step_tokens=self.last_step_tokens,
            step_time_s=self.last_step_time_s,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=list(self.spec_stats.accepted_per_position),
            **self._tier_stats(),
        )


def _file_identity(path: str) -> list:
    """Size and modification time of a checkpoint (a file or the files of a directory): a
    block computed from other weights at the same path must not be served."""
    import os

    files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    return [(os.path.basename(f), os.path.getsize(f), int(os.path.getmtime(f))) for f in files if os.path.isfile(f)]
