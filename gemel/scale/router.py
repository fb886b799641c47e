"""Which replica takes a prompt: the one whose prefix cache most likely holds its start.

Each replica's engine keeps the KV blocks of prompts it served, keyed by the chain of block
hashes (``gemel.engine.block_manager.hash_block``, salted with the tenant, the same in every
process). The front end computes a new prompt's chain the same way and remembers, for each
block hash, the replica that most recently took a prompt with that block (an LRU-bounded map).
The rule:

1. prefer the replica of the longest matching leading chain (the owner of its last block);
2. unless it is busier than the least loaded replica by more than the margin,
   ``max(margin_requests, margin_ratio x least)`` ongoing requests (8, or 50% by default):
   then, as with no match at all, take the less loaded of two replicas drawn at random
   (power of two choices; a tie goes to the one picked longer ago).

Ongoing requests are this front end's own count: a request is counted from its choice until
its stream ends. Pure Python, no Ray: ``gemel.scale.replica`` adapts it to Ray Serve's request
router, and the unit tests drive it directly. ``round_robin`` (for comparison) cycles.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gemel.engine.block_manager import hash_block

Policy = Literal["prefix", "round_robin"]


@dataclass(frozen=True)
class RouteHint:
    """What the request router needs to place one call; it travels as the call's ``route``
    keyword argument (the replica ignores it)."""

    request_id: str = ""
    hashes: tuple[int, ...] = ()
    exclude: frozenset[str] = frozenset()  # replicas that failed this request
    target: str | None = None  # a call for this replica itself (its stats), not a request


@dataclass
class Choice:
    replica: str
    reason: str  # prefix | balance (the preferred one was too busy) | least_loaded (no match) | round_robin | only
    matched_blocks: int = 0


@dataclass
class RouterCounts:
    """Decisions so far, by reason, and the prompt blocks matched (for the docs' measurements)."""

    decisions: dict[str, int] = field(default_factory=dict)
    blocks: int = 0
    matched_blocks: int = 0


class PrefixRouter:
    """The replica choice of one model's pool; thread-safe (Ray Serve routes on its own thread)."""

    def __init__(
        self,
        block_size: int,
        policy: Policy = "prefix",
        max_entries: int = 100_000,
        margin_requests: int = 8,
        margin_ratio: float = 0.5,
        max_blocks: int = 512,
        seed: int | None = None,
    ):
        self.block_size = block_size
        self.policy = policy
        self.max_entries = max_entries
        self.margin_requests = margin_requests
        self.margin_ratio = margin_ratio
        self.max_blocks = max_blocks  # a longer prompt is routed by its first max_blocks blocks
        self.replicas: list[str] = []  # the live replicas, as Ray Serve last reported them
        self.counts = RouterCounts()
        self._lock = threading.Lock()
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> replica, least recent first
        self._ongoing: dict[str, int] = {}
        self._assigned: dict[str, tuple[str, tuple[int, ...]]] = {}  # request id -> (replica, its hashes)
        self._last_pick: dict[str, int] = {}
        self._tick = 0
        self._rr = 0
        self._rng = random.Random(seed)

    # -- the prompt's key -------------------------------------------------------------------
    def prefix_hashes(self, prompt_ids: Sequence[int], salt: str) -> tuple[int, ...]:
        """The hash chain of the prompt's full blocks, as its engine keys them."""
        if self.policy != "prefix":
            return ()
        bs = self.block_size
        out: list[int] = []
        parent = None
        for i in range(min(len(prompt_ids) // bs, self.max_blocks)):
            parent = hash_block(parent, tuple(prompt_ids[i * bs : (i + 1) * bs]), salt)
            out.append(parent)
        return tuple(out)

    # -- the choice ---------------------------------------------------------------------------
    def choose(
        self, hashes: Sequence[int], candidates: Sequence[str], exclude: Sequence[str] = (), request_id: str = ""
    ) -> Choice | None:
        """The replica for a prompt of chain ``hashes`` among ``candidates`` (ids), avoiding
        ``exclude`` while another remains. With ``request_id`` the request counts as ongoing on
        the chosen replica from now on (until ``release``); None without any candidate."""
        with self._lock:
            live = [r for r in candidates if r not in exclude] or list(candidates)
            if not live:
                return None
            choice = self._choose(hashes, sorted(live))
            c = self.counts
            c.decisions[choice.reason] = c.decisions.get(choice.reason, 0) + 1
            c.blocks += len(hashes)
            c.matched_blocks += choice.matched_blocks
            if request_id:
                self._assign(request_id, choice.replica, tuple(hashes))
            return choice

    def _choose(self, hashes: Sequence[int], live: list[str]) -> Choice:
        if len(live) == 1:
            return Choice(live[0], "only", self._matched(hashes, set(live))[0])
        if self.policy == "round_robin":
            self._rr += 1
            return Choice(live[self._rr % len(live)], "round_robin")
        matched, preferred = self._matched(hashes, set(live))
        loads = {r: self._ongoing.get(r, 0) for r in live}
        least = min(loads.values())
        if preferred is not None and loads[preferred] - least <= max(self.margin_requests, self.margin_ratio * least):
            return Choice(preferred, "prefix", matched)
        a, b = self._rng.sample(live, 2)
        pick = min((a, b), key=lambda r: (loads[r], self._last_pick.get(r, -1)))
        return Choice(pick, "balance" if preferred is not None else "least_loaded", matched)

    def _matched(self, hashes: Sequence[int], live: set[str]) -> tuple[int, str | None]:
        """Blocks of the longest leading chain some live replica served, and that replica."""
        matched, owner = 0, None
        for h in hashes:
            r = self._owner.get(h)
            if r is None or r not in live:
                break
            matched, owner = matched + 1, r
        return matched, owner

    # -- ongoing requests ---------------------------------------------------------------------
    def assign(self, request_id: str, replica: str, hashes: Sequence[int] | None = None) -> None:
        """The request runs on ``replica`` (Ray Serve may place it elsewhere than chosen, when the
        chosen one is full); its count moves there."""
        with self._lock:
            prev = self._assigned.get(request_id)
            if prev is not None and prev[0] == replica:
                return
            self._assign(request_id, replica, tuple(hashes) if hashes is not None else (prev[1] if prev else ()))

    def _assign(self, request_id: str, replica: str, hashes: tuple[int, ...]) -> None:
        self._release(request_id)
        self._assigned[request_id] = (replica, hashes)
        self._ongoing[replica] = self._ongoing.get(replica, 0) + 1
        self._tick += 1
        self._last_pick[replica] = self._tick
        owner = self._owner
        for h in hashes:
            owner[h] = replica
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)

    def release(self, request_id: str) -> None:
        """The request's stream ended (finished, failed or aborted)."""
        with self._lock:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        prev = self._assigned.pop(request_id, None)
        if prev is not None:
            n = self._ongoing.get(prev[0], 0) - 1
            if n > 0:
                self._ongoing[prev[0]] = n
            else:
                self._ongoing.pop(prev[0], None)

    def ongoing(self) -> dict[str, int]:
        """Ongoing requests of every live replica (0 included)."""
        with self._lock:
            return {r: self._ongoing.get(r, 0) for r in self.replicas}

    def replica_of(self, request_id: str) -> str | None:
        with self._lock:
            prev = self._assigned.get(request_id)
            return prev[0] if prev else None

    # -- the replica set ----------------------------------------------------------------------
    def set_replicas(self, replicas: Sequence[str]) -> tuple[list[str], list[str]]:
        """The live replicas now; returns (added, removed). The map keeps entries of a removed
        replica until they age out: they are skipped meanwhile."""
        with self._lock:
            new = sorted(set(replicas))
            added = [r for r in new if r not in self.replicas]
            removed = [r for r in self.replicas if r not in new]
            self.replicas = new
            return added, removed

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "margin_requests": self.margin_requests,
            "margin_ratio": self.margin_ratio,
            "entries": len(self._owner),
            "decisions": dict(self.counts.decisions),
        }


# Pools of this process by Ray Serve application name: the request router Ray Serve builds in
# this process finds its model's pool here (it is built from a pickled class, so module state
# is reached by importing this module at call time).
POOLS: dict[str, Any] = {}
