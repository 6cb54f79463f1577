"""The CLI on s3:// stores (a SeaweedFS server on 127.0.0.1): build then sample from S3, from LMDB
and without a cache give the same answers; every store command works on S3; sharded builds
running at once make exactly the entries of one build; a server killed mid-build is one clear
line and a re-run completes the rest; each way of failing to reach the store is one line; a
local tier stays within its size and answers while the server is down."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest
import torch

from helpers.cli import build_argv, context_keys, context_text, read_predictions, run_main, start_cli, write_dataset
from helpers.s3 import BUCKET
from helpers.seaweed import READER, free_ports
from kvstore.store.backends.tiered import TieredBackend
from kvstore.store.kvstore import KVStore

F64 = ("--dtype", "float64", "--batch-size", "1")  # float64: cached and reference answers agree exactly


def _ok(code: int, out: str, err: str) -> str:
    assert code == 0, err
    return out


def _one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("kvstore: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _sample(capsys, data, model, store, out, *extra):
    args = ["sample", data, "--model", model, *F64, "-n", "6", "--quiet", "--format", "json", "-o", out]
    return json.loads(_ok(*run_main(capsys, *args, *(["--store", store] if store else []), *extra)))


def test_build_and_sample_from_s3_match_lmdb_and_no_cache(tiny_llama_dir, tmp_path, s3_url, capsys):
    data = write_dataset(tmp_path / "qa.jsonl", range(5), questions=2)
    built = json.loads(_ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, s3_url, *F64))))
    assert (built["contexts"], built["built"], built["store"]) == (5, 5, s3_url)
    _ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, tmp_path / "lmdb", *F64)))
    s3 = _sample(capsys, data, tiny_llama_dir, s3_url, tmp_path / "s3.jsonl")
    lmdb = _sample(capsys, data, tiny_llama_dir, tmp_path / "lmdb", tmp_path / "lmdb.jsonl")
    ref = _sample(capsys, data, tiny_llama_dir, None, tmp_path / "ref.jsonl", "--no-cache")
    assert s3["cache_hit_rate"] == lmdb["cache_hit_rate"] == 1.0 and ref["cache_hit_rate"] == 0.0
    rows = {name: read_predictions(tmp_path / f"{name}.jsonl") for name in ("s3", "lmdb", "ref")}
    assert len(rows["s3"]) == 10
    raw = {name: {k: r["raw_output"] for k, r in got.items()} for name, got in rows.items()}
    assert raw["s3"] == raw["lmdb"] == raw["ref"]
    # the same entries, byte for byte apart from their creation time
    with KVStore(s3_url, readonly=True) as a, KVStore(str(tmp_path / "lmdb"), readonly=True) as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            ea, eb = a.get(key), b.get(key)
            assert all(
                torch.equal(x, y) for (ka, va), (kb, vb) in zip(ea.layers, eb.layers) for x, y in ((ka, kb), (va, vb))
            )


def test_store_commands_on_s3(tiny_llama_dir, tmp_path, s3_url, capsys):
    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=1)
    _ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, s3_url, *F64)))
    records = json.loads(_ok(*run_main(capsys, "ls", "--store", s3_url, "--format", "json")))
    assert len(records) == 3 and all(r["stored_bytes"] > 0 for r in records)
    with KVStore(s3_url, readonly=True) as store:
        chunks = len(store.keys())  # the contexts' chunks (a shared head is stored once)
    assert chunks >= 3
    stats = json.loads(_ok(*run_main(capsys, "stats", "--store", s3_url, "--format", "json")))
    assert stats["totals"]["entries"] == chunks and stats["totals"]["contexts"] == 3
    assert stats["totals"]["disk_bytes"] is None
    verified = _ok(*run_main(capsys, "verify", "--store", s3_url, "-q"))
    assert f"{chunks} entries and 3 contexts verified, all intact." in verified
    size = json.loads(_ok(*run_main(capsys, "size", "default", "--store", s3_url, "--format", "json")))
    assert sum(m["contexts"] for m in size["measured"]) == 3
    victim = records[0]["key"]
    assert "Removed 1 context" in _ok(*run_main(capsys, "rm", victim[:12], "--store", s3_url, "--yes"))
    assert "Removed 2 contexts" in _ok(
        *run_main(capsys, "gc", "--max-size", "1", "--grace", "0s", "--store", s3_url, "--yes")
    )
    assert json.loads(_ok(*run_main(capsys, "ls", "--store", s3_url, "--format", "json"))) == []
    with KVStore(s3_url, readonly=True) as store:
        assert store.keys() == []


def test_concurrent_shards_make_exactly_one_build(tiny_llama_dir, tmp_path, s3_url, s3_env, capsys):
    n = 12
    data = write_dataset(tmp_path / "qa.jsonl", range(n), questions=1)
    shards = [
        start_cli(build_argv(data, tiny_llama_dir, s3_url, *F64, "--shard", f"{i}/2"), tmp_path, name=f"shard{i}",
                  env=s3_env)
        for i in range(2)
    ]  # fmt: skip
    results = [json.loads(_ok(*p.wait(300))) for p in shards]
    assert sum(r["contexts"] for r in results) == n and all(r["contexts"] + r["other_shards"] == n for r in results)
    assert all(r["built"] == r["contexts"] for r in results) and {r["shard"] for r in results} == {"0/2", "1/2"}
    again = json.loads(_ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, s3_url, *F64, "--shard", "1/2"))))
    assert (again["built"], again["skipped"]) == (0, results[1]["contexts"])  # a re-run is idempotent
    whole = tmp_path / "whole"
    _ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, whole, *F64)))
    expected = set(context_keys(tiny_llama_dir, [context_text(i) for i in range(n)], dtype="float64").values())
    with KVStore(s3_url, readonly=True) as sharded, KVStore(str(whole), readonly=True) as one:
        assert set(sharded.context_keys()) == set(one.context_keys()) == expected
        assert set(sharded.keys()) == set(one.keys())  # the same chunks (a shared head once)
        info = sharded.verify()
        assert not info.corrupt and len(info.contexts) == n and len(info.entries) == len(one.keys())
        for key in one.keys():
            a, b = sharded.get(key), one.get(key)
            assert torch.equal(a.token_ids, b.token_ids)
            assert all(torch.equal(x, y) for la, lb in zip(a.layers, b.layers) for x, y in zip(la, lb))


def test_server_killed_mid_build_is_one_line_and_a_rerun_completes(
    tiny_llama_dir, tmp_path, private_seaweed, monkeypatch, capsys
):
    from kvstore.model.paths import dense

    server = private_seaweed
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    server.client().create_bucket(Bucket="builds")
    url, n = "s3://builds/kv", 8
    data = write_dataset(tmp_path / "qa.jsonl", range(n), questions=1)
    calls: list[int] = []

    def counted(real):
        def run(adapter, *args):
            calls.append(1)
            if len(calls) == 4:  # the fourth batch: once an entry is in, the object store dies
                client, deadline = server.client(), time.monotonic() + 30
                while not client.list_objects_v2(Bucket="builds", Prefix="kv/e/").get("KeyCount"):
                    assert time.monotonic() < deadline, "the writer stored nothing"
                    time.sleep(0.05)
                server.kill()
            return real(adapter, *args)

        return run

    # contexts are computed by a prefill, or on top of a stored prefix (a shared head) by extend
    real_prefill, real_extend = dense.prefill, dense.extend
    monkeypatch.setattr(dense, "prefill", counted(real_prefill))
    monkeypatch.setattr(dense, "extend", counted(real_extend))
    t0 = time.monotonic()
    code, _, err = run_main(capsys, *build_argv(data, tiny_llama_dir, url, *F64, "--batch-size", "1"))
    assert time.monotonic() - t0 < 60
    line = _one_line_error(code, err)
    assert "cannot connect" in line and "is intact: re-run" in line, line
    monkeypatch.setattr(dense, "prefill", real_prefill)
    monkeypatch.setattr(dense, "extend", real_extend)
    server.start()  # same data, same ports
    with KVStore(url, readonly=True) as kv:
        kept = kv.verify()
        # what was written before the kill is intact (chunks of up to three batches' contexts)
        assert not kept.corrupt and 1 <= len(kept.entries) and len(kept.contexts) <= 3
    again = json.loads(_ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, url, *F64))))
    assert again["skipped"] >= len(kept.contexts) and again["skipped"] + again["built"] == n
    with KVStore(url, readonly=True) as kv:
        done = kv.verify()
        assert len(done.contexts) == n and not done.corrupt


@pytest.fixture
def fast_timeouts(monkeypatch):
    from kvstore.store.backends import s3

    monkeypatch.setattr(s3, "READ_TIMEOUT", 0.5)
    monkeypatch.setattr(s3, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(s3, "MAX_ATTEMPTS", 2)


def test_each_failure_to_reach_the_store_is_one_line(
    tiny_llama_dir, tmp_path, s3_env, monkeypatch, capsys, fast_timeouts
):
    url = f"s3://{BUCKET}/errors-{uuid.uuid4().hex[:8]}"
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    _ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, url, *F64)))

    def fails(*args: str) -> str:
        t0 = time.monotonic()
        line = _one_line_error(*run_main(capsys, *args)[::2])
        assert time.monotonic() - t0 < 60
        return line

    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
        assert "cannot connect" in fails("stats", "--store", url)
    with socket.socket() as silent, monkeypatch.context() as m:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        m.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        assert "did not answer" in fails("ls", "--store", url)
    with monkeypatch.context() as m:
        m.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        assert "signature" in fails("verify", "--store", url)
    assert "does not exist" in fails("ls", "--store", "s3://no-such-bucket/kv")
    assert "no store at" in fails("ls", "--store", url + "-typo")
    with monkeypatch.context() as m:
        m.setenv("AWS_ACCESS_KEY_ID", READER[0])
        m.setenv("AWS_SECRET_ACCESS_KEY", READER[1])
        more = write_dataset(tmp_path / "more.jsonl", range(2, 4), questions=1)
        assert "no permission to write" in fails(*build_argv(more, tiny_llama_dir, url, *F64))
        # reading with read-only credentials works
        assert "and 2 contexts verified, all intact" in _ok(*run_main(capsys, "verify", "--store", url, "-q"))


def test_local_tier_is_bounded_and_answers_with_the_server_down(
    tiny_llama_dir, tmp_path, private_seaweed, monkeypatch, capsys
):
    server = private_seaweed
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    server.client().create_bucket(Bucket="tier")
    url, cache, n = "s3://tier/kv", tmp_path / "cache", 6
    data = write_dataset(tmp_path / "qa.jsonl", range(n), questions=2)
    tier = ("--cache-dir", str(cache))
    _ok(*run_main(capsys, *build_argv(data, tiny_llama_dir, url, *F64), *tier))
    with KVStore(url, readonly=True) as kv:
        sizes = sorted(e.stored_bytes for e in kv.scan().entries)
    budget = sum(sizes[:3]) + 4096  # room for about half of the entries
    # write-through under a budget, then read-through: the tier never holds more than the budget
    small = ("--cache-dir", str(tmp_path / "small"), "--cache-size", str(budget))
    _sample(capsys, data, tiny_llama_dir, url, tmp_path / "small.jsonl", *small)
    with TieredBackend(url, tmp_path / "small", max_bytes=budget, readonly=True) as t:
        held = t.held()
        assert sum(size for _, size in held.values()) <= budget
        assert 1 <= sum(k.startswith(b"e/") for k in held) < n
    before = _sample(capsys, data, tiny_llama_dir, url, tmp_path / "online.jsonl", *tier)
    server.kill()
    code, out, err = run_main(capsys, "sample", data, "--model", tiny_llama_dir, *F64, "-n", "6", "--quiet",
                              "--format", "json", "-o", tmp_path / "offline.jsonl", "--store", url, *tier,
                              "--readonly-store")  # fmt: skip
    assert code == 0, err
    assert "kvstore: warning:" in err and "answering from the local cache" in err
    offline = json.loads(out)
    assert offline["cache_hit_rate"] == before["cache_hit_rate"] == 1.0
    got, want = read_predictions(tmp_path / "offline.jsonl"), read_predictions(tmp_path / "online.jsonl")
    assert {k: r["raw_output"] for k, r in got.items()} == {k: r["raw_output"] for k, r in want.items()}
    code, _, err = run_main(capsys, "ls", "--store", url, *tier)  # a listing needs the server
    warning, error = err.strip().splitlines()
    assert code == 1 and "answering from the local cache" in warning
    assert error.startswith("kvstore: error: cannot connect")
