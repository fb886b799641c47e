"""A second life for prefix blocks: host memory, then disk, behind the engine's KV pool.

The prefix cache keeps a computed block findable only while its pool slot is not needed
for something else. With a tier, a full block the pool evicts is copied to host memory
(``cpu_mb``, LRU) and written through to files in ``disk_dir`` (``disk_gb``, LRU), keyed
by the same hash chain as the prefix cache (tenant salt included). A later prompt whose
leading blocks miss the pool but hit the tier loads them back instead of recomputing them,
and the disk tier outlives the engine and ``gemel serve``: a returning long conversation or
document is not prefilled again.

A disk file holds one block of every layer, behind a header with a format version, the
model's fingerprint (architecture, KV layout, dtype, block size, Python's hash scheme) and a
BLAKE2 checksum of the payload; a file that fails any check is deleted, never served.
Writes go through a background thread (the engine loop never waits on the disk) and land
atomically (temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("gemel.engine.kv_tier")

FORMAT_VERSION = 1
MAGIC = b"GMKV"
SUFFIX = ".kvb"


@dataclass
class TierStats:
    host_hits: int = 0  # blocks loaded back from host memory
    disk_hits: int = 0  # blocks loaded back from disk
    bytes_loaded: int = 0
    bytes_saved: int = 0  # copied out of the pool (to host memory)
    bytes_written: int = 0  # written to disk
    rejected_files: int = 0  # disk files that failed a check (deleted)


def fingerprint(parts: dict) -> str:
    """What must match for a stored block to be valid: the model and the KV layout, plus the
    interpreter's hash scheme (the chain keys are Python hashes of ints)."""
    body = dict(parts, format=FORMAT_VERSION, hash=f"{sys.hash_info.algorithm}-{sys.hash_info.width}")
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=12).hexdigest()


class KVTier:
    """Host-memory and disk tiers of KV blocks, each size-bounded with LRU eviction."""

    def __init__(self, cpu_bytes: int, disk_dir: str | None, disk_bytes: int, model_fingerprint: str):
        self.cpu_bytes = cpu_bytes
        self.disk_bytes = disk_bytes
        self.fingerprint = model_fingerprint
        self.stats = TierStats()
        self.host: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.host_used = 0
        self.dir = Path(disk_dir) / model_fingerprint if disk_dir else None
        self.disk: OrderedDict[int, int] = OrderedDict()  # hash -> file size, least recently used first
        self.disk_used = 0
        self._lock = threading.Lock()  # the disk index, shared with the writer thread
        self._pending: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}  # queued for disk, still readable
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemel-kv-tier") if self.dir else None
        # Buffers of blocks host memory let go, for the next evicted block to be copied into:
        # once the tier is full, every save evicts one, and a fresh allocation of a few hundred
        # KB is an mmap and a page fault per 4 KB, which cost more than the copy itself.
        self._spare: list[torch.Tensor] = []
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.dir is not None

    # -- lookups ---------------------------------------------------------------------------------
    def has(self, block_hash: int) -> bool:
        return block_hash in self.host or block_hash in self._pending or block_hash in self.disk

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> tuple[torch.Tensor, str] | None:
        """The block's KV and where it came from ("host" or "disk"), or None (a miss, or a
        disk file that failed its checks)."""
        entry = self.host.get(block_hash)
        if entry is not None and entry[0] == token_ids:
            self.host.move_to_end(block_hash)
            self.stats.host_hits += 1
            self.stats.bytes_loaded += entry[1].nbytes
            return entry[1], "host"
        pending = self._pending.get(block_hash)
        if pending is not None and pending[0] == token_ids:
            self.stats.host_hits += 1
            self.stats.bytes_loaded += pending[1].nbytes
            return pending[1], "host"
        if self.dir is None or block_hash not in self.disk:
            return None
        data = self._read(block_hash, token_ids)
        if data is None:
            return None
        self.stats.disk_hits += 1
        self.stats.bytes_loaded += data.nbytes
        return data, "disk"

    # -- saving ------------------------------------------------------------------------------------
    def put(self, block_hash: int, token_ids: tuple[int, ...], data: torch.Tensor) -> None:
        """Keep an evicted block (``data`` is a copy the tier owns). The disk gets it at once
        too (written through, in the background), so what host memory holds when the process
        ends is not lost to the next one."""
        self.stats.bytes_saved += data.nbytes
        self._to_disk(block_hash, token_ids, data)
        if self.cpu_bytes <= 0:
            return
        old = self.host.pop(block_hash, None)
        if old is not None:
            self.host_used -= old[1].nbytes
            self._recycle(block_hash, old[1])
        self.host[block_hash] = (token_ids, data)
        self.host_used += data.nbytes
        while self.host_used > self.cpu_bytes and self.host:
            evicted_hash, (_, evicted) = self.host.popitem(last=False)
            self.host_used -= evicted.nbytes
            self._recycle(evicted_hash, evicted)

    def spare_buffer(self) -> torch.Tensor | None:
        """A buffer host memory no longer holds, to copy the next evicted block into (None:
        allocate one)."""
        return self._spare.pop() if self._spare else None

    def _recycle(self, block_hash: int, data: torch.Tensor) -> None:
        with self._lock:  # a block still queued for the disk keeps its buffer until written
            pending = self._pending.get(block_hash)
            if pending is not None and pending[1] is data:
                return
        if len(self._spare) < 8 and (not self._spare or self._spare[0].shape == data.shape):
            self._spare.append(data)

    def on_disk(self, block_hash: int) -> bool:
        return block_hash in self.disk or block_hash in self._pending

    def write(self, block_hash: int, token_ids: tuple[int, ...], data: torch.Tensor) -> None:
        """Queue a block for the disk tier only (a block still in the pool, at shutdown)."""
        self._to_disk(block_hash, token_ids, data)

    def _to_disk(self, block_hash: int, token_ids: tuple[int, ...], data: torch.Tensor) -> None:
        if self.dir is None or self.disk_bytes <= 0:
            return
        with self._lock:
            if block_hash in self.disk:
                self.disk.move_to_end(block_hash)
                return
            self._pending[block_hash] = (token_ids, data)
        self._writer.submit(self._write, block_hash, token_ids, data)

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"

    def _write(self, block_hash: int, token_ids: tuple[int, ...], data: torch.Tensor) -> None:
        try:
            payload = data.contiguous().view(torch.uint8).numpy().tobytes()
            header = json.dumps({
                "format": FORMAT_VERSION, "fingerprint": self.fingerprint, "hash": block_hash,
                "tokens": list(token_ids), "shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
            }).encode()  # fmt: skip
            path = self._path(block_hash)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<HI", FORMAT_VERSION, len(header)) + header + payload)
            os.replace(tmp, path)
            size = path.stat().st_size
            with self._lock:
                self.disk[block_hash] = size
                self.disk.move_to_end(block_hash)
                self.disk_used += size
                self.stats.bytes_written += size
                victims = []
                while self.disk_used > self.disk_bytes and len(self.disk) > 1:
                    h, sz = self.disk.popitem(last=False)
                    self.disk_used -= sz
                    victims.append(h)
            for h in victims:
                self._path(h).unlink(missing_ok=True)
        except OSError as e:  # a full or read-only disk costs the tier, never the request
            log.warning("KV tier: could not write a block to %s: %s", self.dir, e)
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)

    # -- reading back -------------------------------------------------------------------------------
    def _read(self, block_hash: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
            if raw[:4] != MAGIC:
                raise ValueError("not a KV block file")
            version, header_len = struct.unpack_from("<HI", raw, 4)
            if version != FORMAT_VERSION:
                raise ValueError(f"format {version}, expected {FORMAT_VERSION}")
            start = 4 + struct.calcsize("<HI")
            header = json.loads(raw[start : start + header_len])
            payload = raw[start + header_len :]
            if header.get("fingerprint") != self.fingerprint or header.get("hash") != block_hash:
                raise ValueError("written for another model or block")
            if tuple(header.get("tokens", ())) != token_ids:
                raise ValueError("its tokens differ (a hash collision)")
            if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("blake2b"):
                raise ValueError("checksum mismatch")
            dtype = getattr(torch, header["dtype"])
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header["shape"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, json.JSONDecodeError) as e:
            self.stats.rejected_files += 1
            log.warning("KV tier: ignoring %s (%s)", path.name, e)
            self._forget(block_hash)
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            if block_hash in self.disk:
                self.disk.move_to_end(block_hash)
        try:
            os.utime(path)  # recency survives a restart through the file's mtime
        except OSError:
            pass
        return data

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            size = self.disk.pop(block_hash, None)
            if size is not None:
                self.disk_used -= size

    def _scan(self) -> None:
        """Index the files a previous engine left (oldest first); drop leftovers of cut writes."""
        files = []
        for path in self.dir.iterdir():
            if path.suffix != SUFFIX:
                if ".tmp" in path.suffix:
                    path.unlink(missing_ok=True)
                continue
            try:
                st = path.stat()
                files.append((st.st_mtime, int(path.stem, 16), st.st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(files):
            if h >= 1 << 63:  # stored as unsigned hex; the chain's keys are signed Python hashes
                h -= 1 << 64
            self.disk[h] = size
            self.disk_used += size
        if files:
            log.info("KV tier: %d blocks (%.1f MB) on disk in %s", len(files), self.disk_used / 1e6, self.dir)

    def flush(self) -> None:
        """Wait for queued disk writes (tests, and a clean shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()


class KVOffload:
    """Connects the block manager to the tier: copies a block's KV out of the runner's pool
    when it is evicted and back into a pool block when a lookup hits the tier."""

    def __init__(self, tier: KVTier, runner):
        self.tier = tier
        self.runner = runner

    def save(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        out = self.tier.spare_buffer()
        self.tier.put(block_hash, token_ids, self.runner.read_block(block_id, out))

    def has(self, block_hash: int) -> bool:
        return self.tier.has(block_hash)

    def restore(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> str | None:
        """Load the block into pool slot ``block_id``; its source, or None on a miss."""
        hit = self.tier.get(block_hash, token_ids)
        if hit is None:
            return None
        data, source = hit
        self.runner.write_block(block_id, data)
        return source
