"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, and the prefix cache.

The KV tensors themselves live in the model runner; this module only decides which
block ids a sequence owns. Full blocks are keyed by a hash chain of their tokens, and a
new sequence whose leading blocks hash (and compare) equal reuses them.
Freed blocks keep their hash in an LRU free queue until the space is needed again.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from gemel.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions on a hit


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from cache (the pool or the KV tier)
    tier_hits: int = 0  # blocks loaded back from the KV tier (host memory or disk)


class BlockOffload(Protocol):
    """Where evicted prefix blocks go and come back from (``engine/kv_tier.py``)."""

    def save(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None: ...

    def has(self, block_hash: int) -> bool: ...

    def restore(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> str | None: ...


@functools.lru_cache(maxsize=4096)
def _salt_value(salt: str) -> int:
    """A tenant's salt as an int. Python's hash of a str changes with every process
    (PYTHONHASHSEED) while its hash of ints and tuples of ints does not, so with an int salt
    a block's key is the same in every engine process: the KV tier's disk files stay valid
    across restarts."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], salt: str) -> int:
    """Chained key of one full block, the same in every process (the first block's parent is
    0, not None, whose hash is its address in Python 3.11)."""
    return hash((0 if parent_hash is None else parent_hash, token_ids, _salt_value(salt)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Least recently freed first; blocks without a hash are put at the front (no reuse value).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        self.offload: BlockOffload | None = None  # the KV tier, when configured (set by the engine)

    # -- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # -- prefix cache ---------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Leading full blocks of ``seq`` already in the cache: (block ids, their hashes).

        At least one token is always left to compute, so the step that follows produces
        logits for the last token.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens, seq.tenant)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                bid = self._restore(h, tokens, block_ids)
                if bid is None:
                    break
            elif self.blocks[bid].ref_count == 0:
                self.free_queue.move_to_end(bid)  # about to be used: evict others first
            block_ids.append(bid)
            hashes.append(h)
            parent = h
        return block_ids, hashes

    def _restore(self, block_hash: int, tokens: tuple[int, ...], keep: list[int]) -> int | None:
        """Load a block the pool lost from the KV tier into a free slot, cached and unowned
        (the caller's allocation takes it). Never into a slot of ``keep``, the prefix found
        so far: it must stay while it is being assembled."""
        if self.offload is None or not self.offload.has(block_hash):
            return None
        pinned = sum(1 for b in keep if self.blocks[b].ref_count == 0)
        if self.num_free_blocks <= pinned:
            return None
        bid = self._pop_free_block()
        if self.offload.restore(bid, block_hash, tokens) is None:
            self.blocks[bid].ref_count = 0
            self.free_queue[bid] = None
            self.free_queue.move_to_end(bid, last=False)
            return None
        block = self.blocks[bid]
        block.ref_count = 0
        block.block_hash = block_hash
        block.token_ids = tokens
        self.hash_to_block[block_hash] = bid
        self.free_queue[bid] = None  # most recently used end
        self.stats.tier_hits += 1
        return bid

    def hashes_completed(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Hashes of the full blocks ``seq`` completes when ``num_new_tokens`` more of its tokens
        are computed: what a step that computes them will add to the cache."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        hashes = []
        for i in range(len(seq.block_hashes), min(seq.num_computed_tokens + num_new_tokens, seq.num_tokens) // bs):
            parent = hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]), seq.tenant)
            hashes.append(parent)
        return hashes

    def first_uncached_hash(self, seq: Sequence, cached_hashes: list[int]) -> int | None:
        """Hash of the block after ``seq``'s cached prefix, if that block is one a later lookup
        could find (a full block before the prompt's last token)."""
        i, bs = len(cached_hashes), self.block_size
        if not self.enable_prefix_caching or i >= (seq.num_tokens - 1) // bs:
            return None
        return hash_block(cached_hashes[-1] if cached_hashes else None, tuple(seq.token_ids[i * bs : (i + 1) * bs]), seq.tenant)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    # -- allocation -----------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        reclaimed = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        extra = self.blocks_needed_with_prefix(seq, num_new_tokens, len(cached_block_ids))
        return extra + reclaimed <= self.num_free_blocks

    def blocks_needed_with_prefix(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int) -> int:
        if not num_cached_blocks:
            return self.blocks_needed(seq, num_new_tokens)
        total = num_cached_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - num_cached_blocks)

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_block_ids: list[int] = (),
        cached_hashes: list[int] = (),
    ) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens; False (and no change) if full."""
        if not self.can_allocate(seq, num_new_tokens, cached_block_ids):
            return False
        if cached_block_ids:
            for bid in cached_block_ids:
                block = self.blocks[bid]
                if block.ref_count == 0:
                    del self.free_queue[bid]
                block.ref_count += 1
            seq.block_table = list(cached_block_ids)
            seq.block_hashes = list(cached_hashes)
            seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._pop_free_block())
        return True

    def _pop_free_block(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == bid:
                del self.hash_to_block[block.block_hash]
                if self.offload is not None:  # evicted from the pool: the tier keeps it
                    self.offload.save(bid, block.block_hash, block.token_ids)
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return bid

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens, seq.tenant)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.block_hash is None:
                self.hash_to_block[h] = block.block_id
                block.block_hash = h
                block.token_ids = tokens
            seq.block_hashes.append(h)
            parent = h

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None | bool:
        """Let ``child`` reuse ``parent``'s KV for its first ``num_tokens`` tokens.

        Full blocks are shared (reference counted); a partially filled last block is
        copied into a new block (copy-on-write done eagerly, since the child will write
        into it). Returns the (source, destination) block pair to copy, None when nothing
        needs copying, or False when no block is free for the copy.
        """
        bs = self.block_size
        shared, partial = divmod(num_tokens, bs)
        if partial and not self.free_queue:
            return False
        for bid in parent.block_table[:shared]:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table[:shared])
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_computed_tokens = num_tokens
        if not partial:
            return None
        dst = self._pop_free_block()
        child.block_table.append(dst)
        return parent.block_table[shared], dst

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; cached ones stay findable until reused (LRU)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(bid, last=False)
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                block.block_hash = None
                block.token_ids = ()
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].block_hash == h}
