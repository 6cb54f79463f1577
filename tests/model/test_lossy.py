"""Lossy codecs end to end: a lossy entry never answers a lossless request (nor one for another
lossy codec), a miss computed under a lossy codec is answered from the values its stored codes
give back (so every later run answers the same), and the CLI says where answers came from."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.cli import read_predictions, run_main, write_dataset
from helpers.rows import random_rows
from helpers.tiny import make_family_model, make_tiny_model
from kvstore.errors import CodecError, ModelError
from kvstore.model.adapter import Adapter
from kvstore.store.codecs import DEFAULT_CODEC
from kvstore.store.kvstore import KVStore

N_NEW = 6


ROWS = dict(context_tokens=(12, 40), question_tokens=(2, 5), per_context=2)  # two questions per context


@pytest.fixture(scope="module")
def llama():
    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=5)
    return Adapter(model, tok)


def _sample(adapter, store, contexts, questions, **kw):
    return adapter.greedy_sample(
        contexts, questions, N_NEW, store=store, stop_at_eos=False, return_details=True, return_scores=True,
        **{"batch_size": 8} | kw,
    )  # fmt: skip


@pytest.mark.parametrize("spec", ["int8", "int4", "fp8", "int8+zstd-shuffle:1"])
def test_a_miss_is_answered_from_its_stored_codes(llama, tmp_path, spec):
    """First run: every context missing, computed, stored lossy and answered from the decoded
    codes. Second run: all hits; the same tokens and the same logits, bit for bit."""
    contexts, questions = random_rows(llama.tokenizer, 4, 0, **ROWS)
    with KVStore(str(tmp_path / "s"), codec=spec, chunk_tokens=8) as store:
        first = _sample(llama, store, contexts, questions)
        assert not any(first.cache_hit)
        second = _sample(llama, store, contexts, questions)
    assert all(second.cache_hit)
    want = first.codecs[0]
    assert want is not None and want.startswith(spec.split("+")[0].split(":")[0])
    assert set(first.codecs) == set(second.codecs) == {want}
    assert torch.equal(first.tokens, second.tokens)
    for a, b in zip(first.scores, second.scores):
        assert torch.equal(a, b)
    # and it really is lossy: the logits differ from the model's own
    exact = _sample(llama, None, contexts, questions, use_cache=False)
    assert max(float((a - b).abs().max()) for a, b in zip(first.scores, exact.scores)) > 0


def test_readonly_store_answers_as_a_writable_one_would(llama, tmp_path):
    contexts, questions = random_rows(llama.tokenizer, 4, 1, **ROWS)
    path = str(tmp_path / "s")
    KVStore(path).close()
    with KVStore(path, readonly=True, codec="int8") as ro:
        a = _sample(llama, ro, contexts, questions)
    with KVStore(path, codec="int8") as rw:
        b = _sample(llama, rw, contexts, questions)
        c = _sample(llama, rw, contexts, questions)
    assert not any(a.cache_hit) and all(c.cache_hit)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(b.tokens, c.tokens)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, c.scores))


def test_lossy_entries_never_answer_a_lossless_request(llama, tmp_path):
    contexts, questions = random_rows(llama.tokenizer, 4, 2, **ROWS)
    path = str(tmp_path / "s")
    with KVStore(path, codec="int8", chunk_tokens=8) as store:
        report = llama.generate_kv_cache(sorted({tuple(c) for c in contexts}), store)
        assert report.built == 4
    reference = _sample(llama, None, contexts, questions, use_cache=False)
    for other in (None, "raw", "int4", "int4h", "int8:32", "fp8"):
        with KVStore(path, codec=other, readonly=True) as store:
            got = _sample(llama, store, contexts, questions)
        assert got.cached_tokens == [0] * len(contexts), other  # not even a prefix
        if other in (None, "raw"):
            assert torch.equal(got.tokens, reference.tokens)
            # float32: the layouts differ, so logits agree to rounding (the lossy ones do not: see above)
            assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(got.scores, reference.scores))
    with KVStore(path, codec="int8:128/64", readonly=True) as store:
        assert all(_sample(llama, store, contexts, questions).cache_hit)


def test_lossy_entry_under_a_lossless_key_is_refused(llama, tmp_path):
    """A stored context re-encoded with int8 under its own lossless key (a misfiled or forged
    entry: key, model, tokens and shapes all fit) is a miss, never an answer: its header says
    lossy."""
    contexts, questions = random_rows(llama.tokenizer, 1, 3, **ROWS)
    with KVStore(str(tmp_path / "s"), chunk_tokens=64) as store:
        llama.generate_kv_cache([contexts[0]], store)
        key = llama.chain(contexts[0], store).key
        assert all(_sample(llama, store, contexts, questions).cache_hit)
        with store.open_entry(key) as view:
            entry = view.materialize()
        store.put(entry, codec="int8")
        got = _sample(llama, store, contexts, questions)
    assert got.cached_tokens == [0, 0]


def test_partial_hits_extend_a_lossy_prefix(llama, tmp_path):
    """A longer context on a stored lossy prefix: the rest is computed on the prefix's decoded
    values and stored lossy; a second run loads it all and answers the same."""
    contexts, questions = random_rows(llama.tokenizer, 2, 4, **ROWS)
    longer = [c + c[:17] for c in contexts]
    with KVStore(str(tmp_path / "s"), codec="int4", chunk_tokens=8) as store:
        llama.generate_kv_cache(sorted({tuple(c) for c in contexts}), store)
        first = _sample(llama, store, longer, questions)
        assert all(0 < n < len(c) for n, c in zip(first.cached_tokens, longer))
        second = _sample(llama, store, longer, questions)
    assert all(second.cache_hit) and torch.equal(first.tokens, second.tokens)
    assert all(torch.equal(a, b) for a, b in zip(first.scores, second.scores))


def test_windowed_and_recurrent_models_refuse_lossy_codecs(tmp_path):
    for name, attn in (("mistral", "sdpa"), ("mamba2", None)):
        model, tok = make_family_model(name, dtype=torch.float32, attn_implementation=attn)
        adapter = Adapter(model, tok)
        with KVStore(str(tmp_path / name), codec="int8") as store, pytest.raises(ModelError) as err:
            adapter.generate_kv_cache([[5, 6, 7, 8]], store)
        assert "lossy codec int8:128/64" in str(err.value) and "\n" not in str(err.value)


# -- the CLI ------------------------------------------------------------------------------------------
def test_cli_build_and_sample_with_a_lossy_codec(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "d.jsonl", range(4))
    store = tmp_path / "store"
    base = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--format", "json"]
    code, out, err = run_main(capsys, "build", data, *base, "--codec", "int8")
    assert code == 0, err
    built = json.loads(out)
    assert built["codec"] == "int8:128/64" and built["lossy"] is True and built["built"] == 4

    def sample(*extra):
        out_path = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
        code, out, err = run_main(capsys, "sample", data, *base, "-n", "5", "-o", out_path, *extra)
        assert code == 0, err
        return json.loads(out), read_predictions(out_path), err

    ref_summary, ref, _ = sample("--no-cache")
    assert ref_summary["codec"] is None and all(r["codec"] is None for r in ref.values())
    # a plain sample never sees the int8 entries: all computed (and stored lossless), same as --no-cache
    plain_summary, plain, _ = sample("--readonly-store")
    assert plain_summary["cache_hit_rate"] == 0 and plain_summary["lossy"] is False
    assert {r["codec"] for r in plain.values()} == {DEFAULT_CODEC}
    assert {k: r["raw_output"] for k, r in plain.items()} == {k: r["raw_output"] for k, r in ref.items()}
    lossy_summary, lossy, err = sample("--codec", "int8")
    assert lossy_summary["cache_hit_rate"] == 1 and lossy_summary["lossy"] is True
    assert lossy_summary["codec"] == "int8:128/64" and {r["codec"] for r in lossy.values()} == {"int8:128/64"}
    assert "answers came from lossy int8:128/64 caches" in err
    code, out, err = run_main(capsys, "ls", "--store", store, "--format", "json")
    assert code == 0 and {c["codec"] for c in json.loads(out)} == {"int8:128/64"}
    code, out, err = run_main(capsys, "sample", data, *base, "--codec", "int3")
    assert code == 1 and err.startswith("kvstore: error: unknown codec 'int3'") and err.count("\n") == 1


def test_convert_without_recompute_equals_a_lossy_build(llama, tmp_path):
    """Converting stored lossless contexts to int8 gives the chunks a fresh int8 build writes:
    same keys, same answers, bit for bit; lossy chains are refused with a reason."""
    from kvstore.store.convert import convert_contexts

    contexts, questions = random_rows(llama.tokenizer, 4, 6, **ROWS)
    distinct = sorted({tuple(c) for c in contexts})
    a_path, b_path = str(tmp_path / "a"), str(tmp_path / "b")
    with KVStore(a_path, chunk_tokens=8) as src:
        llama.generate_kv_cache(distinct, src)
        report = convert_contexts(src, src, "int8")
        assert (report.converted, report.present, report.problems) == (4, 0, [])
        assert report.chunks_written == 14 and report.stored_bytes > 0  # (8-token chunks: headers dominate)
        again = convert_contexts(src, src, "int8")
        assert (again.converted, again.present, again.keys) == (0, 4, report.keys)
        with pytest.raises(CodecError):
            convert_contexts(src, src, "zstd:3")
    with KVStore(b_path, codec="int8", chunk_tokens=8) as built:
        llama.generate_kv_cache(distinct, built)
        assert sorted(report.keys.values()) == sorted(built.context_keys())
        b = _sample(llama, built, contexts, questions)
        refused = convert_contexts(built, built, "int4")
        assert refused.converted == 0 and all("lossy codec int8:128/64 already" in p for p in refused.problems)
    with KVStore(a_path, codec="int8", readonly=True) as converted:
        a = _sample(llama, converted, contexts, questions)
    assert all(a.cache_hit) and all(b.cache_hit) and torch.equal(a.tokens, b.tokens)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def test_cli_sync_codec_converts_without_recompute(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "d.jsonl", range(3))
    store, other = tmp_path / "store", tmp_path / "other"
    base = ["--model", tiny_llama_dir, "--quiet", "--format", "json"]
    assert run_main(capsys, "build", data, *base, "--store", store)[0] == 0

    def sync(*args):
        code, out, err = run_main(capsys, "sync", *args, "--quiet", "--format", "json")
        assert code == 0, err
        return json.loads(out)

    dry = sync(store, store, "--codec", "int8", "--dry-run")
    assert (dry["converted"], dry["already_present"]) == (3, 0)
    done = sync(store, store, "--codec", "int8")
    assert (done["converted"], done["refused"], done["codec"]) == (3, 0, "int8:128/64") and done["chunks_written"] >= 3
    assert sync(store, store, "--codec", "int8")["already_present"] == 3
    assert sync(store, other, "--codec", "int4:64")["converted"] == 3
    third = tmp_path / "third"
    assert sync(store, third, "--codec", "int4h")["converted"] == 3  # no rotary parameters needed
    for path, codec in ((store, "int8"), (other, "int4:64"), (third, "int4h")):
        code, out, err = run_main(capsys, "sample", data, *base, "--store", path, "--codec", codec, "--readonly-store")
        assert code == 0 and json.loads(out)["cache_hit_rate"] == 1, err
    code, out, err = run_main(capsys, "sync", store, other, "--codec", "zstd:3")
    assert code == 1 and "is lossless" in err and err.count("\n") == 1


def test_a_lossy_build_computes_what_follows_a_stored_prefix_on_its_decoded_values(llama, tmp_path):
    """Why ``build --codec int4h`` and ``sync --codec int4h`` may store different bytes under one
    key (issue 45, finding 8; docs/lossy-codecs.md): a build computes the chunks after a stored
    prefix (here a shared head, stored first) on the prefix's decoded values, as a sample
    completing a context does; a conversion quantizes what a lossless build computed on the exact
    prefix. The head itself, computed alone by both, is the same."""
    from kvstore.model.compute.forward import extend
    from kvstore.store.convert import convert_contexts

    contexts, _ = random_rows(llama.tokenizer, 2, 2, context_tokens=(30, 40), question_tokens=(2, 3), per_context=1)
    head = list(contexts[0][:12])
    contexts = [head + list(c[12:]) for c in contexts]
    kw = dict(prefix=head, batch_size=1)
    with (
        KVStore(str(tmp_path / "a"), chunk_tokens=64) as src,
        KVStore(str(tmp_path / "b"), codec="int4h", chunk_tokens=64) as built,
    ):
        llama.build(contexts, src, **kw)
        report = convert_contexts(src, src, "int4h")
        llama.build(contexts, built, **kw)
        assert sorted(report.keys.values()) == sorted(built.context_keys())
        for lossless_key, key in report.keys.items():
            chain = built.context(key).chunks
            assert len(chain) == 2  # the head, then the rest
            with src.open_chain(chain) as converted, built.open_chain(chain) as direct:
                (c_head, c_rest), (d_head, d_rest) = [[v.materialize() for v in vs] for vs in (converted, direct)]
            with src.open_chain(src.context(lossless_key).chunks) as exact:
                exact_head = exact[0].materialize()
            assert all(torch.equal(a, b) for x, y in zip(c_head.layers, d_head.layers) for a, b in zip(x, y))
            assert not all(torch.equal(a, b) for x, y in zip(c_rest.layers, d_rest.layers) for a, b in zip(x, y))
            rest_ids = d_rest.token_ids.tolist()
            for prefix, want in ((d_head, d_rest), (exact_head, c_rest)):
                with torch.inference_mode():
                    layers = [(k.clone(), v.clone()) for k, v in extend(llama.handle, [prefix.layers], [rest_ids])[0]]
                with KVStore("memory://", codec="int4h") as m:
                    m.put(llama.handle.entry(d_rest.key, rest_ids, layers, start=d_rest.start))
                    with m.open_entry(d_rest.key) as view:
                        got = view.materialize()
                assert all(torch.equal(a, b) for x, y in zip(got.layers, want.layers) for a, b in zip(x, y))


def test_a_plain_sample_hints_once_that_codec_reads_the_lossy_copies(tiny_llama_dir, tmp_path, capsys):
    """Issue 45, finding 8: a sample without --codec on a store holding its contexts only under a
    lossy codec computes them again; one line on stderr says so and names ``--codec``. Not when
    it hit, nor with --codec, nor on a store without lossy copies."""
    data = write_dataset(tmp_path / "d.jsonl", range(4))
    base = ["--model", tiny_llama_dir, "--quiet", "--format", "json"]
    assert run_main(capsys, "build", data, *base, "--store", tmp_path / "s", "--codec", "int8")[0] == 0

    def hints(*args):
        code, out, err = run_main(capsys, "sample", data, *base, "-n", "3", *args)
        assert code == 0, err
        return [line for line in err.splitlines() if line.startswith("kvstore: hint:")]

    want = ("kvstore: hint: the store holds 4 of the contexts this run missed under the lossy codec int8:128/64, "
            "which a sample without --codec does not read (it computed them{}); --codec int8:128/64 reads them "
            "(lossy)")  # fmt: skip
    assert hints("--store", tmp_path / "s", "--readonly-store") == [want.format("")]
    assert hints("--store", tmp_path / "s") == [want.format(" and stored lossless copies")]
    assert hints("--store", tmp_path / "s") == []  # the lossless copies hit now
    assert hints("--store", tmp_path / "s", "--codec", "int8") == []
    assert hints("--store", tmp_path / "fresh") == []


def test_lossy_copies_counts_contexts_a_lossless_run_misses(llama, tmp_path):
    """``SampleResult.lossy_copies``: per lossy codec, the missed contexts the store holds more of
    under it; every built-in lossy codec is looked for."""
    from kvstore.model.io.chains import LOSSY_PROBES
    from kvstore.store.codecs import base

    quantizers = [r for r in base._REGISTRY.values() if r.kind == base.QUANTIZER and r.name != "none"]
    built_in = {r.name for r in quantizers if r.factory.__module__.startswith("kvstore.")}
    assert set(LOSSY_PROBES) == built_in
    contexts, questions = random_rows(llama.tokenizer, 3, 6, **ROWS)
    distinct = sorted({tuple(c) for c in contexts})
    path = str(tmp_path / "s")
    with KVStore(path, codec="int4h", chunk_tokens=8) as store:
        llama.generate_kv_cache(distinct[:2], store)
    with KVStore(path, codec="int8", chunk_tokens=8) as store:
        llama.generate_kv_cache(distinct[1:], store)
    with KVStore(path, readonly=True) as store:
        first = _sample(llama, store, contexts, questions)
        assert first.lossy_copies == {"int4h:32/64": 2, "int8:128/64": 2}
        assert first.cached_tokens == [0] * len(contexts)
    with KVStore(path) as store:
        assert _sample(llama, store, contexts, questions).lossy_copies == {"int4h:32/64": 2, "int8:128/64": 2}
        assert _sample(llama, store, contexts, questions).lossy_copies == {}  # stored whole, lossless: no miss
    with KVStore(path, codec="int8", readonly=True) as store:
        assert _sample(llama, store, contexts, questions).lossy_copies == {}  # a lossy run: not looked up
