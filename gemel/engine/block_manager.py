"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, and the prefix cache.

The KV tensors themselves live in the model runner; this module only decides which
block ids a sequence owns. Full blocks are keyed by a hash chain of their tokens, and a
new sequence whose leading blocks hash (and compare) equal reuses them.
Freed blocks keep their hash in an LRU free queue until the space is needed again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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
    hits: int = 0  # of which served from cache


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], salt: str) -> int:
    """Chained key of one full block. Python hashes ints and tuples deterministically."""
    return hash((parent_hash, token_ids, salt))


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
                break
            block_ids.append(bid)
            hashes.append(h)
            parent = h
        return block_ids, hashes

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
