"""KVStore over every backend: entries in and out, the store's own description surviving a
restart, corruption reported (never raised) on the lookup path, last-access times, the
DynamicCache helper proven against a real (tiny) transformers model, and gc planning."""

from __future__ import annotations

import json
import time
import uuid
import warnings

import pytest
import torch

from kvstore.errors import (
    CorruptEntryError,
    CorruptEntryWarning,
    EntryNotFoundError,
    FormatVersionError,
    KVStoreError,
    ReadOnlyStoreError,
    StoreNotFoundError,
)
from kvstore.store.codecs import DEFAULT_CODEC
from kvstore.store.entry import Entry
from kvstore.store.gc import GcOptions, plan_gc
from kvstore.store.header import STORE_FORMAT, EntryHeader, LayerSpec
from kvstore.store.infos import context_of
from kvstore.store.keys import cache_key, chain_keys, chain_seed
from kvstore.store.kvstore import KVStore
from kvstore.store.removal import execute_plan
from kvstore.store.scan import CorruptInfo, EntryInfo, StoreAbout, StoreInfo

FP_A = "a" * 64
FP_B = "b" * 64


def make_entry(n_tokens=6, *, fp=FP_A, name="tiny", dtype=torch.float32, n_layers=2, kv_heads=2, head_dim=4,
               seed=0, created=1700000000.0) -> Entry:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (n_tokens,), generator=g)
    layers = tuple(
        (
            torch.randn(kv_heads, n_tokens, head_dim, generator=g).to(dtype),
            torch.randn(kv_heads, n_tokens, head_dim, generator=g).to(dtype),
        )
        for _ in range(n_layers)
    )
    [key] = chain_keys(chain_seed(fp, dtype, device="cpu", attn="sdpa"), ids.tolist(), [(0, n_tokens)])
    return Entry(key, fp, name, ids, layers, created)


def same(a: Entry, b: Entry) -> bool:
    return (
        (a.key, a.model, a.model_name, a.created) == (b.key, b.model, b.model_name, b.created)
        and torch.equal(a.token_ids, b.token_ids)
        and len(a.layers) == len(b.layers)
        and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a.layers, b.layers))
    )


@pytest.fixture(params=["lmdb", "memory"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "store") if request.param == "lmdb" else f"memory://store-{uuid.uuid4().hex}"


def flip(store: KVStore, key: str, pos: int) -> None:
    """Damage one stored byte below the codec, as a bad disk would (``pos`` < 0 counts from the end)."""
    raw = bytearray(store.backend.get(b"e/" + key.encode()))
    raw[pos] ^= 0x10
    store.backend.put(b"e/" + key.encode(), bytes(raw))


# -- entries --------------------------------------------------------------------------------------
def test_put_get_contains_delete_keys(url):
    a, b = make_entry(seed=1), make_entry(9, seed=2, dtype=torch.bfloat16, fp=FP_B, name="other")
    with KVStore(url) as s:
        assert len(s) == 0 and s.get(a.key) is None and a.key not in s
        assert s.put(a) > 0
        s.put(b, codec="raw")
        assert a.key in s and s.contains(b.key)
        assert sorted(s.keys()) == sorted([a.key, b.key]) and len(s) == 2
        assert same(s.get(a.key), a) and same(s[b.key], b)
        assert s.get(b.key).dtype == torch.bfloat16 and s.get(b.key).n_tokens == 9
        assert s.header(b.key).codec_spec == "raw" and s.header(a.key).codec_spec == DEFAULT_CODEC
        assert s.delete(a.key) is True and s.delete(a.key) is False
        assert s.get(a.key, "missing") == "missing"
        assert s.keys() == [b.key]
        assert s.delete_many([b.key, a.key]) == 1 and len(s) == 0


def test_open_entry_is_verified_and_zero_copy(url):
    e = make_entry(seed=3)
    with KVStore(url, codec="raw") as s:
        s.put(e)
        with s.open_entry(e.key) as view:
            assert view.header.n_tokens == 6
            k, v = view.layer(1)
            dest = torch.empty(2, 6, 4)
            v.copy_into(dest)
            assert torch.equal(dest, e.layers[1][1])
            assert same(view.materialize(), e)
        with s.open_entry("0" * 64) as view:
            assert view is None


def test_readonly_store(url):
    e = make_entry()
    with KVStore(url) as s:
        s.put(e)
    with KVStore(url, readonly=True) as r:
        assert same(r.get(e.key), e)
        with pytest.raises(ReadOnlyStoreError):
            r.put(make_entry(seed=5))
        with pytest.raises(ReadOnlyStoreError):
            r.delete(e.key)


def test_missing_store_readonly(tmp_path):
    with pytest.raises(StoreNotFoundError):
        KVStore(str(tmp_path / "none"), readonly=True)
    assert not (tmp_path / "none").exists()


def test_default_store_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_STORE", str(tmp_path / "env-store"))
    with KVStore() as s:
        assert s.url == str(tmp_path / "env-store")
    assert (tmp_path / "env-store" / "data.mdb").exists()


# -- the store describes itself ---------------------------------------------------------------------
def test_reopen_keeps_entries_and_meta(url):
    entries = [make_entry(5 + i, seed=i) for i in range(3)]
    with KVStore(url, codec="zstd:5") as s:
        for e in entries:
            s.put(e)
        meta = s.meta
    assert meta.format == STORE_FORMAT and meta.codec == "zstd:5" and meta.chunk_tokens == 512
    with KVStore(url) as s:  # a restart: nothing but the store itself says how it was made
        assert s.meta == meta
        assert s.codec.spec == "zstd:5"
        assert s.format == STORE_FORMAT
        assert all(same(s.get(e.key), e) for e in entries)
        s.put(make_entry(seed=7))
        assert s.header(make_entry(seed=7).key).codec_spec == "zstd:5"
    with KVStore(url, codec="raw") as s:  # overriding the codec for a session does not rewrite the store
        assert s.codec.spec == "raw" and s.meta.codec == "zstd:5"


def test_future_store_format_is_refused(url):
    with KVStore(url) as s:
        s.put(make_entry())
        s.backend.put(b"meta", json.dumps({"format": STORE_FORMAT + 1, "codec": "raw", "created": 0}).encode())
    for readonly in (False, True):
        with pytest.raises(FormatVersionError, match="upgrade kvstore"):
            KVStore(url, readonly=readonly)
    with KVStore(url + "-unused" if "://" in url else url + "2") as fresh:  # unrelated stores still open
        assert len(fresh) == 0


def test_unreadable_meta(url):
    with KVStore(url) as s:
        s.backend.put(b"meta", b"\xff not json")
    with pytest.raises(KVStoreError, match="description"):
        KVStore(url)


# -- corruption -------------------------------------------------------------------------------------
def test_corrupt_entry_is_a_miss_with_a_warning(url):
    good, bad = make_entry(seed=1), make_entry(seed=2)
    with KVStore(url) as s:
        s.put(good)
        s.put(bad)
        flip(s, bad.key, -20)
        with pytest.warns(CorruptEntryWarning, match=bad.key[:16]):
            assert s.get(bad.key) is None
        with pytest.warns(CorruptEntryWarning):
            with s.open_entry(bad.key) as view:
                assert view is None
        with pytest.raises(CorruptEntryError):
            s[bad.key]
        with pytest.raises(EntryNotFoundError):
            s["0" * 64]
        with pytest.raises(KeyError):  # EntryNotFoundError is a KeyError too
            s["0" * 64]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert same(s.get(good.key), good)  # the rest of the store is untouched
        assert bad.key in s  # reported, never deleted behind the user's back


def test_entry_under_the_wrong_key(url):
    a, b = make_entry(seed=1), make_entry(seed=2)
    with KVStore(url) as s:
        s.put(a)
        s.put_bytes(b.key, s.encode(a))  # a's bytes stored under b's key
        with pytest.warns(CorruptEntryWarning):
            assert s.get(b.key) is None
        info = s.scan()
        assert [c.key for c in info.corrupt] == [b.key] and [e.key for e in info.entries] == [a.key]


def test_scan_and_verify(url):
    entries = [make_entry(6, seed=i, created=1700000000.0 + i) for i in range(4)]
    with KVStore(url) as s:
        for e in entries:
            s.put(e)
            s.put_context(e.key, [e.key], e.n_tokens)
        clean = s.scan()
        assert clean.n_entries == 4 and not clean.corrupt and not clean.verified
        assert clean.n_tokens == 24 and clean.stored_bytes == sum(e.stored_bytes for e in clean.entries)
        info = next(e for e in clean.entries if e.key == entries[0].key)
        assert (info.model, info.model_name, info.dtype, info.n_layers, info.header.kv_heads, info.header.head_dim) == (
            FP_A,
            "tiny",
            "float32",
            2,
            2,
            4,
        )
        assert (
            info.raw_bytes > 0 and 0 < info.ratio < 2 and info.size_str.endswith("KiB") and info.created == 1700000000.0
        )
        flip(s, entries[1].key, -20)  # payload: only a full check can see it
        flip(s, entries[2].key, 30)  # inside the header JSON: even a listing sees it
        headers_only = s.scan()
        assert {c.key for c in headers_only.corrupt} == {entries[2].key}
        assert headers_only.n_entries == 3
        calls = []
        full = s.verify(progress=lambda done, total: calls.append((done, total)))
        assert full.verified
        assert {c.key for c in full.corrupt} == {entries[1].key, entries[2].key}
        assert {e.key for e in full.entries} == {entries[0].key, entries[3].key}
        assert len(calls) == 4 and all(items == 1 for items, _ in calls)  # one call per entry, with its size
        assert sum(n for _, n in calls) == sum(e.stored_bytes for e in full.entries) + sum(
            c.stored_bytes for c in full.corrupt
        )
        assert all(c.reason and c.stored_bytes > 0 for c in full.corrupt)
        assert s.scan(verify=True).corrupt == full.corrupt


def test_last_access_is_recorded_on_close(tmp_path):
    url = str(tmp_path / "s")
    read, unread = make_entry(seed=1), make_entry(seed=2)
    with KVStore(url) as s:
        s.put(read)
        s.put(unread)
    t0 = time.time()
    with KVStore(url) as s:
        s.get(read.key)
        assert s.scan().entries  # visible before close too (from memory)
    with KVStore(url, readonly=True) as s:
        by_key = {e.key: e for e in s.scan().entries}
    assert by_key[read.key].last_access is not None and by_key[read.key].last_access >= t0 - 1
    assert by_key[read.key].last_used == by_key[read.key].last_access
    assert by_key[unread.key].last_access is None and by_key[unread.key].last_used == unread.created
    with KVStore(url, readonly=True) as s:  # a read-only reader records nothing
        s.get(unread.key)
    with KVStore(url) as s:
        assert {e.key: e for e in s.scan().entries}[unread.key].last_access is None
        s.delete(read.key)
        assert s.backend.get(b"a/" + read.key.encode()) is None  # no orphaned access record


# -- the DynamicCache helper -----------------------------------------------------------------------
def test_to_dynamic_cache_shape():
    e = make_entry(7, kv_heads=3, head_dim=5, n_layers=4, dtype=torch.float16)
    cache = e.to_dynamic_cache()
    assert cache.get_seq_length() == 7 and len(cache.layers) == 4
    assert tuple(cache.layers[2].keys.shape) == (1, 3, 7, 5) and cache.layers[2].values.dtype == torch.float16
    assert torch.equal(cache.layers[3].values[0], e.layers[3][1])


@pytest.fixture(scope="module")
def llama_fp64():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=128,
        initializer_range=0.3,  # default init attends near-uniformly and would hide position bugs
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def test_stored_cache_continues_like_a_full_forward(llama_fp64, tmp_path):
    model = llama_fp64
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, 100, (1, 20), generator=g)
    question = torch.randint(0, 100, (1, 6), generator=g)
    with torch.no_grad():
        cache = model(context, use_cache=True).past_key_values
        layers = tuple((layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers)
        entry = Entry(cache_key(FP_A, torch.float64, context[0]), FP_A, "tiny-llama", context[0], layers)
        with KVStore(str(tmp_path / "s")) as s:
            s.put(entry)
        with KVStore(str(tmp_path / "s"), readonly=True) as s:  # a restart in between
            stored = s.get(entry.key)
        full = model(torch.cat([context, question], dim=1)).logits[0, -1]
        resumed = model(question, past_key_values=stored.to_dynamic_cache()).logits[0, -1]
        assert torch.allclose(resumed, full, rtol=0, atol=1e-10)
        # the check can fail: the same tokens cached at shifted positions move the logits
        shifted = model(context, position_ids=torch.arange(3, 23)[None], use_cache=True).past_key_values
        wrong = model(question, past_key_values=shifted).logits[0, -1]
        assert (wrong - full).abs().max() > 1e-3


# -- gc planning -----------------------------------------------------------------------------------
NOW = 1_800_000_000.0
DAY = 86400.0


def info_of(*entries: EntryInfo, corrupt: tuple[CorruptInfo, ...] = ()) -> StoreInfo:
    """A scan of a store whose every entry is a one-chunk context."""
    by_key = {e.key: e for e in entries}
    access = {e.key: e.last_access for e in entries if e.last_access is not None}
    contexts = tuple(context_of(e.key, (e.key,), e.n_tokens, e.created, by_key, access) for e in entries)
    return StoreInfo(StoreAbout("memory://plan", STORE_FORMAT, "zstd-shuffle:1", chunk_tokens=256), tuple(entries),
                     corrupt, contexts)  # fmt: skip


def ei(key: str, *, model=FP_A, name="tiny", size=100, used_days_ago=None, created_days_ago=100.0) -> EntryInfo:
    header = EntryHeader(
        key=key, model=model, model_name=name, dtype="float32", n_tokens=10, layers=(LayerSpec("attn", 10, 2, 4),) * 2,
        codec={"name": "raw"}, raw_bytes=size, created=NOW - created_days_ago * DAY,
    )  # fmt: skip
    return EntryInfo(header, size, None if used_days_ago is None else NOW - used_days_ago * DAY)


def removed(plan) -> set[str]:
    return {k for k, _, _ in plan.remove}


@pytest.fixture
def sample_info() -> StoreInfo:
    return info_of(
        ei("aa01", size=100, used_days_ago=1),
        ei("aa02", size=200, used_days_ago=40),
        ei("bb01", model=FP_B, name="other", size=300, used_days_ago=5),
        ei("bb02", model=FP_B, name="other", size=400),  # never read: created 100 days ago
        ei("cc01", size=500, used_days_ago=10),
        corrupt=(CorruptInfo("dd01", "entry checksum mismatch", 50),),
    )


def test_plan_nothing(sample_info):
    plan = plan_gc(sample_info, now=NOW)
    assert plan.n == 0 and plan.freed_bytes == 0 and plan.keep_bytes == 1500
    assert removed(plan_gc(sample_info, GcOptions(orphans=True), now=NOW)) == set()  # every chunk is used


def test_plan_corrupt(sample_info):
    plan = plan_gc(sample_info, GcOptions(corrupt=True), now=NOW)
    assert plan.remove == (("dd01", "corrupt: entry checksum mismatch", 50),)
    assert plan.keep_bytes == 1500


def test_plan_by_model(sample_info):
    assert removed(plan_gc(sample_info, GcOptions(model="other"), now=NOW)) == {"bb01", "bb02"}
    assert removed(plan_gc(sample_info, GcOptions(model="bbbb"), now=NOW)) == {"bb01", "bb02"}  # fingerprint prefix
    assert removed(plan_gc(sample_info, GcOptions(model="nope"), now=NOW)) == set()
    assert plan_gc(sample_info, GcOptions(model="other"), now=NOW).freed_bytes == 700


def test_plan_by_age(sample_info):
    plan = plan_gc(sample_info, GcOptions(older_than=30 * DAY), now=NOW)
    assert removed(plan) == {"aa02", "bb02"}  # last used 40 days ago; never used, created 100 days ago
    assert all("unused for" in why for _, why, _ in plan.remove)
    assert removed(plan_gc(sample_info, GcOptions(older_than=7 * DAY), now=NOW)) == {"aa02", "bb02", "cc01"}


def test_plan_size_budget_least_recently_used_first(sample_info):
    plan = plan_gc(sample_info, GcOptions(max_bytes=1000), now=NOW)
    assert [k for k, _, _ in plan.remove] == ["bb02", "aa02"]  # LRU order: 100 days, then 40
    assert [k for k, _, _ in plan.contexts] == ["bb02", "aa02"]
    assert plan.keep_bytes == 900 <= 1000
    assert removed(plan_gc(sample_info, GcOptions(max_bytes=1500), now=NOW)) == set()
    assert [k for k, _, _ in plan_gc(sample_info, GcOptions(max_bytes=0), now=NOW).remove] == [
        "bb02",
        "aa02",
        "cc01",
        "bb01",
        "aa01",
    ]
    # the criteria add up
    plan = plan_gc(sample_info, GcOptions(max_bytes=1100, older_than=30 * DAY, corrupt=True), now=NOW)
    assert removed(plan) == {"dd01", "aa02", "bb02"} and plan.keep_bytes == 900


def test_plan_model_narrows_the_other_criteria(sample_info):
    # "remove other's old entries", not "remove other's entries and everyone's old ones"
    assert removed(plan_gc(sample_info, GcOptions(model="other", older_than=30 * DAY), now=NOW)) == {"bb02"}
    # a budget for one model: only its entries are candidates, and only they must fit
    assert removed(plan_gc(sample_info, GcOptions(model="tiny", max_bytes=600), now=NOW)) == {"aa02"}
    # a corrupt entry's model is unknown: --corrupt is not narrowed by model
    assert removed(plan_gc(sample_info, GcOptions(model="other", corrupt=True), now=NOW)) == {"dd01"}


def test_plan_by_keys(sample_info):
    assert removed(plan_gc(sample_info, GcOptions(keys=["aa"]), now=NOW)) == {"aa01", "aa02"}
    assert removed(plan_gc(sample_info, GcOptions(keys=["aa01", "cc"]), now=NOW)) == {"aa01", "cc01"}
    assert removed(plan_gc(sample_info, GcOptions(keys=["dd"]), now=NOW)) == {"dd01"}  # corrupt entries by key
    assert removed(plan_gc(sample_info, GcOptions(keys=["aa"], older_than=30 * DAY), now=NOW)) == {"aa02"}
    assert removed(plan_gc(sample_info, GcOptions(keys=["aa"], model="other"), now=NOW)) == set()
    with pytest.raises(EntryNotFoundError, match="ff"):
        plan_gc(sample_info, GcOptions(keys=["aa", "ff"]), now=NOW)


def test_execute_plan(url):
    entries = [make_entry(seed=i, created=time.time() - i * DAY) for i in range(4)]
    with KVStore(url) as s:
        for e in entries:
            s.put(e)
            s.put_context(e.key, [e.key], e.n_tokens)
        flip(s, entries[0].key, -20)
        plan = plan_gc(s.verify(), GcOptions(corrupt=True, older_than=2.5 * DAY))
        assert removed(plan) == {entries[0].key, entries[3].key}
        assert len(execute_plan(s, plan).entries) == 2
        assert sorted(s.keys()) == sorted(e.key for e in entries[1:3])
        assert sorted(s.context_keys()) == sorted(e.key for e in entries[1:3])
        assert not s.verify().corrupt


def _put_all(writer, entries) -> None:
    for e in entries:
        writer.put(e, overwrite=True)


def test_build_writer_holds_a_byte_budget_of_pending_chunks(monkeypatch):
    """The build's writer lets compute queue chunks up to its byte budget, then makes it wait for
    the writes; a chunk larger than the whole budget still goes through (alone)."""
    import threading

    from kvstore.model.pipelines.build import Writer

    entries = [make_entry(8, seed=i) for i in range(3)]
    size = entries[0].kv_bytes
    with KVStore("memory://writer-budget") as store:
        gate = threading.Event()
        real = store.put  # the writer's one write (chunks and owned entries alike)

        def slow_put(item, **kw):
            gate.wait(10)
            return real(item, **kw)

        monkeypatch.setattr(store, "put", slow_put)
        # (budget, chunks put without waiting: the first goes even when larger than the budget)
        for budget, free in ((2 * size, 2), (3 * size, 3), (size // 2, 1)):
            gate.clear()
            writer = Writer(store, max_bytes=budget)
            for e in entries[:free]:
                writer.put(e, overwrite=True)  # the first is taken by the writer, which waits at the gate
            if free < len(entries):
                rest = threading.Thread(target=_put_all, args=(writer, entries[free:]))
                rest.start()
                rest.join(0.5)
                assert rest.is_alive(), f"budget {budget}: compute should wait for the writer"
            gate.set()
            if free < len(entries):
                rest.join(10)
                assert not rest.is_alive()
            writer.close()
            assert all(store.contains(e.key) for e in entries)
