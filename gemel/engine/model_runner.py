"""Turns a scheduled step into tensors, runs the model over the paged KV cache, samples.

Owns the KV-cache tensors (one [kv_heads, num_slots, head_dim] K and V per layer;
slot = block_id * block_size + offset) and the per-request random generators.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from gemel.engine.compiled_forward import CompiledForward
from gemel.engine.scheduler import SchedulerOutput
from gemel.engine.sequence import Sequence
from gemel.layers import cpu_kernels, kv_cache
from gemel.layers.attention import AttentionMetadata, build_group, context_slot_array
from gemel.engine.spec_decode import verify
from gemel.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from gemel.models.config import ModelArchConfig


@dataclass
class SampledTokens:
    """New tokens for the sequences whose step reached the end of their known tokens: one
    each, or up to k + 1 for a sequence whose k speculative tokens were verified."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    logprobs: list[list[float | None]]
    top_logprobs: list[list[list[tuple[int, float]] | None]]
    num_rejected: dict[str, int]


# Below this many shared tokens the extra matmuls and merge of cascade attention cost more
# than gathering the prefix once per sequence saves (where decodes are cascaded at all: not
# where the C++ decode kernel attends them, see ModelRunner._decode_group).
CASCADE_MIN_SHARED_TOKENS = 256


def shared_prefix_len(context_slots: list[np.ndarray], block_size: int) -> int:
    """Tokens at the start of every context stored in the same cache slots (whole blocks),
    leaving each sequence at least one token of its own."""
    n = min(len(s) for s in context_slots) - 1
    if n < block_size:
        return 0
    stacked = np.stack([s[:n] for s in context_slots])
    differs = np.flatnonzero((stacked != stacked[0]).any(axis=0))
    same = int(differs[0]) if differs.size else n
    return same - same % block_size


def split_by_context(context_lens: list[int], slack: int = 256) -> list[list[int]]:
    """Indices of decodes grouped so that no group pads short contexts to a much longer one.

    A decode group gathers every member's context padded to the longest, so one sequence
    with a 2,000-token context among dozens of short ones would make the whole step gather
    and multiply 2,000 positions per sequence (measured: a 40 ms step became 700 ms). A new
    group starts, in order of context length, where a context exceeds twice the group's
    shortest plus ``slack``; similar lengths, the common case, stay one group. Within a group
    the indices stay in step order (attention's single-group fast path relies on it).
    """
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and context_lens[i] <= 2 * context_lens[groups[-1][0]] + slack:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]  # members in step order: one group is then the identity


def kv_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    row = kv_cache.row_width(arch.head_dim, dtype) * torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * arch.num_kv_heads * row


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        arch: ModelArchConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        slots = num_blocks * block_size
        # Head-major ([kv_heads, slots, head_dim] per layer) so a gather of a batch's context
        # is already in the layout the attention matmuls want, with no transposing copy.
        shape = (arch.num_kv_heads, slots, kv_cache.row_width(arch.head_dim, self.kv_dtype))
        # Uninitialised here (an offline LLM touches only what it uses); the server's engine
        # process zeroes the whole pool at start-up (``prefault_kv``). Slot 0 pads gathers of
        # short contexts, so it must hold finite values. One tensor
        # per layer rather than views of one: torch.compile then checks 60 inputs for
        # aliasing cheaply instead of computing storage overlaps on every call.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(arch.num_layers):
            k, v = (torch.empty(shape, dtype=self.kv_dtype, device=device) for _ in range(2))
            k[:, :block_size].zero_()
            v[:, :block_size].zero_()
            self.kv_caches.append((k, v))
        self.sliding_window = arch.sliding_window if arch.layer_types and "sliding_attention" in arch.layer_types else None
        self.sampler = Sampler()
        self.decode_kernel = False  # set by enable_decode_kernel()
        self.fused_ops = False  # set by enable_fused_ops()
        self.compiled_forward = None  # set by enable_compile()
        self.compile_max_batch_size = 0
        self.structured = None  # StructuredOutputManager when any request is constrained
        self.generators: dict[str, torch.Generator] = {}
        # The last sampling batch and the sequences it is for, kept while a step samples the
        # same sequences (without penalties, which change with every token): its seven small
        # tensors were a tenth of a millisecond of a sampled batch-1 step.
        self._last_sampling: tuple[list[Sequence], SamplingBatch] | None = None

    # -- input preparation ------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode = ([], [], [], [])  # rows, positions, block tables, context lengths
        prefill = ([], [], [])  # rows, positions, context slots
        logits_rows: list[int] = []
        block_size = self.block_size
        row = 0
        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens
            end = start + n
            tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
            input_ids.extend(tokens[start:end])
            if n == 1:  # a decode: its one slot and its context from the block table, no arrays
                table = seq.block_table
                positions.append(start)
                slot_mapping.append(table[start // block_size] * block_size + start % block_size)
                decode[0].append(range(row, row + 1))
                decode[1].append([start])
                decode[2].append(table)
                decode[3].append(end)
            else:
                positions.extend(range(start, end))
                context = context_slot_array([seq.block_table], [end], block_size)[0]
                slot_mapping.extend(context[start:].tolist())
                prefill[0].append(range(row, row + n))
                prefill[1].append(list(range(start, end)))
                prefill[2].append(context)
            row += n
            if seq.spec_token_ids:  # logits at the last real token and at every proposal
                logits_rows.extend(range(row - 1 - len(seq.spec_token_ids), row))
            elif end == seq.num_tokens:
                logits_rows.append(row - 1)
        kernel = self._kernel_decodes()
        groups = [self._decode_group([decode[0][i] for i in b], [decode[1][i] for i in b], [decode[2][i] for i in b],
                                     [decode[3][i] for i in b], kernel)
                  for b in self._decode_batches(decode[3], kernel)]
        if prefill[0]:
            groups.append(build_group(prefill[0], prefill[1], prefill[2], self.sliding_window, self.device))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            groups=groups,
            num_tokens=row,
            decode_kernel=self.decode_kernel,
            fused_ops=self.fused_ops,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta, logits_rows

    @staticmethod
    def _decode_batches(context_lens: list[int], kernel: bool) -> list[list[int]]:
        """The decodes' attention groups. The C++ kernel reads each context to its own length,
        so where it attends decodes they stay one group whatever their lengths, and the step
        keeps the layers' one C++ call (which takes a single group): 32 decodes of 150 to 2,400
        tokens of context took 8-13% less a step so than in the groups below (SmolLM2 and
        Gemma 3, Zen 4), one of 3,000 or 7,000 among 150s as much or less. The PyTorch path
        pads every member to the group's longest, so there lengths far apart go apart.
        ``kernel``: whether the C++ kernel attends the decodes (``_kernel_decodes``)."""
        if kernel:
            return [list(range(len(context_lens)))] if context_lens else []
        return split_by_context(context_lens)

    def _decode_group(self, rows: list[range], positions: list[list[int]], block_tables: list[list[int]],
                      context_lens: list[int], kernel: bool):
        """A decode group; cascaded when its sequences share a long enough context prefix and
        the C++ kernel does not attend them. That kernel reads each sequence's context where it
        lies in the paged cache, so a shared prefix's blocks come from the CPU's caches for every
        sequence after the first, and the step keeps the layers' one C++ call; the cascaded form
        gathers the prefix and runs PyTorch matmuls. 32 decodes behind a shared prefix of 1,000
        to 6,000 tokens took 1.3-2x longer a step cascaded, on every plan tried."""
        slots = context_slot_array(block_tables, context_lens, self.block_size)
        shared = 0
        if self.sliding_window is None and len(rows) >= 2 and not kernel:
            shared = shared_prefix_len([s[:n] for s, n in zip(slots, context_lens)], self.block_size)
        if shared >= CASCADE_MIN_SHARED_TOKENS:
            return build_group(rows, positions, [s[shared:n] for s, n in zip(slots, context_lens)], None, self.device,
                               shared_slots=slots[0, :shared].tolist())
        return build_group(rows, positions, slots, self.sliding_window, self.device, masks=not kernel,
                           context_lens=np.asarray(context_lens, dtype=np.int64))

    def _kernel_decodes(self) -> bool:
        """Whether the C++ kernel attends this runner's decodes (no masks needed then)."""
        return self.decode_kernel and kv_cache.kernels_take(self.dtype, self.kv_caches[0][0])

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        last = self._last_sampling
        if last is not None and len(last[0]) == len(seqs) and all(a is b for a, b in zip(last[0], seqs)):
            return last[1]
        params = [s.params for s in seqs]
        vocab = self.arch.vocab_size
        dev = self.device

        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = SamplingBatch(
            temperature=t([p.temperature for p in params]),
            top_k=t([p.top_k if p.top_k > 0 else vocab for p in params], torch.long),
            top_p=t([p.top_p for p in params]),
            min_p=t([p.min_p for p in params]),
            presence_penalty=t([p.presence_penalty for p in params]),
            frequency_penalty=t([p.frequency_penalty for p in params]),
            repetition_penalty=t([p.repetition_penalty for p in params]),
            generators=[self._generator(s) for s in seqs],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(p.greedy for p in params),
        )
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            counts = torch.zeros(len(seqs), vocab, device=dev)
            for i, s in enumerate(seqs):
                out = s.output_token_ids
                if out:
                    counts[i].index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
            batch.output_counts = counts
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=dev)
            for i, s in enumerate(seqs):
                seen[i, torch.tensor(s.token_ids, device=dev)] = True
            batch.seen_mask = seen
        unchanging = batch.output_counts is None and batch.seen_mask is None
        self._last_sampling = (list(seqs), batch) if unchanging else None
        return batch

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            # A sequence resumed after an engine restart arrives with output tokens already:
            # draw what their sampling drew (one uniform each, as the sampler does), so its next
            # tokens are the ones an uninterrupted run samples.
            for _ in range(seq.num_output_tokens):
                Sampler.draw(gen)
            self.generators[seq.seq_id] = gen
        return gen

    @torch.inference_mode()
    def draft_greedy(self, seqs: list[Sequence], k: int, num_layers: int) -> list[list[int]]:
        """Self-speculative drafts: k greedy tokens per sequence from the target's first
        ``num_layers`` layers (the model loop stops with the shorter KV-cache list), then
        the final norm and LM head. Their KV writes in those layers are exactly what the
        full model writes there, and the verifying step overwrites them anyway. The
        sequences' blocks must already cover ``num_tokens - 1 + k`` positions."""
        tokens = [s.token_ids[-1] for s in seqs]
        positions = [s.num_tokens - 1 for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        for _ in range(k):
            lens = np.asarray(positions, dtype=np.int64) + 1
            slots = context_slot_array([s.block_table for s in seqs], lens.tolist(), self.block_size)
            group = build_group([range(i, i + 1) for i in range(len(seqs))], [[p] for p in positions], slots,
                                self.sliding_window, self.device, context_lens=lens)
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots[np.arange(len(seqs)), lens - 1]).to(self.device),
                groups=[group],
                num_tokens=len(seqs),
                decode_kernel=self.decode_kernel,
                fused_ops=self.fused_ops,
            )
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            hidden = self.model(ids, pos, meta, self.kv_caches[:num_layers])
            picked = self.model.greedy_tokens(hidden)
            tokens = (picked if picked is not None else self.model.compute_logits(hidden).argmax(dim=-1)).tolist()
            for d, t in zip(drafts, tokens):
                d.append(t)
            positions = [p + 1 for p in positions]
        return drafts

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block in every layer (copy-on-write of a forked sequence's last block)."""
        bs = self.block_size
        for layer in self.kv_caches:
            for cache in layer:
                cache[:, dst * bs : (dst + 1) * bs] = cache[:, src * bs : (src + 1) * bs]

    def prefault_kv(self) -> None:
        """Zero the whole KV pool, so a server's memory is resident from the start (about 0.3 s
        per GB) instead of creeping up as the prefix cache spreads over the pool, which looks
        like a leak and hides a real one."""
        for layer in self.kv_caches:
            for cache in layer:
                cache.zero_()

    def block_shape(self) -> tuple[int, ...]:
        """Shape of ``read_block``'s copy: [layers, 2 (K, V), kv_heads, block_size, row]."""
        heads, _, row = self.kv_caches[0][0].shape
        return (len(self.kv_caches), 2, heads, self.block_size, row)

    def read_block(self, block_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of one block's KV in every layer, on the CPU, shaped as ``block_shape`` (what
        the KV tier keeps of a block the pool evicts). ``out``, a buffer of that shape and the
        cache's dtype, is filled and returned instead of a new tensor: one copy, no allocation
        (a pool that evicts a block for every new one pays this on every block)."""
        sl = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        slices = [half[:, sl] for layer in self.kv_caches for half in layer]
        if out is None:
            return torch.stack(slices).to("cpu").view(self.block_shape())
        if self.device.type == "cpu":
            torch.stack(slices, out=out.view(len(slices), *out.shape[2:]))
        else:
            out.copy_(torch.stack(slices).view(out.shape))
        return out

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Put a block ``read_block`` copied back into pool slot ``block_id``."""
        sl = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        data = data.to(self.device)
        for i, (k, v) in enumerate(self.kv_caches):
            k[:, sl].copy_(data[i, 0])
            v[:, sl].copy_(data[i, 1])

    def release(self, seq_id: str) -> None:
        self.generators.pop(seq_id, None)
        self._last_sampling = None  # it may hold the sequence's generator

    # -- CPU decode attention kernel ----------------------------------------------------
    def enable_decode_kernel(self) -> bool:
        """Decode attention through the C++ kernel that reads the paged cache in place (CPU
        only; built on first use). Returns whether it is on: without a compiler it stays off."""
        self.decode_kernel = self.device.type == "cpu" and cpu_kernels.load()
        return self.decode_kernel

    def enable_fused_ops(self) -> bool:
        """RMSNorm, SiLU-and-mul and rotary as fused C++ ops in eager steps (CPU, Llama-family
        models; see layers/fused.py), and the C++ argmax and sampling of tokens (CPU, any model).
        Returns whether the fused ops are on."""
        self.sampler.cpu_argmax = self.sampler.cpu_sample = self.device.type == "cpu" and cpu_kernels.load()
        supported = getattr(self.model, "supports_fused_ops", False)
        self.fused_ops = self.device.type == "cpu" and supported and cpu_kernels.load()
        return self.fused_ops

    # -- compiled decode ----------------------------------------------------------------
    def enable_compile(self, max_batch_size: int, cpp_wrapper: bool = False) -> None:
        """Compile the forward pass for decode-only steps of up to ``max_batch_size`` sequences.

        At small batches a CPU step is mostly dispatch overhead of a few thousand small ops;
        inductor fuses them (and, with freezing, folds the weights in). Shapes are dynamic in
        batch and context length; batch 1 is specialised by PyTorch, so both it and one
        larger batch are compiled here (and the first batch past the low-bit copies' row limit,
        where the graph changes), before any request waits on it. Inductor caches the
        generated code on disk, so later start-ups are much faster. Other steps stay eager.
        Later steps replay the compiled code by their shape key (see ``CompiledForward``).
        With ``cpp_wrapper`` the generated kernels are called from a compiled C++ function
        rather than Python: at batch 1 that takes ~2 ms of Python off a ~20 ms step.
        """
        options = {"freezing": True, "cpp_wrapper": cpp_wrapper}
        self.compiled_forward = CompiledForward(self.model, dynamic=True, options=options)
        self.compile_max_batch_size = max_batch_size
        for batch in self._graph_batch_sizes(max_batch_size):
            self._warm_up_decode(batch, context=2 * self.block_size + 5)

    def _graph_batch_sizes(self, max_batch_size: int) -> list[int]:
        """The smallest batch of each distinct compiled graph up to ``max_batch_size``: 1
        (PyTorch specialises it), 2, and the first batch above each low-bit projection's
        ``packed_max_rows``, where the graph switches to the dense weights."""
        limits = {m.packed_max_rows for m in self.model.modules() if getattr(m, "quant", None) is not None}
        return sorted(b for b in {1, 2, *(n + 1 for n in limits)} if b <= max_batch_size)

    @torch.inference_mode()
    def _warm_up_decode(self, batch: int, context: int) -> None:
        """One throw-away decode step over the first slots of the cache (no sequence owns
        them yet at start-up; they only need to hold finite values afterwards)."""
        slots = [list(range(context)) for _ in range(batch)]
        group = build_group([range(b, b + 1) for b in range(batch)], [[context - 1]] * batch, slots,
                            self.sliding_window, self.device)
        meta = AttentionMetadata(slot_mapping=torch.full((batch,), context - 1, device=self.device),
                                 groups=[group], num_tokens=batch, decode_kernel=self.decode_kernel,
                                 fused_ops=self.fused_ops)
        ids = torch.zeros(batch, dtype=torch.long, device=self.device)
        pos = torch.full((batch,), context - 1, dtype=torch.long, device=self.device)
        self.compiled_forward(batch, ids, pos, meta, self.kv_caches)

    def _forward_for(self, sched: SchedulerOutput, meta: AttentionMetadata):
        """The compiled forward for small decode-only steps (one attention group, the shape it
        was compiled for), else the eager model. A one-token context (the prefill of a
        one-token prompt) stays eager too: PyTorch specialises size 1, so it would be a new
        graph to compile while the request waits. What remains selects a graph by the batch
        size alone (1 is its own graph; the low-bit projections switch at packed_max_rows),
        so that is the replay key."""
        if (
            self.compiled_forward is not None
            and len(meta.groups) == 1
            and meta.groups[0].shared_slots is None
            and len(sched.scheduled) <= self.compile_max_batch_size
            and all(n == 1 and not seq.spec_token_ids for seq, n in sched.scheduled)
            and meta.groups[0].kv_slots.shape[1] >= 2
        ):
            return functools.partial(self.compiled_forward, meta.num_tokens)
        return self.model

    # -- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SampledTokens:
        ids, pos, meta, logits_rows = self.prepare(sched)
        seqs = [seq for seq, n in sched.scheduled if seq.num_computed_tokens + n >= seq.num_tokens]
        if len(logits_rows) == meta.num_tokens:  # every row is read out: decodes, drafts to verify
            hidden = self._forward_for(sched, meta)(ids, pos, meta, self.kv_caches)
        else:  # a step with prompt tokens: the last layer finishes the rows read out alone
            # (one row where none is: the step is for the KV cache, its output unused)
            rows = torch.tensor(logits_rows or [meta.num_tokens - 1], device=self.device)
            hidden = self.model(ids, pos, meta, self.kv_caches, output_rows=rows)
        result = SampledTokens(seqs, [], [], [], {})
        if not seqs:
            return result
        if self._argmax_only(seqs):
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                result.tokens.extend([t] for t in tokens.tolist())
                result.logprobs.extend([None] for _ in seqs)
                result.top_logprobs.extend([None] for _ in seqs)
                return result
        logits = self.model.compute_logits(hidden)
        plain = [i for i, s in enumerate(seqs) if not s.spec_token_ids]
        row_of: list[int] = []  # first logits row of each sequence
        r = 0
        for s in seqs:
            row_of.append(r)
            r += len(s.spec_token_ids) + 1
        sampled = None
        if plain:
            plain_logits = logits if len(plain) == len(seqs) else logits[torch.tensor([row_of[i] for i in plain])]
            plain_seqs = [seqs[i] for i in plain]
            if self.structured is not None:
                self.structured.apply_mask(plain_logits, [s.seq_id for s in plain_seqs])
            sampled = dict(zip(plain, _unpack(self.sampler(plain_logits, self._sampling_batch(plain_seqs)))))
        for i, seq in enumerate(seqs):
            if i in (sampled or {}):
                tok, lp, top = sampled[i]
                result.tokens.append([tok])
                result.logprobs.append([lp])
                result.top_logprobs.append([top])
                continue
            k = len(seq.spec_token_ids)
            rows = logits[row_of[i] : row_of[i] + k + 1]
            if not seq.params.greedy:
                rows = self.sampler.processed_probs(rows, self._sampling_batch([seq] * (k + 1)))
            gen = self._generator(seq) or self.sampler.shared_generator
            tokens = verify(rows, seq.spec_token_ids, seq.params, gen)
            result.tokens.append(tokens)
            result.logprobs.append([None] * len(tokens))
            result.top_logprobs.append([None] * len(tokens))
            result.num_rejected[seq.seq_id] = k - (len(tokens) - 1)
        return result

    def _argmax_only(self, seqs: list[Sequence]) -> bool:
        """Whether each sequence's next token is just its logits' argmax: greedy, no
        log-probabilities, penalties, grammar or draft tokens to verify. Then the model may
        pick the tokens without writing the logits out (``greedy_tokens``)."""
        constrained = self.structured.matchers if self.structured is not None else {}
        return all(
            s.params.greedy and s.params.logprobs is None and not s.params.uses_penalties and not s.spec_token_ids
            and s.params.structured_output is None and s.seq_id not in constrained
            for s in seqs
        )

    @torch.inference_mode()
    def logits_for(self, sched: SchedulerOutput) -> torch.Tensor:
        """All-position logits of a step (tests compare them with Hugging Face)."""
        ids, pos, meta, _ = self.prepare(sched)
        hidden = self.model(ids, pos, meta, self.kv_caches)
        return self.model.compute_logits(hidden)


def _unpack(out: SamplerOutput) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    return list(zip(out.token_ids, out.logprobs, out.top_logprobs))
