"""A local tier's fault stays local (issue 31, item 2), on a real SeaweedFS server (127.0.0.1).

Bytes flipped in the ``--cache-dir`` tier's copy of an entry, the S3 object intact: ``verify``
names the tier's copy as the bad one and exits 0; ``gc --corrupt`` drops the tier's copy and never
the S3 object or its context record; ``sample`` reads the remote's copy (a hit, not a recompute)
and refills the tier. A bad S3 object is still reported as the remote's, exit 1."""

from __future__ import annotations

import json

from helpers.cli import build_argv, read_predictions, run_main, write_dataset
from helpers.s3 import BUCKET
from kvstore.store.backends.lmdb import LMDBBackend
from kvstore.store.backends.s3_names import object_name
from kvstore.store.kvstore import KVStore

F64 = ("--dtype", "float64", "--batch-size", "1")


def _flip(raw: bytes, pos: int = -20) -> bytes:
    out = bytearray(raw)
    out[pos] ^= 0xFF
    return bytes(out)


def damage_tier_copy(cache_dir, key: str) -> None:
    """Flip a byte of the tier's copy of entry ``key`` (tier layout: ``v/`` + the backend key)."""
    name = b"v/e/" + key.encode()
    with LMDBBackend(cache_dir) as tier:
        tier.put(name, _flip(tier.get(name)))


def tier_copy_intact(cache_dir, key: str) -> bool | None:
    from kvstore.errors import CorruptEntryError
    from kvstore.store.entry import decode_entry

    with LMDBBackend(cache_dir) as tier:
        raw = tier.get(b"v/e/" + key.encode())
    if raw is None:
        return None
    try:
        decode_entry(raw, key=key)
    except CorruptEntryError:
        return False
    return True


def s3_name(url: str, key: str) -> str:
    """The S3 object name of entry ``key`` in the store ``url``."""
    return f"{url[len(f's3://{BUCKET}/') :]}/{object_name(b'e/' + key.encode())}"


def s3_object(seaweed, url: str, key: str) -> bytes:
    return seaweed.client().get_object(Bucket=BUCKET, Key=s3_name(url, key))["Body"].read()


def test_a_tier_fault_stays_local(tiny_llama_dir, tmp_path, s3_url, capsys, seaweed):
    """One S3 store built through a tier (every entry cached there); then, in turn: verify, sample
    and gc --corrupt with a bad tier copy, and verify with a bad remote copy."""
    url, cache = s3_url, tmp_path / "tier"
    tier = ("--cache-dir", str(cache))
    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=1)
    code, _, err = run_main(capsys, *build_argv(data, tiny_llama_dir, url, *F64), *tier)
    assert code == 0, err
    with KVStore(url, readonly=True) as s:
        key = sorted(s.context_keys())[0]
    assert tier_copy_intact(cache, key) is True
    flipped = "entry checksum mismatch (flipped or truncated bytes)"

    # verify names the tier's copy as the bad one, and exits 0: the store (the remote) is intact
    damage_tier_copy(cache, key)
    code, out, err = run_main(capsys, "verify", "--store", url, *tier, "-q")
    assert code == 0, err
    assert f"corrupt  {key}  {flipped} (the local tier's copy; the remote's is intact)" in out
    assert "all intact in the remote store; 1 bad in the local tier" in out

    # sample reads the remote's copy (a hit, not a recompute) and refills the tier
    args = ["sample", data, "--model", tiny_llama_dir, *F64, "-n", "4", "--quiet", "--format", "json"]
    code, out, err = run_main(capsys, *args, "--store", url, *tier, "-o", tmp_path / "tier.jsonl")
    assert code == 0, err
    assert json.loads(out)["cache_hit_rate"] == 1.0
    assert err == f"kvstore: warning: the local tier's copy of entry {key[:16]} is corrupt ({flipped}); dropped it, " \
                  "reading the remote's\n"  # fmt: skip
    assert tier_copy_intact(cache, key) is True
    assert run_main(capsys, *args, "--no-cache", "-o", tmp_path / "ref.jsonl")[0] == 0
    got, ref = read_predictions(tmp_path / "tier.jsonl"), read_predictions(tmp_path / "ref.jsonl")
    assert {k: r["raw_output"] for k, r in got.items()} == {k: r["raw_output"] for k, r in ref.items()}

    # gc --corrupt drops the tier's copy, never the intact S3 object or its context record
    damage_tier_copy(cache, key)
    remote_before = s3_object(seaweed, url, key)
    code, out, err = run_main(capsys, "gc", "--corrupt", "--store", url, *tier, "-y", "-q")
    assert code == 0, err
    assert "0 contexts and 0 entries to remove" in out and "1 bad tier copy to drop from the local tier" in out
    assert "Dropped 1 bad tier copy; the remote's copies are intact." in out
    assert s3_object(seaweed, url, key) == remote_before
    with KVStore(url, readonly=True) as s:
        assert key in s.context_keys() and len(s.context_keys()) == 3
    assert tier_copy_intact(cache, key) is None
    code, out, _ = run_main(capsys, "verify", "--store", url, *tier, "-q")
    assert code == 0 and out.strip().endswith("verified, all intact.")

    # a bad remote copy is the store's fault: exit 1, named as the remote's
    run_main(capsys, "sample", data, "--model", tiny_llama_dir, *F64, "-n", "1", "--store", url, *tier, "-q")
    damage_tier_copy(cache, key)
    seaweed.client().put_object(Bucket=BUCKET, Key=s3_name(url, key), Body=_flip(remote_before))
    code, out, err = run_main(capsys, "verify", "--store", url, *tier, "-q")
    assert code == 1 and "1 of" in err and "corrupt" in err
    assert f"corrupt  {key}  {flipped} (the remote's copy)" in out
    assert f"corrupt  {key}  {flipped} (the local tier's copy; the remote's is corrupt too)" in out
