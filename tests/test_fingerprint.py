"""stapo.common.fingerprint: content digests that follow bytes, not paths."""
from __future__ import annotations

import hashlib
import json

from stapo.common import fingerprint as fp


def test_file_sha256_is_the_sha256_of_the_bytes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"abc")
    # FIPS 180-2's first example: SHA-256("abc")
    assert fp.file_sha256(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_big_files_are_cached_by_size_mtime_and_inode(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fp, "_CACHE_MIN_BYTES", 4)
    f = tmp_path / "w.bin"
    f.write_bytes(b"12345678")
    first = fp.file_sha256(f)
    assert first == hashlib.sha256(b"12345678").hexdigest()
    cache = json.loads((tmp_path / "cache" / "digests.json").read_text())
    assert list(cache.values()) == [first]
    f.write_bytes(b"87654321")  # same size, new mtime: re-hashed, not read from the cache
    assert fp.file_sha256(f) == hashlib.sha256(b"87654321").hexdigest()


def test_model_digest_follows_content_not_the_path(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 8}')
    (a / "model.safetensors").write_bytes(b"\x00" * 32)
    (a / "optimizer.pt").write_bytes(b"state")  # not the model's content
    (a / "README.md").write_text("notes")
    b = tmp_path / "b"
    b.mkdir()
    for name in ("config.json", "model.safetensors"):
        (b / name).write_bytes((a / name).read_bytes())
    assert fp.model_digest(a) == fp.model_digest(b)  # a copy elsewhere: the same model
    (b / "config.json").write_text('{"hidden_size": 16}')
    assert fp.model_digest(a) != fp.model_digest(b)
    assert fp.model_digest("Qwen/Qwen3-1.7B-Base") == "id:Qwen/Qwen3-1.7B-Base"  # not a local path


def test_differences_names_changed_and_missing_parts(tmp_path):
    old = {"config": "1", "model": "m", "machine": "cpu:x:avx2"}
    new = {"config": "1", "model": "n", "data": "d"}
    assert fp.differences(old, new) == ["data", "machine", "model"]
    fp.write_fingerprint(tmp_path, new)
    assert fp.read_fingerprint(tmp_path) == new
    assert fp.read_fingerprint(tmp_path / "nowhere") is None
    assert fp.json_digest({"b": 1, "a": [1, 2]}) == hashlib.sha256(b'{"a":[1,2],"b":1}').hexdigest()


def test_an_in_place_rewrite_with_its_mtime_restored_is_hashed_again(tmp_path, monkeypatch):
    """Same size, inode and restored mtime (touch -r): the change time still differs, so the cache misses."""
    import os
    import time

    monkeypatch.setenv("STAPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fp, "_CACHE_MIN_BYTES", 4)
    f = tmp_path / "w.bin"
    f.write_bytes(b"12345678")
    st = f.stat()
    assert fp.file_sha256(f) == hashlib.sha256(b"12345678").hexdigest()
    time.sleep(0.01)
    with open(f, "r+b") as h:  # in place: same inode and size
        h.write(b"87654321")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back
    assert fp.file_sha256(f) == hashlib.sha256(b"87654321").hexdigest()


def test_the_model_digest_covers_sentencepiece_and_bpe_tokenizer_files(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "tokenizer.model").write_bytes(b"sp1")
    before = fp.model_digest(a)
    (a / "tokenizer.model").write_bytes(b"sp2")
    assert fp.model_digest(a) != before
