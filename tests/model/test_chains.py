"""Prefix reuse: contexts stored as chains of chunks, shared prefixes stored once, longer contexts
built on shorter ones, and answers identical to running without any cache throughout.

Stores here use 8-token chunks so that short test contexts span several chunks.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from helpers.cli import read_predictions, run_main, start_cli, write_dataset
from helpers.entries import encode_v1
from helpers.rows import random_tokens
from helpers.tiny import make_tiny_model
from kvstore.errors import CorruptEntryError, CorruptEntryWarning
from kvstore.model.adapter import Adapter
from kvstore.store.entry import decode_entry
from kvstore.store.gc import GcOptions, plan_gc
from kvstore.store.keys import cache_key
from kvstore.store.kvstore import KVStore
from kvstore.store.removal import execute_plan

CHUNK = 8
N_NEW = 6


@pytest.fixture(scope="module")
def llama():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=3)
    return Adapter(model, tok)


def _store(tmp_path, name="store", **kw) -> KVStore:
    return KVStore(str(tmp_path / name), chunk_tokens=CHUNK, **kw)


def _reference(adapter, contexts, questions):
    return adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, stop_at_eos=False, batch_size=8)


def test_partial_hit_at_every_boundary_and_mid_chunk(llama, tmp_path):
    """A 30-token context whose first L tokens are stored (as a context of their own), for every L:
    all L are loaded (whole chunks, then the stored context's partial last chunk, which adds a
    boundary to the longer chain), the rest is computed, and the answer is the no-cache answer."""
    adapter = llama
    context, question = random_tokens(adapter.tokenizer, 30, 0), random_tokens(adapter.tokenizer, 4, 1)
    want = _reference(adapter, [context], [question])
    for n in range(1, 30):
        with _store(tmp_path, f"s{n}") as store:
            adapter.generate_kv_cache([context[:n]], store)
            got = adapter.greedy_sample(
                [context], [question], N_NEW, store=store, stop_at_eos=False, return_details=True
            )
            assert torch.equal(got.tokens, want), f"prefix of {n} tokens stored"
            assert got.cached_tokens == [n] and got.cache_hit == [False]
            again = adapter.greedy_sample(
                [context], [question], N_NEW, store=store, stop_at_eos=False, return_details=True
            )
            assert again.cache_hit == [True] and torch.equal(again.tokens, want)  # written through


def test_mixed_hit_depths_in_one_batch(llama, tmp_path):
    """One batch holding a full hit, partial hits at two depths, a format-1 entry and a miss."""
    adapter = llama
    base = random_tokens(adapter.tokenizer, 40, 2)
    contexts = [
        base,
        base[:37] + [5, 6, 7],
        base[:20] + random_tokens(adapter.tokenizer, 13, 3),
        random_tokens(adapter.tokenizer, 25, 4),
    ]
    contexts.append(random_tokens(adapter.tokenizer, 11, 5))  # stored in format 1 only
    questions = [random_tokens(adapter.tokenizer, q, 10 + q) for q in (3, 1, 5, 2, 4)]
    want = _reference(adapter, contexts, questions)
    with _store(tmp_path) as store:
        adapter.generate_kv_cache([base], store)
        v1 = adapter.prefill([contexts[4]])[0]
        store.put_bytes(cache_key(adapter.fingerprint, adapter.dtype, contexts[4]),
                        encode_v1(v1, "raw", contexts[4], cache_key(adapter.fingerprint, adapter.dtype, contexts[4]),
                                  model=adapter.fingerprint, model_name=adapter.name))  # fmt: skip
        got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, batch_size=8, stop_at_eos=False,
                                    return_details=True)  # fmt: skip
        assert torch.equal(got.tokens, want)
        assert got.cached_tokens == [40, 32, 16, 0, 11] and got.cache_hit == [True, False, False, False, True]
        assert got.prefill_tokens_computed == 0 + 8 + 17 + 25 + 0


def test_corrupt_chunk_mid_chain_is_a_miss_from_there_and_repaired(llama, tmp_path):
    adapter = llama
    context, question = random_tokens(adapter.tokenizer, 40, 6), random_tokens(adapter.tokenizer, 3, 7)
    want = _reference(adapter, [context], [question])
    with _store(tmp_path) as store:
        report = adapter.generate_kv_cache([context], store)
        plan = adapter.chain(context, store)
        assert len(plan.keys) == 5 and report.keys == [plan.key] and report.chunks_written == 5
        raw = bytearray(store.backend.get(b"e/" + plan.keys[2].encode()))
        raw[-30] ^= 0x40
        store.backend.put(b"e/" + plan.keys[2].encode(), bytes(raw))
        with pytest.warns(CorruptEntryWarning, match=plan.keys[2][:16]):
            got = adapter.greedy_sample(
                [context], [question], N_NEW, store=store, stop_at_eos=False, return_details=True
            )
        assert torch.equal(got.tokens, want) and got.cached_tokens == [16]
        assert store.is_intact(plan.keys[2])  # repaired on the way
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = adapter.greedy_sample(
                [context], [question], N_NEW, store=store, stop_at_eos=False, return_details=True
            )
        assert again.cached_tokens == [40] and torch.equal(again.tokens, want)


def test_a_frame_that_does_not_decompress_mid_chain_is_a_miss_from_there(llama, tmp_path):
    """A chunk whose checksum holds but one tensor's zstd frame is garbage (a forged or buggy
    entry: only found when that tensor is decompressed straight into the batch buffers) ends the
    loaded prefix there; the answer is still the reference's and the chunk is rewritten."""
    import zstandard

    from helpers.entries import split, with_frame

    adapter = llama
    context, question = random_tokens(adapter.tokenizer, 40, 16), random_tokens(adapter.tokenizer, 3, 17)
    want = _reference(adapter, [context], [question])
    with _store(tmp_path, codec="zstd:1") as store:
        adapter.generate_kv_cache([context], store)
        plan = adapter.chain(context, store)
        key = plan.keys[3]
        header, payload = split(store.backend.get(b"e/" + key.encode()))
        index = len(header["codec"]["frames"]) - 2  # a key or value tensor near the end
        size = header["codec"]["frames"][index][1]
        garbage = zstandard.ZstdCompressor(write_content_size=True).compress(b"\1" * size)
        garbage = garbage[:-4] + bytes(4) if len(garbage) > 8 else garbage  # declared size right, data broken
        forged = with_frame(header, payload, index, garbage)
        store.backend.put(b"e/" + key.encode(), forged)
        with pytest.raises(CorruptEntryError):
            decode_entry(forged)  # the eager decode notices at once
        with pytest.warns(CorruptEntryWarning, match=key[:16]):
            got = adapter.greedy_sample(
                [context], [question], N_NEW, store=store, stop_at_eos=False, return_details=True
            )
        assert torch.equal(got.tokens, want) and got.cached_tokens == [24]
        assert store.is_intact(key)


def test_build_computes_a_shared_prefix_once(llama, tmp_path):
    """A few-shot set: one 20-token head shared by five documents. The head is computed and
    stored once; each document extends it; a second build computes nothing."""
    adapter = llama
    head = random_tokens(adapter.tokenizer, 20, 8)
    docs = [random_tokens(adapter.tokenizer, 9 + 3 * i, 20 + i) for i in range(5)]
    contexts = [head + d for d in docs]
    questions = [random_tokens(adapter.tokenizer, 3, 30 + i) for i in range(5)]
    want = _reference(adapter, contexts, questions)
    with _store(tmp_path) as store:
        report = adapter.generate_kv_cache(contexts, store, prefix=head, batch_size=2)
        assert report.built == 5 and report.tokens == 20 + sum(map(len, docs))
        assert report.tokens_reused == 5 * 20
        again = adapter.generate_kv_cache(contexts, store, prefix=head)
        assert (again.skipped, again.built, again.tokens) == (5, 0, 0)
        info = store.scan()
        head_chunks = len(adapter.chain(head + [1], store, prefix=head).keys) - 1  # 20 tokens: 8 + 8 + 4
        assert head_chunks == 3 and info.n_entries == head_chunks + sum(-(-len(d) // CHUNK) for d in docs)
        assert info.logical_bytes > info.stored_bytes and info.dedupe_ratio > 1.4
        got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, prefix=head, stop_at_eos=False)
        assert torch.equal(got, want)


def test_head_boundary_tolerates_a_merged_last_token(llama):
    """A head that ends in a space tokenizes differently once the context's first word follows
    (the space joins that word): the chunk boundary falls where the ids stop agreeing, so such a
    head is still shared; a context that does not start with the head gets no boundary."""
    head = random_tokens(llama.tokenizer, 20, 8)
    merged = head[:-1] + [head[-1] + 1]  # the head's last token became another one
    for context, boundary in ((head + [5, 6, 7], 20), (merged + [5, 6], 19), (head[:-3] + [1, 2, 3], None)):
        spans = llama.chain(context, None, prefix=head).spans
        ends = {e for _, e in spans}
        assert (boundary in ends) if boundary else ends == {e for _, e in llama.chain(context, None).spans}
    other = random_tokens(llama.tokenizer, 30, 99)
    assert llama.chain(other, None, prefix=head).spans == llama.chain(other, None).spans


def test_longer_contexts_reuse_shorter_ones(llama, tmp_path):
    adapter = llama
    short = [random_tokens(adapter.tokenizer, 24, 40 + i) for i in range(3)]
    longer = [s + random_tokens(adapter.tokenizer, 24, 50 + i) for i, s in enumerate(short)]
    with _store(tmp_path) as store:
        adapter.generate_kv_cache(short, store)
        report = adapter.generate_kv_cache(longer, store)
        assert report.tokens == 3 * 24 and report.tokens_reused == 3 * 24  # only the new halves
        got = adapter.greedy_sample(longer, [[9, 10]] * 3, N_NEW, store=store, stop_at_eos=False)
    assert torch.equal(got, _reference(adapter, longer, [[9, 10]] * 3))


def test_longer_contexts_reuse_a_shorter_ones_partial_last_chunk(llama, tmp_path):
    """A stored context ending mid-chunk (13 = 8 + 5 tokens) is reused whole by contexts that
    extend it, its partial last chunk included (a boundary is added there), also in sample; a
    context stored before the shorter one keeps its own canonical chain; answers as --no-cache."""
    adapter = llama
    tok = adapter.tokenizer
    short = random_tokens(tok, 13, 60)
    longer = [short + random_tokens(tok, 20, 61), short + random_tokens(tok, 3, 62)]
    early = short + random_tokens(tok, 12, 63)  # stored before the short context exists
    q = [[9, 10]] * 3
    with _store(tmp_path) as store:
        adapter.generate_kv_cache([early], store)
        canonical = adapter.chain(early, store).keys
        adapter.generate_kv_cache([short], store)
        assert adapter.chain(early, store).keys == canonical  # still its stored chain
        report = adapter.generate_kv_cache(longer, store)
        assert report.tokens == 20 + 3 and report.tokens_reused == 2 * 13  # nothing of `short` recomputed
        plan = adapter.chain(longer[0], store)
        assert plan.spans[:3] == ((0, 8), (8, 13), (13, 21)) and plan.keys[:2] == adapter.chain(short, store).keys
        fresh = short + random_tokens(tok, 7, 64)  # sample: loads the short context's 13 tokens, computes 7
        got = adapter.greedy_sample([fresh, *longer], q, N_NEW, store=store, stop_at_eos=False, return_details=True)
        assert got.cached_tokens == [13, 33, 16]
    assert torch.equal(got.tokens, _reference(adapter, [fresh, *longer], q))


def test_rm_keeps_shared_chunks_and_gc_collects_orphans_after_the_grace(llama, tmp_path):
    adapter = llama
    head = random_tokens(adapter.tokenizer, 16, 60)
    a, b = head + random_tokens(adapter.tokenizer, 10, 61), head + random_tokens(adapter.tokenizer, 12, 62)
    with _store(tmp_path) as store:
        adapter.generate_kv_cache([a, b], store)
        pa, pb = adapter.chain(a, store), adapter.chain(b, store)
        assert pa.keys[:2] == pb.keys[:2] and len(store) == 2 + 2 + 2
        plan = plan_gc(store.scan(), GcOptions(keys=[pa.key[:10]]))
        assert {k for k, _, _ in plan.remove} == set(pa.keys[2:])  # the shared head stays for b
        assert len(execute_plan(store, plan).entries) == 2
        assert store.context_keys() == [pb.key] and all(k in store for k in pb.keys)
        # a chunk no context uses (a build in progress, say) survives the grace period, then goes
        orphan = adapter.chain(random_tokens(adapter.tokenizer, 8, 63), store)
        adapter.generate_kv_cache([orphan.ids], store)
        store.delete_many([], contexts=[orphan.key])
        info = store.scan()
        assert [e.key for e in info.orphans] == [orphan.key]
        assert plan_gc(info, GcOptions(orphans=True, grace=3600)).remove == ()
        later = plan_gc(info, GcOptions(orphans=True, grace=3600), now=time.time() + 7200)
        assert {k for k, _, _ in later.remove} == {orphan.key}


def test_v1_entries_answer_and_build_migrates_them(llama, tmp_path):
    """A phase-1 store: whole-context entries in format 1. sample answers from them for their exact
    contexts; build rewrites them as chains without computing anything."""
    adapter = llama
    contexts = [random_tokens(adapter.tokenizer, n, 70 + n) for n in (12, 21)]
    questions = [[7, 8], [9]]
    want = _reference(adapter, contexts, questions)
    with _store(tmp_path) as store:
        for c, layers in zip(contexts, adapter.prefill(contexts)):
            key = cache_key(adapter.fingerprint, adapter.dtype, c)
            store.put_bytes(key, encode_v1(layers, "zstd-shuffle:1", c, key, model=adapter.fingerprint,
                                           model_name=adapter.name))  # fmt: skip
        got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, stop_at_eos=False, return_details=True)
        assert got.cache_hit == [True, True] and got.prefill_tokens_computed == 0 and torch.equal(got.tokens, want)
        assert len(store.scan().contexts) == 2  # format-1 entries are contexts of their own
        report = adapter.generate_kv_cache(contexts, store)
        assert (report.migrated, report.tokens, report.built) == (2, 0, 0)
        assert all(adapter.chain(c, store).key in store.context_keys() for c in contexts)
        got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, stop_at_eos=False)
        assert torch.equal(got, want)


def test_concurrent_builders_share_prefix_chunks(tiny_llama_dir, tmp_path):
    """Two `kvstore build` processes at once on datasets whose contexts share a long head (given
    through a template) and overlap: every context stored once, each shared chunk once, all intact."""
    template = [
        "--template",
        "Background: " + "the quick brown fox jumps over the lazy dog. " * 3 + "{context}\nQ: {question}\nA:",
    ]
    store = tmp_path / "store"
    procs = []
    for i, ids in enumerate((range(0, 12), range(6, 18))):
        ds = write_dataset(tmp_path / f"d{i}.jsonl", ids, questions=1)
        argv = ["build", ds, "--model", tiny_llama_dir, "--store", store, "--no-chat", *template, "--quiet",
                "--format", "json", "--dtype", "float64", "--batch-size", "3"]  # fmt: skip
        procs.append(start_cli(argv, tmp_path, name=f"build{i}"))
    for p in procs:
        code, out, err = p.wait(300)
        assert code == 0, err
    with KVStore(str(store), readonly=True) as s:
        info = s.verify()
    assert not info.corrupt and len(info.contexts) == 18 and all(c.complete for c in info.contexts)
    shared = {k for c in info.contexts for k in c.chunks if info.refs[k] == 18}
    assert shared and len(info.entries) == len({k for c in info.contexts for k in c.chunks})  # no strays
    assert info.dedupe_ratio > 1.0


def test_cli_reports_reuse_and_cached_tokens(tiny_llama_dir, tmp_path, capsys):
    dataset = write_dataset(tmp_path / "data.jsonl", range(4))
    store = tmp_path / "store"
    common = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--format", "json", "--dtype", "float64"]
    code, out, err = run_main(capsys, "build", dataset, *common)
    built = json.loads(out)
    assert code == 0 and built["built"] == 4 and built["tokens_computed"] > 0 and built["chunks_written"] >= 5
    code, out, err = run_main(capsys, "sample", dataset, *common, "-n", "4", "-o", tmp_path / "a.jsonl")
    rows = read_predictions(tmp_path / "a.jsonl")
    assert code == 0 and all(r["cache_hit"] and r["cached_tokens"] > 0 for r in rows.values())
    code, out, err = run_main(capsys, "stats", "--store", store, "--format", "json")
    totals = json.loads(out)["totals"]
    assert totals["contexts"] == 4 and totals["entries"] == 5  # 4 documents + the chat head, once
    assert totals["logical_bytes"] > totals["stored_bytes"] and totals["dedupe_ratio"] > 1.0


def test_gc_while_a_build_runs_loses_nothing(tiny_llama_dir, tmp_path, capsys):
    """`kvstore gc` in a loop while a build writes chunks (first) and context records (last): the
    grace period keeps every chunk the build still has to link, so the build ends complete."""
    store = tmp_path / "store"
    common = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--dtype", "float64"]
    first = write_dataset(tmp_path / "first.jsonl", range(0, 6), questions=1)
    assert run_main(capsys, "build", first, *common)[0] == 0  # a store whose head chunk later builds reuse
    dataset = write_dataset(tmp_path / "more.jsonl", range(0, 40), questions=1)
    build = start_cli(["build", dataset, *common, "--batch-size", "1"], tmp_path, name="build")
    runs = 0
    while build.alive() or runs == 0:
        code, out, err = run_main(capsys, "gc", "--store", store, "--yes", "--quiet")
        assert code == 0, err
        runs += 1
    code, out, err = build.wait(300)
    assert code == 0, err
    with KVStore(str(store), readonly=True) as s:
        info = s.verify()
    assert runs > 1 and not info.corrupt and len(info.contexts) == 40 and all(c.complete for c in info.contexts)


def test_a_stored_chain_drives_hf_generate(llama, tmp_path):
    """store.get_context joins a context's chunks (and reads a format-1 entry) into one entry whose
    DynamicCache lets Hugging Face's generate continue it with the tokens of a run without cache."""
    adapter = llama
    model = adapter.model
    context, question = random_tokens(adapter.tokenizer, 21, 70), [9, 10, 11]
    full = torch.tensor([context + question])

    def generate(past=None):
        out = model.generate(input_ids=full, attention_mask=torch.ones_like(full), past_key_values=past,
                             max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        return out[0, full.shape[1] :].tolist()

    want = generate()
    with _store(tmp_path) as store:
        plan = adapter.chain(context, store)
        adapter.generate_kv_cache([context], store)
        assert len(plan.keys) == 3  # 8 + 8 + 5 tokens
        entry = store.get_context(plan.key)
        assert entry is not None and entry.token_ids.tolist() == context
        assert generate(entry.to_dynamic_cache()) == want
        v1_key = cache_key(adapter.fingerprint, adapter.dtype, context)
        layers = adapter.prefill([context])[0]
        store.put_bytes(v1_key, encode_v1(layers, "raw", context, v1_key, model=adapter.fingerprint,
                                          model_name=adapter.name))  # fmt: skip
        assert generate(store.get_context(v1_key).to_dynamic_cache()) == want
        assert store.get_context("0" * 64) is None
