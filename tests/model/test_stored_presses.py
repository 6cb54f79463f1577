"""Compress once, store, reuse: stored scores and stored pressed caches answer exactly as pressing the
dense cache does.

Float64 tiny models, rows of different lengths in one batch (the exactness tests' setting). Stored
scores are the recomputed ones bit for bit and, once stored, no scoring forward runs; a pressed
entry answers (and scores) exactly what pressing the loaded dense cache answers, and what the
no-store reference under the same press answers, with no prefill and no scoring forward; a lossy
codec's pressed entry answers what its lossy reload would; corrupt or foreign entries are misses.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from helpers.rows import random_ids
from helpers.tiny import make_tiny_model
from kvstore.errors import CorruptEntryWarning, PressError, ReadOnlyStoreError
from kvstore.model.adapter import Adapter
from kvstore.model.compute.cache import BatchCache
from kvstore.model.press.select import PressMemo, row_scores
from kvstore.model.press.spec import parse_press, parse_scorer
from kvstore.model.press.stored import facts, pressed_key, scores_key
from kvstore.store.keyspace import derived_entry_key
from kvstore.store.kind_pressed import encode_pressed
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import DerivedFacts

N_NEW = 5
LENGTHS = [96, 130, 75, 151]
Q_LENGTHS = [3, 1, 5, 2]


@pytest.fixture(scope="module")
def llama():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=5)
    return Adapter(model, tok)


@pytest.fixture(scope="module")
def rows(llama):
    return random_ids(llama.tokenizer, LENGTHS, rng=21), random_ids(llama.tokenizer, Q_LENGTHS, rng=22)


def _sweep(adapter, contexts, questions, variants, **kw):
    kw.setdefault("stop_at_eos", False)
    return adapter.sweep(contexts, questions, variants=variants, num_new_tokens=N_NEW, return_scores=True, **kw)


def _same(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def _close(a, b, tol: float = 1e-10) -> bool:
    return torch.equal(a.tokens, b.tokens) and max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores)) < tol


def _loaded_cache(store: KVStore, chains) -> BatchCache:
    """The stored dense caches of ``chains``, one row each, right-aligned at the longest."""
    entries = [store.get_context(c.key) for c in chains]
    P = max(c.n_tokens for c in chains)
    bufs = []
    for i in range(len(entries[0].layers)):
        k0, v0 = entries[0].layers[i]
        kb = k0.new_zeros((len(chains), k0.shape[0], P + 1, k0.shape[-1]))
        vb = v0.new_zeros((len(chains), v0.shape[0], P + 1, v0.shape[-1]))
        for r, e in enumerate(entries):
            k, v = e.layers[i]
            kb[r, :, P - k.shape[1] : P], vb[r, :, P - v.shape[1] : P] = k, v
        bufs.append((kb, vb))
    spans = tuple((P - c.n_tokens, P) for c in chains)
    return BatchCache(bufs, spans, tuple(c.n_tokens for c in chains), P, tuple(c.ids for c in chains))


def test_scores_are_stored_on_first_use_and_every_ratio_reads_them(llama, rows):
    contexts, questions = rows
    specs = ["kvzip:0.25", "kvzip:0.5", "kvzip:0.75:layer", "expected_attention:0.5", "snapkv:0.5:adakv"]
    with KVStore("memory://", chunk_tokens=32) as store:
        llama.build(contexts, store)
        first = _sweep(llama, contexts, questions, specs, store=store, batch_size=3)
        again = _sweep(llama, contexts, questions, specs, store=store, batch_size=4)
        chains = [llama.chain(c, store) for c in contexts]
        cache = _loaded_cache(store, chains)  # recomputed from the very dense cache they were scored on
        for scorer in ("kvzip", "expected_attention", "snapkv"):  # stored == recomputed, bit for bit
            press = parse_scorer(scorer)
            for r, chain in enumerate(chains):
                with store.open_derived(chain.context_key, scores_key(chain, press)) as view:
                    assert view is not None, (scorer, r)
                    fresh = row_scores(llama.handle, cache, press, r, PressMemo())
                    assert all(torch.equal(view.scores(i), s) for i, s in enumerate(fresh)), (scorer, r)
    assert first["kvzip:0.5"].replay_tokens_computed > 0 and first["kvzip:0.5"].scoring_tokens_computed > 0
    for spec in specs:
        assert again[spec].scoring_tokens_computed == 0 and again[spec].prefill_tokens_computed == 0, spec
        assert _same(first[spec], again[spec]), spec


def test_build_score_then_any_ratio_runs_no_scoring_forward(llama, rows):
    contexts, questions = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        report = llama.build(contexts, store, scores=["kvzip", "expected_attention"])
        assert report.scores_written == 2 * len(contexts) and report.scoring_tokens > 0
        assert llama.build(contexts, store, scores=["kvzip"]).scores_written == 0  # stored already: skipped
        got = _sweep(llama, contexts, questions, ["kvzip:0.3", "kvzip:0.6", "expected_attention:0.5"], store=store)
    ref = _sweep(llama, contexts, questions, ["kvzip:0.3", "kvzip:0.6", "expected_attention:0.5"], use_cache=False)
    for spec, res in got.items():
        assert res.scoring_tokens_computed == 0 and res.prefill_tokens_computed == 0, spec
        assert _close(res, ref[spec]), spec


def test_a_pressed_entry_answers_as_pressing_the_dense_cache_with_no_prefill_or_scoring(llama, rows):
    contexts, questions = rows
    specs = ["kvzip:0.75", "snapkv:0.5:adakv", "knorm:0.5"]
    with KVStore("memory://", chunk_tokens=32) as dense_only:
        llama.build(contexts, dense_only)
        pressed_now = _sweep(llama, contexts, questions, specs, store=dense_only, batch_size=4)
    with KVStore("memory://", chunk_tokens=32) as store:
        report = llama.build(contexts, store, presses=specs)
        assert report.pressed_written == len(specs) * len(contexts)
        got = _sweep(llama, contexts, questions, specs, store=store, batch_size=3)
    ref = _sweep(llama, contexts, questions, specs, use_cache=False, batch_size=2)
    for spec in specs:
        res = got[spec]
        assert res.prefill_tokens_computed == 0 and res.scoring_tokens_computed == 0, spec
        assert all(res.cache_hit), spec
        assert _same(res, pressed_now[spec]), spec  # the stored kept tokens are the pressed ones, exactly
        assert _close(res, ref[spec]), spec
        assert res.kept_tokens == pressed_now[spec].kept_tokens and res.cache_bytes == pressed_now[spec].cache_bytes


def test_a_store_of_only_pressed_caches_answers_and_computes_the_dense_cache_on_a_miss(llama, rows):
    contexts, questions = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        plan = llama.plan_build(contexts, store, presses=["kvzip:0.75"], dense=False)
        assert [s.action for s in plan.steps] == ["none"] * len(contexts)
        assert plan.pressed_to_make == len(contexts) and plan.chunks_to_compute == 0
        llama.build(contexts, store, presses=["kvzip:0.75"], dense=False)
        assert store.keys() == [] and store.context_keys() == []  # no dense chain, no record
        assert llama.plan_build(contexts, store, presses=["kvzip:0.75"], dense=False).pressed_to_make == 0
        pressed = _sweep(llama, contexts, questions, ["kvzip:0.75"], store=store)["kvzip:0.75"]
        assert pressed.prefill_tokens_computed == 0 and pressed.scoring_tokens_computed == 0
        both = _sweep(llama, contexts, questions, ["dense", "kvzip:0.75"], store=store)  # dense: a miss, computed
        assert both["dense"].prefill_tokens_computed == sum(LENGTHS)
    ref = _sweep(llama, contexts, questions, ["dense", "kvzip:0.75"], use_cache=False)
    assert _close(pressed, ref["kvzip:0.75"]) and _close(both["kvzip:0.75"], ref["kvzip:0.75"])
    assert _close(both["dense"], ref["dense"])


def test_some_rows_from_entries_and_some_pressed_now_in_one_batch(llama, rows):
    contexts, questions = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        llama.build(contexts, store)
        llama.build(contexts[::2], store, presses=["snapkv:0.5:adakv"])
        got = _sweep(llama, contexts, questions, ["snapkv:0.5:adakv"], store=store, batch_size=4)
    ref = _sweep(llama, contexts, questions, ["snapkv:0.5:adakv"], use_cache=False)
    assert _close(got["snapkv:0.5:adakv"], ref["snapkv:0.5:adakv"])


@pytest.mark.parametrize("codec", ["int8", "int4", "int8r"])
def test_a_lossy_pressed_entry_answers_as_its_lossy_reload(llama, rows, codec):
    contexts, questions = rows
    with KVStore("memory://", codec=codec, chunk_tokens=32) as store:
        miss = _sweep(llama, contexts, questions, ["kvzip:0.75"], store=store)["kvzip:0.75"]  # pressed now
        llama.build(contexts, store, presses=["kvzip:0.75"])
        hit = _sweep(llama, contexts, questions, ["kvzip:0.75"], store=store)["kvzip:0.75"]  # from the entries
        chain = llama.chain(contexts[0], store)
        assert store.has_derived(chain.context_key, pressed_key(chain, parse_press("kvzip:0.75"), store.codec))
        assert hit.codecs[0].startswith(codec)
    assert hit.prefill_tokens_computed == 0 and hit.scoring_tokens_computed == 0
    assert _same(miss, hit)
    with KVStore("memory://", chunk_tokens=32) as lossless:  # a lossless request never reads a lossy entry
        llama.build(contexts, lossless)
        assert not _same(_sweep(llama, contexts, questions, ["kvzip:0.75"], store=lossless)["kvzip:0.75"], hit)


def test_scores_under_a_stored_press_read_the_scored_contexts_entries(llama, rows):
    contexts, _ = rows
    conts = random_ids(llama.tokenizer, [4, 2, 6, 3], rng=31)
    with KVStore("memory://", chunk_tokens=32) as store:
        first = llama.score_sweep(contexts, conts, variants=["kvzip:0.5"], store=store)["kvzip:0.5"]
        again = llama.score_sweep(contexts, conts, variants=["kvzip:0.5"], store=store)["kvzip:0.5"]
        heads = [c[:-1] for c in contexts]  # what scoring reads of each context
        llama.build(heads, store, presses=["kvzip:0.5"])
        pressed = llama.score_sweep(contexts, conts, variants=["kvzip:0.5"], store=store)["kvzip:0.5"]
    ref = llama.score_sweep(contexts, conts, variants=["kvzip:0.5"], use_cache=False)["kvzip:0.5"]
    assert first.replay_tokens_computed > 0
    assert again.scoring_tokens_computed == 0 and pressed.scoring_tokens_computed == 0
    for res in (first, again, pressed):
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref.logprobs)) < 1e-10


def test_a_corrupt_or_foreign_pressed_entry_is_a_miss_and_nothing_is_lost(llama, rows):
    contexts, questions = rows
    press = parse_press("kvzip:0.75")
    with KVStore("memory://", chunk_tokens=32) as store:
        llama.build(contexts, store, presses=["kvzip:0.75"])
        chain = llama.chain(contexts[0], store)
        key = pressed_key(chain, press, store.codec)
        name = derived_entry_key(chain.context_key, key)
        blob = bytearray(store.backend.get(name))
        blob[len(blob) // 2] ^= 0xFF
        store.backend.put(name, bytes(blob))
        other = llama.chain(contexts[1], store)  # a foreign entry filed under context 1's key
        layers = [[(torch.zeros(1, 16, dtype=torch.float64), torch.zeros(1, 16, dtype=torch.float64),
                    torch.tensor([0]))] * 2 for _ in range(2)]  # fmt: skip
        fake = DerivedFacts(other.context_key, "f" * 64, "other", "float64", other.n_tokens)
        _, forged = encode_pressed(fake, press.name, {}, layers, store.codec)
        store.backend.put(derived_entry_key(other.context_key, pressed_key(other, press, store.codec)), forged)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = _sweep(llama, contexts, questions, ["kvzip:0.75"], store=store)["kvzip:0.75"]
        assert sum(issubclass(w.category, CorruptEntryWarning) for w in seen) >= 2
        assert len(store.keys()) > 0 and all(store.is_intact(k) for k in store.keys())  # the dense chains stay
    ref = _sweep(llama, contexts, questions, ["kvzip:0.75"], use_cache=False)["kvzip:0.75"]
    assert _close(got, ref)
    assert got.prefill_tokens_computed == 0  # the two misses were pressed from the stored dense caches


def test_pressed_entries_record_what_made_them(llama, rows):
    contexts, _ = rows
    with KVStore("memory://", codec="int8", chunk_tokens=32) as store:
        llama.build(contexts[:1], store, presses=["snapkv:0.5:adakv"])
        chain = llama.chain(contexts[0], store)
        key = pressed_key(chain, parse_press("snapkv:0.5:adakv"), store.codec)
        with store.open_derived(chain.context_key, key) as view:
            h = view.header
            assert h.spec == "snapkv:0.5:adakv" and h.press["method"] == "snapkv" and h.press["budget"] == "adakv"
            assert h.press["ratio"] == 0.5 and h.press["scorer"] == "snapkv:kernel=5:window=64"
            assert h.codec_spec.startswith("int8") and h.model == llama.fingerprint
            counts = [layer.counts for layer in h.layers]
            assert len({c for layer in counts for c in layer}) > 1  # adakv: heads keep different counts
            assert abs(h.kept_fraction - 0.5) < 0.02


def test_bad_build_requests_are_one_line(llama, rows):
    contexts, _ = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        for kw, says in [({"scores": ["snapkv:q"]}, "question-aware"), ({"scores": ["streaming_llm"]}, "ratio"),
                         ({"presses": ["snapkv:0.5:q"]}, "question-aware"), ({"presses": ["kvzip:0"]}, "ratio of 0"),
                         ({"presses": ["bogus:0.5"]}, "unknown press")]:  # fmt: skip
            with pytest.raises(PressError) as exc:
                llama.build(contexts, store, **kw)
            assert says in str(exc.value) and "\n" not in str(exc.value), kw
        llama.build(contexts[:1], store)
        with KVStore(store.url, readonly=True) as ro, pytest.raises(ReadOnlyStoreError) as exc:
            llama.build(contexts[:1], ro, presses=["kvzip:0.5"])
        assert "\n" not in str(exc.value)


def test_the_plan_says_what_a_build_will_do(llama, rows):
    contexts, _ = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        empty = llama.plan_build(contexts, store, presses=["kvzip:0.5"], scores=["snapkv"])
        assert [s.action for s in empty.steps] == ["compute"] * 4
        assert empty.tokens_to_compute == sum(LENGTHS) and empty.pressed_to_make == 4
        assert empty.scores_to_make == 8  # snapkv's, and kvzip's own (stored with its pressed caches)
        assert store.keys() == []  # a plan writes nothing
        llama.build(contexts[:2], store)
        half = llama.plan_build(contexts, store)
        assert [s.action for s in half.steps] == ["skip", "skip", "compute", "compute"]
        assert half.summary(llama.kv_bytes_per_token())["tokens_to_compute"] == sum(LENGTHS[2:])
        report = llama.build(contexts, store, presses=["kvzip:0.5"])
        assert report.built == 2 and report.skipped == 2 and report.pressed_written == 4
        assert facts(llama.handle, llama.chain(contexts[0], store)).n_tokens == LENGTHS[0]


def test_a_build_with_presses_probes_the_store_once(llama, rows, monkeypatch):
    """The derived part reads the stored depths the build's plan and dense part left (the build
    probed them once); it plans its batches without asking the store again, and what it stores
    equals what the plan asked for (a sample reads it back)."""
    import kvstore.model.plan.batch as batch_plans

    contexts, questions = rows
    probes = []
    real = batch_plans.stored_depth
    monkeypatch.setattr(batch_plans, "stored_depth", lambda *a: probes.append(a) or real(*a))
    distinct = len({tuple(c) for c in contexts})
    for dense in (True, False):
        with KVStore("memory://", chunk_tokens=16) as store:
            if not dense:
                llama.build(contexts[:1], store)  # a stored prefix for one context: loaded, the rest computed
            probes.clear()
            report = llama.build(contexts, store, presses=["knorm:0.5"], dense=dense)
            assert probes == [], len(probes)
            assert report.pressed_written == distinct
            monkeypatch.setattr(batch_plans, "stored_depth", real)
            got = llama.sample(contexts, questions, store=store, press="knorm:0.5", num_new_tokens=3)
            assert all(got.cache_hit)
            monkeypatch.setattr(batch_plans, "stored_depth", lambda *a: probes.append(a) or real(*a))


def test_a_build_writes_its_scores_and_pressed_caches_on_the_writer_thread(llama, rows, monkeypatch):
    """build --press / --score: every entry a context owns is put by the build's writer, off the
    compute thread, after its context's chunks and record (one write path for every kind)."""
    from kvstore.store.access import kind_of_blob

    puts: list[tuple[str, str]] = []  # (kind, thread) of every put of an encoded entry
    real_put = KVStore.put

    def put(self, item, **kw):
        if isinstance(item, bytes):
            puts.append((kind_of_blob(item)[0].name, threading.current_thread().name))
        return real_put(self, item, **kw)

    monkeypatch.setattr(KVStore, "put", put)
    contexts, _ = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        report = llama.build(contexts, store, presses=["kvzip:0.5"], scores=["expected_attention"])
    assert report.pressed_written == len(contexts) and report.scores_written >= len(contexts)
    owned = [(kind, thread) for kind, thread in puts if kind != "chunk"]
    assert sorted({k for k, _ in owned}) == ["pressed", "scores"]
    assert len(owned) == report.pressed_written + report.scores_written
    assert {t for _, t in puts} == {"kvstore-writer"}  # chunks and owned entries alike
