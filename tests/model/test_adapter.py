"""The exactness contract: decoding from stored caches gives the tokens of running without one.

Three independent paths are compared: ``greedy_sample(use_cache=True)`` (stored KV, left-padded,
explicit positions), ``greedy_sample(use_cache=False)`` (context + question in one right-padded
prefill) and Hugging Face's own ``generate`` on each row alone (no padding at all).
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.rows import random_ids
from helpers.tiny import make_tiny_model
from kvstore.errors import ContextTooLongError
from kvstore.model.adapter import Adapter
from kvstore.store.kvstore import KVStore

N_NEW = 10


def _rows(tokenizer, seed: int, n: int = 8):
    """Random contexts and questions of mixed lengths (a 1-token context among them), as ids."""
    rng = random.Random(seed)
    ctx_lens = [1, 2, 7, 31, 64, 5, 18, 47][:n]
    q_lens = [3, 1, 9, 4, 12, 2, 6, 5][:n]
    rng.shuffle(ctx_lens)
    contexts = random_ids(tokenizer, ctx_lens, rng)
    contexts[-1] = list(contexts[0])  # a repeated context shares one entry
    return contexts, random_ids(tokenizer, q_lens, rng)


def _hf_generate(model, ids: list[int], n: int, past=None) -> torch.Tensor:
    x = torch.tensor([ids])
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        past_key_values=past,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :]


@pytest.mark.parametrize("kind", ["neox", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cached_equals_reference_equals_generate(kind, attn, dtype):
    """Three paths that share no decoding code with each other's layout: cached (left-padded
    stored contexts), no-cache (right-padded prompts) and Hugging Face ``generate`` one row at a
    time (no padding at all). Every row's tokens agree at batch sizes 1, 3 and 8 for two seeds;
    cached and no-cache logits agree within 1e-10 (float64 SDPA) or 1e-4."""
    model, tok = make_tiny_model(kind, dtype=dtype, seed=3, attn_implementation=attn)
    adapter = Adapter(model, tok)
    for seed in (0, 1):
        contexts, questions = _rows(tok, seed)
        want = torch.stack([_hf_generate(model, c + q, N_NEW) for c, q in zip(contexts, questions)])
        with KVStore("memory://") as store:
            report = adapter.generate_kv_cache(contexts[:5], store, batch_size=3)
            assert report.built == 5 and report.skipped == 0
            for bs in (1, 3, 8):
                kw = dict(batch_size=bs, stop_at_eos=False, return_details=True, return_scores=True)
                ref = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, **kw)
                got = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=True, store=store, **kw)
                assert torch.equal(ref.tokens, want), f"no-cache vs generate, batch size {bs}, seed {seed}"
                assert torch.equal(got.tokens, want), f"cached vs generate, batch size {bs}, seed {seed}"
                tol = 1e-10 if (dtype == torch.float64 and attn == "sdpa") else 1e-4
                for a, b in zip(got.scores, ref.scores):
                    torch.testing.assert_close(a, b, atol=tol, rtol=0)
                if bs == 1:
                    # rows 0..4 and the repeat of row 0 came from the store; the others were
                    # computed, stored, and are hits for the later batch sizes
                    assert got.cache_hit == [True] * 5 + [False, False, True]
                else:
                    assert all(got.cache_hit)


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_stored_entry_drives_hf_generate(kind):
    model, tok = make_tiny_model(kind, dtype=torch.float64, seed=1)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok, 5, n=4)
    with KVStore("memory://") as store:
        report = adapter.generate_kv_cache(contexts, store)
        for i, (c, q) in enumerate(zip(contexts, questions)):
            entry = store.get(report.keys[i])
            assert entry is not None and entry.token_ids.tolist() == c
            past = entry.to_dynamic_cache()
            assert past.get_seq_length() == len(c)
            with_cache = _hf_generate(model, c + q, N_NEW, past=past)
            assert torch.equal(with_cache, _hf_generate(model, c + q, N_NEW))


def _patched_forward(model, edit):
    original = model.forward

    def forward(*args, **kwargs):
        past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.24 names it cache
        if past is not None and past.get_seq_length() > 0:
            edit(kwargs)
        return original(*args, **kwargs)

    model.forward = forward
    return original


@pytest.mark.parametrize(
    "bug",
    [
        pytest.param(lambda kw: kw.pop("position_ids"), id="no-position-ids"),
        pytest.param(lambda kw: kw.update(attention_mask=torch.ones_like(kw["attention_mask"])), id="pads-unmasked"),
    ],
)
def test_position_and_mask_bugs_would_be_caught(bug):
    """The comparison above can fail: dropping explicit positions or unmasking pads changes tokens."""
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=3)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok, 0)
    with KVStore("memory://") as store:
        adapter.generate_kv_cache(contexts, store)
        good = adapter.greedy_sample(contexts, questions, N_NEW, store=store, stop_at_eos=False)
        original = _patched_forward(model, bug)
        try:
            bad = adapter.greedy_sample(contexts, questions, N_NEW, store=store, stop_at_eos=False)
        finally:
            model.forward = original
    assert not torch.equal(good, bad)


def test_entry_does_not_depend_on_batch_mates():
    model, tok = make_tiny_model("neox", dtype=torch.float64, seed=2)
    adapter = Adapter(model, tok)
    contexts, _ = _rows(tok, 1)
    short = contexts[0]
    with KVStore("memory://") as alone, KVStore("memory://") as mixed:
        k_alone = adapter.generate_kv_cache([short], alone).keys[0]
        k_mixed = adapter.generate_kv_cache([short] + contexts[1:], mixed, batch_size=8).keys[0]
        assert k_alone == k_mixed
        a, b = alone.get(k_alone), mixed.get(k_mixed)
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        torch.testing.assert_close(ka, kb, atol=1e-12, rtol=0)
        torch.testing.assert_close(va, vb, atol=1e-12, rtol=0)


def test_build_dedupes_skips_stored_and_reports():
    model, tok = make_tiny_model("llama", seed=0)
    adapter = Adapter(model, tok)
    texts = ["the cat sat on the mat", "a dog ran home", "the cat sat on the mat", "birds fly south in winter"]
    with KVStore("memory://") as store:
        r1 = adapter.generate_kv_cache(texts, store, batch_size=2)
        assert (r1.contexts, r1.distinct, r1.built, r1.skipped) == (4, 3, 3, 0)
        assert r1.keys[0] == r1.keys[2] and len(store) == 3
        assert (
            r1.stored_bytes > 0
            and r1.raw_bytes > 0
            and r1.tokens == sum(len(adapter.encode_context(t)) for t in texts[:2] + texts[3:])
        )
        r2 = adapter.generate_kv_cache(texts + ["something new here"], store)
        assert (r2.built, r2.skipped) == (1, 3)


def test_special_tokens_bos_on_context_not_question(tiny_llama):
    model, tok = tiny_llama
    adapter = Adapter(model, tok)
    ctx = adapter.encode_context("the cat sat")
    q = adapter.encode_question(" where did it sit?")
    assert ctx[0] == tok.bos_token_id and ctx.count(tok.bos_token_id) == 1
    assert tok.bos_token_id not in q
    # chat-rendered text already holds its special tokens: no extra BOS when asked not to add them
    assert adapter.encode_context("the cat sat", special_tokens=False)[0] != tok.bos_token_id


def test_text_inputs_match_reference(tiny_model):
    model, tok = tiny_model
    adapter = Adapter(model, tok)
    contexts = ["the quick brown fox jumps over the lazy dog", "hello world", "a b c d e f g"]
    questions = [" who jumps?", " what?", " next letter is"]
    with KVStore("memory://") as store:
        cached = adapter.greedy_sample(contexts, questions, 8, store=store, batch_size=2)
        again = adapter.greedy_sample(contexts, questions, 8, store=store, batch_size=3, return_details=True)
    ref = adapter.greedy_sample(contexts, questions, 8, use_cache=False)
    assert torch.equal(cached, ref) and torch.equal(again.tokens, ref)
    assert again.cache_hit == [True, True, True]  # stored by the first call
    for i in range(3):
        ids = adapter.encode_context(contexts[i]) + adapter.encode_question(questions[i])
        gen = _hf_generate(model, ids, 8)
        stop = [j for j, t in enumerate(gen.tolist()) if t in adapter.eos_ids]
        n = stop[0] + 1 if stop else 8
        assert torch.equal(ref[i, :n], gen[:n])


def test_stop_at_eos_fills_rows_with_pad():
    model, tok = make_tiny_model("neox", dtype=torch.float64, seed=3)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok, 0, n=4)
    free = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, stop_at_eos=False)
    eos = int(free[0, 2])  # pretend the token row 0 emits third is EOS
    adapter.eos_ids = frozenset({eos})
    for use_cache in (False, True):
        out = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=use_cache, return_details=True)
        for r in range(4):
            row = free[r].tolist()
            n = row.index(eos) + 1 if eos in row else N_NEW
            assert out.tokens[r, :n].tolist() == row[:n]
            assert (out.tokens[r, n:] == adapter.pad_id).all()
            assert out.lengths[r] == n
    assert adapter.decode(out.tokens[0]) == tok.decode(free[0, :2].tolist(), skip_special_tokens=True)


def test_context_too_long_names_row_or_truncates(tiny_llama):
    model, tok = tiny_llama
    adapter = Adapter(model, tok)
    positions = model.config.max_position_embeddings
    limit = adapter.context_limit()
    assert limit == positions - adapter.reserve_tokens
    long_ids = [10 + i % 50 for i in range(limit + 5)]
    with KVStore("memory://") as store:
        with pytest.raises(ContextTooLongError, match="row 1"):
            adapter.generate_kv_cache([[11, 12], long_ids], store)
        assert len(store) == 0  # checked before computing anything
        report = adapter.generate_kv_cache([[11, 12], long_ids], store, truncate=True)
        assert store.get(report.keys[1]).token_ids.tolist() == long_ids[-limit:]
        # sample truncates the same way, so the truncated context is a hit
        got = adapter.greedy_sample([long_ids], [[5, 6]], 3, store=store, truncate=True, return_details=True)
        assert got.cache_hit == [True]
        report = adapter.generate_kv_cache([long_ids], store, skip_errors=True, labels=["data.jsonl:7"])
        assert report.failed == 1 and "data.jsonl:7" in report.errors[0]
        # a context that fits but leaves no room for question + answer is named too
        roomy = Adapter(model, tok, reserve_tokens=0)
        with pytest.raises(ContextTooLongError, match="row 0"):
            roomy.greedy_sample([long_ids[:1] * (positions - 2)], [[5, 6, 7]], 4, store=store)


def test_without_store_computes_in_memory():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=4)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok, 2, n=5)
    got = adapter.greedy_sample(contexts, questions, N_NEW, store=None, return_details=True, stop_at_eos=False)
    assert got.cache_hit == [False] * 5
    ref = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, stop_at_eos=False)
    assert torch.equal(got.tokens, ref)


def test_bad_arguments():
    model, tok = make_tiny_model("neox")
    adapter = Adapter(model, tok)
    with pytest.raises(ValueError):
        adapter.greedy_sample([[5]], [[6]], 0)
    with pytest.raises(ValueError):
        adapter.greedy_sample([[5]], [[6], [7]], 3)
    with KVStore("memory://") as store, pytest.raises(ValueError):
        adapter.generate_kv_cache([[5]], store, batch_size=0)


def test_fingerprint_separates_weights_and_dtype():
    m1, tok = make_tiny_model("llama", seed=0)
    m2, _ = make_tiny_model("llama", seed=0)
    m3, _ = make_tiny_model("llama", seed=1)
    m4, _ = make_tiny_model("llama", seed=0, dtype=torch.float64)
    a1, a2, a3, a4 = (Adapter(m, tok) for m in (m1, m2, m3, m4))
    assert a1.fingerprint == a2.fingerprint
    assert len({a1.fingerprint, a3.fingerprint, a4.fingerprint}) == 3
    ids = [5, 6, 7]
    assert a1.key(ids) == a2.key(ids) and len({a1.key(ids), a3.key(ids), a4.key(ids)}) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_matches_cpu():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=3)
    cpu = Adapter(model, tok)
    contexts, questions = _rows(tok, 0)
    want = cpu.greedy_sample(contexts, questions, N_NEW, use_cache=False, stop_at_eos=False)
    gpu = Adapter(model.to("cuda"), tok)
    with KVStore("memory://") as store:
        gpu.generate_kv_cache(contexts, store)
        got = gpu.greedy_sample(contexts, questions, N_NEW, store=store, stop_at_eos=False)
    assert torch.equal(got, want)


def test_real_model_cached_equals_no_cache(real_model):
    """The bundled SmolLM2-135M-Instruct, float32, chat prompts, 8 distinct demo contexts of ~70
    and ~330 tokens (so batches pad for real): every row's tokens equal the no-cache path's, and
    the step-1 logits agree within 1e-4, at batch sizes 1, 3 and 8."""
    from helpers.data import padded_demo_rows
    from kvstore.data.prompts import PromptFormat

    adapter = Adapter(
        real_model.model, real_model.tokenizer, name=real_model.name, weight_files=real_model.weight_files
    )
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    rows = padded_demo_rows(8)
    contexts = [fmt.context_part(r["context"]) for r in rows]
    questions = [fmt.question_part(r["question"]) for r in rows]
    lengths = sorted({len(adapter.encode_context(c, special_tokens=False)) for c in contexts})
    assert len(lengths) >= 4 and lengths[-1] > 2 * lengths[0]  # the test needs real padding
    kw = dict(special_tokens=fmt.add_special_tokens, return_details=True, return_scores=True, stop_at_eos=False)
    ref = adapter.greedy_sample(contexts, questions, 12, use_cache=False, batch_size=8, **kw)
    with KVStore("memory://") as store:
        adapter.generate_kv_cache(contexts, store, special_tokens=fmt.add_special_tokens, batch_size=3)
        for bs in (1, 3, 8):
            cached = adapter.greedy_sample(contexts, questions, 12, store=store, batch_size=bs, **kw)
            assert all(cached.cache_hit)
            for i in range(len(rows)):
                assert cached.tokens[i].tolist() == ref.tokens[i].tolist(), f"batch size {bs}, row {rows[i]['id']}"
                torch.testing.assert_close(cached.scores[i][0], ref.scores[i][0], atol=1e-4, rtol=0)
    answers = [adapter.decode(t) for t in cached.tokens]
    assert any(r["answers"][0].lower() in a.lower() for r, a in zip(rows, answers))  # it reads the context


def test_build_rebuilds_corrupt_entries_and_counts_saved_tokens():
    import warnings

    model, tok = make_tiny_model("llama", seed=0)
    adapter = Adapter(model, tok)
    contexts = [[10 + i] * (20 + i) for i in range(3)]
    with KVStore("memory://") as store:
        keys = adapter.generate_kv_cache(contexts, store).keys
        raw = bytearray(store.backend.get(b"e/" + keys[1].encode()))
        raw[len(raw) // 2] ^= 0xFF
        store.backend.put(b"e/" + keys[1].encode(), bytes(raw))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            again = adapter.generate_kv_cache(contexts, store)
        assert (again.built, again.skipped) == (1, 2)
        assert all(store.is_intact(k) for k in keys)
        # two questions per context: the no-cache path would prefill every row's context
        got = adapter.greedy_sample(contexts * 2, [[7, 8]] * 6, 2, store=store, batch_size=4, return_details=True)
        assert got.prefill_tokens_computed == 0 and got.prefill_tokens_saved == 2 * sum(map(len, contexts))
