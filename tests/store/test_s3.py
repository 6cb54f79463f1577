"""The S3 backend's own promises, against a real SeaweedFS server on 127.0.0.1 (the contract suite
in test_backends.py covers what every backend does): object names, paged listings, multipart and
conditional puts, loads that never mix versions, one-line errors in bounded time, a server killed
mid-write, and the local tier (bounded, answering while the server is down)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures
from dataclasses import replace

import pytest
import torch

from helpers.s3 import BUCKET
from helpers.seaweed import READER, free_ports
from kvstore.errors import (
    ReadOnlyStoreError,
    StoreAccessError,
    StoreError,
    StoreNotFoundError,
    StoreOfflineWarning,
    StoreUnavailableError,
)
from kvstore.store.backends import open_backend
from kvstore.store.backends.s3 import S3Backend, S3Options, backend_key, object_name, parse_url
from kvstore.store.backends.tiered import TieredBackend

MiB = 1 << 20
HEX = "ab" * 32


def _names(server, url: str) -> list[str]:
    bucket, root = parse_url(url)
    listing = server.client().list_objects_v2(Bucket=bucket, Prefix=root)
    return sorted(o["Key"][len(root) :] for o in listing.get("Contents", []))


@pytest.fixture
def be(s3_url):
    b = S3Backend(s3_url, part_size=1 * MiB, threads=4, multipart_threshold=6 * MiB, page_size=3)
    yield b
    b.close()


# -- names ----------------------------------------------------------------------------------------
def test_urls():
    assert parse_url("s3://b") == ("b", "")
    assert parse_url("s3://b/") == ("b", "")
    assert parse_url("s3://b/p/q/") == ("b", "p/q/")
    assert parse_url("s3://b//p//q") == ("b", "p/q/")
    for bad in ("s3://", "s3:///p", "lmdb://x"):
        with pytest.raises(StoreError):
            parse_url(bad)


def test_object_names_round_trip():
    cases = {
        f"e/{HEX}".encode(): f"e/ab/{HEX}",
        b"r/0f1e": "r/0f/0f1e",
        b"meta": "meta",
        b"e/b": "e%2Fb",
        b"e/ABCD": "e%2FABCD",
        b"\x00\xff": "%00%FF",
        b"a/x/y": "a%2Fx%2Fy",
    }
    for key, name in cases.items():
        assert object_name(key) == name
        assert backend_key(name) == key
    assert backend_key("e/cd/ab12") is None  # not a name any key maps to (foreign object)
    assert backend_key("x/y") is None


def test_object_layout(be, seaweed, s3_url):
    be.put(f"e/{HEX}".encode(), b"1")
    be.put(f"a/{HEX}".encode(), b"2")
    be.put(b"meta", b"3")
    assert _names(seaweed, s3_url) == [f"a/ab/{HEX}", f"e/ab/{HEX}", "meta"]
    with S3Backend(s3_url + "/") as same:  # a trailing slash changes nothing
        assert same.url == s3_url and same.get(b"meta") == b"3"


def test_paged_listing_and_prefixes(be):
    keys = [f"e/{i:02x}{i:06d}".encode() for i in range(20)] + [b"a/00112233", b"meta", b"e/plain"]
    be.put_many((k, b"v") for k in keys)
    assert list(be.keys(b"e/")) == sorted(k for k in keys if k.startswith(b"e/"))  # 3 per page
    assert list(be.keys()) == sorted(keys)
    assert list(be.keys(b"e/0a")) == [b"e/0a000010"]
    assert list(be.keys(b"e/0")) == sorted(k for k in keys if k.startswith(b"e/0"))
    assert list(be.keys(b"e/p")) == [b"e/plain"]
    assert be.delete_many(keys[:5] + [b"e/nothere"]) == 5


def test_keys_ignore_foreign_objects(be, seaweed, s3_url):
    be.put(b"e/00ff", b"x")
    bucket, root = parse_url(s3_url)
    seaweed.client().put_object(Bucket=bucket, Key=root + "notes/readme.txt", Body=b"hi")
    assert list(be.keys()) == [b"e/00ff"]


# -- writes ---------------------------------------------------------------------------------------
def test_multipart_and_conditional_puts(be):
    v1, v2 = os.urandom(7 * MiB + 1), os.urandom(7 * MiB)  # above multipart_threshold
    key = f"e/{HEX}".encode()
    assert be.put_if_absent(key, v1) is True
    assert be.put_if_absent(key, v2) is False  # 412 on CompleteMultipartUpload
    assert be.get(key) == v1
    be.put(key, memoryview(v2))  # a plain put replaces
    assert be.get(key) == v2
    assert be.client.list_multipart_uploads(Bucket=be.bucket).get("Uploads", []) == []


def test_read_only_identity_cannot_write(s3_url, monkeypatch):
    with S3Backend(s3_url) as w:
        w.put(b"meta", b"m")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READER[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READER[1])
    with S3Backend(s3_url) as r:
        assert r.get(b"meta") == b"m"  # reading is allowed
        for write in (lambda: r.put(b"meta", b"x"), lambda: r.put_if_absent(b"e/00aa", b"x")):
            with pytest.raises(ReadOnlyStoreError, match="no permission to write"):
                write()


# -- loads ----------------------------------------------------------------------------------------
def test_load_is_one_buffer_filled_in_parts(be):
    v = os.urandom(5 * MiB + 123)
    be.put(b"e/1234", v)
    with be.view(b"e/1234") as buf:
        assert isinstance(buf, memoryview) and not buf.readonly and buf == v


def test_replaced_during_load_is_never_mixed(be, monkeypatch):
    old, new = os.urandom(4 * MiB), os.urandom(4 * MiB)
    be.put(b"e/5678", old)
    real, fired = S3Backend._part, []

    def part(self, name, etag, buf, start, end):
        if not fired:  # the first part has been answered; another writer replaces the object
            fired.append(1)
            be.put(b"e/5678", new)
        return real(self, name, etag, buf, start, end)

    monkeypatch.setattr(S3Backend, "_part", part)
    # without If-Match the other parts would bring the new bytes after the old first part
    assert be.get(b"e/5678") == new  # 412: loaded again, the new version whole
    assert fired


def test_deleted_during_load_is_a_miss(be, monkeypatch):
    be.put(b"e/9abc", os.urandom(4 * MiB))
    real, fired = S3Backend._part, []

    def part(self, name, etag, buf, start, end):
        if not fired:
            fired.append(1)
            be.delete(b"e/9abc")
        return real(self, name, etag, buf, start, end)

    monkeypatch.setattr(S3Backend, "_part", part)
    with be.view(b"e/9abc") as buf:
        assert buf is None
    assert fired


def test_prefetched_values_are_taken_by_later_loads(be, s3_url):
    """prefetch loads in the background and the next view takes that value: removing the objects
    behind the backend's back (another client) after the prefetch still serves them, once. A
    put or delete through the backend forgets the prefetched value; missing keys stay misses."""
    vals = {b"e/%04d" % i: os.urandom(3 * MiB + i) for i in range(3)}
    for k, v in vals.items():
        be.put(k, v)
    be.prefetch([*vals, b"e/none"])
    with be._ahead_lock:
        pending = list(be._ahead.values())
    futures.wait(pending)
    other = S3Backend(s3_url)
    try:
        other.delete_many(list(vals))
    finally:
        other.close()
    first, second, third = vals
    with be.view(first) as buf:
        assert buf == vals[first]  # the prefetched copy
    assert be.get(second) == vals[second]
    be.delete(third)  # through this backend: the prefetched value is dropped
    for k in (first, third, b"e/none"):
        with be.view(k) as buf:
            assert buf is None  # taken once; after that the server answers (it no longer holds them)
    be.prefetch([first])  # unconsumed prefetches are released at close
    be.close()


def test_load_buffers_are_recycled(be):
    a, b = os.urandom(3 * MiB), os.urandom(2 * MiB)
    be.put(b"e/aaaa", a)
    be.put(b"e/bbbb", b)
    with be.view(b"e/aaaa") as first:
        assert first == a
        with be.view(b"e/bbbb") as second:  # a view in use is never lent twice
            assert second == b and first == a
    with be.view(b"e/bbbb") as again:  # a buffer back from the pool, the best fit
        assert again == b and len(again) == len(b)
        assert again.obj is second.obj
    with be.view(b"e/aaaa") as again:
        assert again == a and again.obj is first.obj


# -- errors: one line each, in bounded time -------------------------------------------------------
def _fails(fn, kind=StoreError, within: float = 10.0) -> str:
    t0 = time.monotonic()
    with pytest.raises(kind) as info:
        fn()
    assert time.monotonic() - t0 < within
    text = str(info.value)
    assert "\n" not in text and len(text) < 300, text
    return text


def test_tuning_keywords_are_the_options_fields():
    """``S3Backend(url, threads=4)`` replaces that field of its S3Options; a misspelt one is refused
    before any connection, naming the fields there are."""
    with pytest.raises(TypeError, match=r"\['thread'\].*known: part_size"):
        S3Backend("s3://bkt/kv", thread=4)
    assert replace(S3Options(), threads=4).threads == 4 and S3Options().first_part is None


def test_missing_bucket_and_missing_store(s3_env):
    assert "does not exist" in _fails(lambda: S3Backend("s3://no-such-bucket/kv"), StoreNotFoundError)
    assert "no store at" in _fails(lambda: S3Backend(f"s3://{BUCKET}/nothing-{uuid.uuid4().hex}", readonly=True))
    assert "no store at" in _fails(lambda: S3Backend(f"s3://{BUCKET}/nothing-{uuid.uuid4().hex}", create=False))


@pytest.mark.parametrize(
    "key,secret,words", [("nobody", "x" * 20, "does not know this access key"), (None, "wrong", "signature")]
)
def test_bad_credentials(s3_url, s3_env, monkeypatch, key, secret, words):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key or s3_env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert words in _fails(lambda: S3Backend(s3_url), StoreAccessError)


def test_no_credentials(s3_url, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "no AWS credentials" in _fails(lambda: S3Backend(s3_url), StoreAccessError)


def test_connection_refused(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    assert "cannot connect" in _fails(lambda: S3Backend("s3://bkt/kv"), StoreUnavailableError)


def test_endpoint_that_never_answers(s3_env, monkeypatch):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel accepts connections; nobody ever reads or answers
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        text = _fails(lambda: S3Backend("s3://bkt/kv", read_timeout=0.5, max_attempts=2), StoreUnavailableError)
    assert "did not answer within 0.5 s (2 tries)" in text


def test_profile_from_config_file(seaweed, s3_env, tmp_path, monkeypatch):
    config = tmp_path / "aws-config"
    config.write_text(
        f"[profile kvtest]\nendpoint_url = {seaweed.endpoint}\naws_access_key_id = {s3_env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {s3_env['AWS_SECRET_ACCESS_KEY']}\n"
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "kvtest")
    with S3Backend(f"s3://{BUCKET}/profile-{uuid.uuid4().hex[:8]}") as b:  # no region configured either
        b.put(b"meta", b"via a profile")
        assert b.get(b"meta") == b"via a profile"
    monkeypatch.setenv("AWS_PROFILE", "missing")
    assert "profile" in _fails(lambda: S3Backend(f"s3://{BUCKET}/x"))


def test_boto3_is_imported_only_for_s3_urls(tmp_path):
    code = (
        "import sys, kvstore; from kvstore.store.backends import open_backend; "
        f"open_backend({str(tmp_path / 's')!r}).close(); print('boto3' in sys.modules, 'botocore' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_without_boto3_the_message_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    assert "pip install 'kvstore[s3]'" in _fails(lambda: open_backend("s3://b/p"))


# -- a server that dies -----------------------------------------------------------------------------
def test_server_killed_mid_put_then_resume(private_seaweed, monkeypatch):
    server = private_seaweed
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    server.client().create_bucket(Bucket="resume")
    b = S3Backend("s3://resume/kv", read_timeout=5, max_attempts=2)
    b.put(b"e/d0ne", b"ok")
    big = os.urandom(48 * MiB)  # one PUT, cut by the kill
    threading.Timer(0.2, server.kill).start()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        b.put(b"e/ha1f", big)
    assert time.monotonic() - t0 < 60 and "\n" not in str(info.value)
    with pytest.raises(StoreUnavailableError):  # the next request fails at once, without new timeouts
        b.get(b"e/d0ne")
    b.close()
    server.start()  # same data, same ports
    with S3Backend("s3://resume/kv") as b:
        assert b.get(b"e/d0ne") == b"ok"
        assert b.get(b"e/ha1f") is None  # nothing half-written
        assert b.put_if_absent(b"e/ha1f", big) is True
        assert b.get(b"e/ha1f") == big


# -- the local tier ---------------------------------------------------------------------------------
def test_tier_stays_within_its_size_and_answers_offline(private_seaweed, tmp_path, monkeypatch):
    server = private_seaweed
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    server.client().create_bucket(Bucket="tier")
    url, cache = "s3://tier/kv", tmp_path / "cache"
    values = {f"e/{i:04x}".encode(): os.urandom(1 * MiB + i) for i in range(12)}
    budget = 5 * MiB
    with TieredBackend(url, cache, max_bytes=budget) as tier:
        tier.put(b"meta", b'{"format": 1}')
        tier.put_many(values.items())  # write-through
        for key in list(values)[:6]:  # read-through (some evicted, some not)
            assert tier.get(key) == values[key]
        held = tier.held()
        assert sum(size for _, size in held.values()) <= budget
        assert set(held) >= {b"meta", *list(values)[2:6]}  # the most recently used stay
        assert (cache / "data.mdb").stat().st_size <= budget + 4 * MiB
    server.kill()
    with pytest.warns(StoreOfflineWarning, match="answering from the local cache"):
        tier = TieredBackend(url, cache, max_bytes=budget, readonly=True)
    with tier:
        assert tier.get(b"meta") == b'{"format": 1}'
        for key in list(values)[2:6]:
            assert tier.get(key) == values[key]
        with pytest.raises(StoreUnavailableError):
            tier.get(list(values)[0])  # evicted: only the server has it
        with pytest.raises(StoreUnavailableError):
            list(tier.keys())
    with pytest.raises(StoreError, match="holds a tier of s3://tier/kv"):
        TieredBackend("s3://tier/other", cache, max_bytes=budget)


def test_entries_are_written_once_unless_different(s3_url, seaweed):
    from helpers.entries import kv_layers
    from kvstore.store.entry import Entry
    from kvstore.store.kvstore import KVStore

    key = "cd" * 32
    ids = torch.arange(5)
    layers = tuple(map(tuple, kv_layers(2, 2, 5, 8, extremes=False)))
    bucket, root = parse_url(s3_url)
    name = root + object_name(f"e/{key}".encode())

    def etag() -> str:
        return seaweed.client().head_object(Bucket=bucket, Key=name)["ETag"]

    with KVStore(s3_url) as kv:
        kv.put(Entry(key, "f" * 64, "tiny", ids, layers, created=1.0))
        first = etag()
        kv.put(Entry(key, "f" * 64, "tiny", ids, layers, created=2.0))  # the same cache again: a 412, kept
        assert etag() == first and kv.get(key).created == 1.0
        kv.put(Entry(key, "e" * 64, "other", ids, layers, created=3.0))  # another model's: replaced
        assert etag() != first and kv.get(key).model == "e" * 64
        kv.put(Entry(key, "e" * 64, "other", ids.flip(0), layers, created=4.0))  # other tokens: replaced
        assert kv.get(key).created == 4.0
