"""Scoring (``Adapter.score`` / ``score_rolling``): cached == no-cache == a plain Hugging Face forward.

Every comparison is against ``model(input_ids=[context + continuation])`` run one row at a time
(no padding, no cache, no kvstore code): float64 within 1e-10, float32 within 1e-4, ``is_greedy``
identical. Contexts are chains of 8-token chunks hitting at different depths (stored whole, a
stored prefix extended, nothing stored), several continuations share a context, continuations
have 1 to 9 tokens. Tiny models use ``initializer_range`` 0.3 (see tests/tiny.py), so a wrong
position, mask or gather moves the log-probs far past the tolerances.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.tiny import CORPUS, make_family_model, make_tiny_model
from kvstore.errors import ContextTooLongError, DatasetError, HookError, ModelError
from kvstore.model.adapter import Adapter
from kvstore.model.pipelines.score import encode_pair, prefix_token_id, rolling_windows
from kvstore.store.kvstore import KVStore

CHUNK = 8
F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-10, F32: 1e-4}
# transformers' eager attention takes its softmax in float32 even for a float64 model, so under
# eager float64 any other layout (padding, a masked slot) moves the sums by ~1e-6 (the unpadded
# no-cache row matches the plain forward to 1e-14): float32-level agreement is all it can give
EAGER_F64_TOL = 1e-5


def _hf_score(model, ctx, cont):
    """Plain Hugging Face: one forward over context + continuation, log_softmax, gather."""
    logits = model(input_ids=torch.tensor([list(ctx) + list(cont)])).logits[0]
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, F32)), dim=-1)
    rows = lp[len(ctx) - 1 : len(ctx) - 1 + len(cont)]
    t = torch.tensor(cont)
    return float(rows.gather(-1, t[:, None]).double().sum()), bool((rows.argmax(-1) == t).all())


def _rows(tok, model, seed: int = 0):
    """Contexts of 1..31 tokens: rows 5 and 6 extend row 3 and the first two chunks of row 2
    (partial hits once rows 0-4 are stored), rows 7-9 repeat rows 0 and 2 with other
    continuations (the options of one question); row 10's continuation is the model's greedy one."""
    g = torch.Generator().manual_seed(seed)
    vocab = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    pick = lambda n: [vocab[int(i)] for i in torch.randint(len(vocab), (n,), generator=g)]  # noqa: E731
    contexts = [pick(n) for n in (1, 7, 31, 12, 3)]
    contexts += [contexts[3] + pick(9), contexts[2][:16] + pick(5), contexts[0], contexts[2], contexts[2]]
    conts = [pick(n) for n in (3, 1, 5, 2, 9, 6, 1, 2, 4, 1)]
    greedy = model.generate(
        input_ids=torch.tensor([contexts[1]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, len(contexts[1]) :].tolist()  # fmt: skip
    return contexts + [contexts[1]], conts + [greedy]


def _check(result, want, dtype, attn="sdpa"):
    tol = EAGER_F64_TOL if (dtype, attn) == (F64, "eager") else TOL[dtype]
    got = [(r.logprob, r.is_greedy) for r in result.rows]
    for i, ((lp, greedy), (w_lp, w_greedy)) in enumerate(zip(got, want)):
        assert abs(lp - w_lp) <= tol, f"row {i}: {lp} vs {w_lp}"
        assert greedy == w_greedy, f"row {i}"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_cached_equals_no_cache_equals_hf_forward(kind, dtype, attn):
    model, tok = make_tiny_model(kind, dtype=dtype, attn_implementation=attn)
    adapter = Adapter(model, tok)
    contexts, conts = _rows(tok, model)
    want = [_hf_score(model, c, y) for c, y in zip(contexts, conts)]
    assert want[-1][1] and not all(w[1] for w in want)  # a greedy row and non-greedy ones
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        adapter.generate_kv_cache(contexts[:5], store)
        for bs in (1, 3, 8):
            got = adapter.score(contexts, conts, store=store, batch_size=bs, token_logprobs=True)
            _check(got, want, dtype, attn)
            if bs == 1:  # rows 5 and 6 extended stored prefixes (row 3 whole; two chunks of row 2)
                assert [r.cached_tokens for r in got.rows][:7] == [1, 7, 31, 12, 3, 12, 16]
                assert got.prefill_tokens_computed == 9 + 5
            else:  # the batch-size-1 run stored everything
                assert [r.cached_tokens for r in got.rows] == [len(c) for c in contexts]
                assert got.prefill_tokens_computed == 0
            assert got.prefill_tokens_saved == sum(map(len, contexts)) - got.prefill_tokens_computed
            for r, y in zip(got.rows, conts):
                assert r.n_tokens == len(y) and r.token_logprobs is not None and len(r.token_logprobs) == len(y)
                assert abs(sum(r.token_logprobs) - r.logprob) <= 1e-9
            ref = adapter.score(contexts, conts, use_cache=False, batch_size=bs)
            _check(ref, want, dtype, attn)
            assert ref.prefill_tokens_computed == sum(map(len, contexts)) and ref.prefill_tokens_saved == 0


def test_options_of_one_context_compute_it_once(tiny_llama, monkeypatch):
    import time

    from kvstore.model.io.writer import Writer

    write = Writer._write

    def slow_write(self, *args, **kwargs):  # a slow store: a batch must wait for what the previous one stored
        time.sleep(0.3)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(Writer, "_write", slow_write)
    adapter = Adapter(*tiny_llama)
    ctx = CORPUS[0]
    options = [" The dog sleeps", " The fox runs", " Paris", " eight legs"]
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        cold = adapter.score([ctx] * 4, options, store=store, batch_size=8)
        n = len(adapter.encode_context(ctx))
        assert cold.prefill_tokens_computed == n and cold.prefill_tokens_saved == 3 * n
        warm = adapter.score([ctx] * 4, options, store=store, batch_size=2)  # split over two batches
        assert warm.prefill_tokens_computed == 0 and [r.cached_tokens for r in warm.rows] == [n] * 4
        assert warm.logprobs == cold.logprobs
        # split over batches while cold: the second part loads what the first stored
        fresh = adapter.score([CORPUS[1]] * 4, options, store=store, batch_size=2)
        assert fresh.prefill_tokens_computed == len(adapter.encode_context(CORPUS[1]))
    without_store = adapter.score([ctx] * 4, options, batch_size=8)  # cached layout, in memory
    assert without_store.prefill_tokens_computed == n
    for a, b in zip(without_store.logprobs, cold.logprobs):
        assert abs(a - b) <= 1e-4


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_text_is_split_the_way_lm_eval_splits_it(kind):
    """lm-eval's ``_encode_pair``: trailing whitespace of the context moves to the continuation;
    continuation ids = ids(context + continuation)[len(ids(context)):]. When the continuation's
    first characters merge with the context's last token ("Par" + "is" -> "Paris"), the context
    keeps its own ids and the continuation gets what is left of the whole's."""
    model, tok = make_tiny_model(kind, dtype=F64)
    adapter = Adapter(model, tok)
    enc = lambda s: adapter.encode_context(s)  # noqa: E731
    context, continuation = "The capital of France is Par", "is. Paris is in France."
    ctx, cont = encode_pair(adapter, context, continuation)
    whole = enc(context + continuation)
    assert ctx == enc(context) and cont == whole[len(ctx) :]
    assert whole[: len(ctx)] != ctx  # the tokens do merge: the split is not a plain concatenation
    ctx2, cont2 = encode_pair(adapter, "Question: how many legs does a spider have? Answer: ", "eight")
    assert ctx2 == enc("Question: how many legs does a spider have? Answer:")
    assert cont2 == enc("Question: how many legs does a spider have? Answer: eight")[len(ctx2) :]
    # an empty context is scored from the BOS (or EOS) token; ids are used as given
    head = prefix_token_id(adapter)
    assert head == tok.bos_token_id
    assert encode_pair(adapter, "", " Paris") == ([head], adapter.encode_question(" Paris"))
    assert encode_pair(adapter, [], [head, 7, 8]) == ([head], [7, 8])
    assert encode_pair(adapter, " \n", "x") == ([head], adapter.encode_question(" \nx"))  # whitespace moves
    assert encode_pair(adapter, [5, 6], [7]) == ([5, 6], [7])
    # the scores are those of exactly these ids, cached and not
    want = _hf_score(model, ctx, cont)
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        for use_cache in (True, False):
            got = adapter.score([context, ""], [continuation, " Paris"], store=store, use_cache=use_cache)
            assert abs(got.rows[0].logprob - want[0]) <= 1e-10
            assert abs(got.rows[1].logprob - _hf_score(model, [head], adapter.encode_question(" Paris"))[0]) <= 1e-10


def test_rolling_windows_follow_lm_eval():
    # lm-eval's docstring example, in disjoint form (context_len 1): tokens 0..8, max_len 3
    assert rolling_windows(list(range(9)), 99, 3) == [([99], [0, 1, 2]), ([2], [3, 4, 5]), ([5], [6, 7, 8])]
    # a last, shorter window takes preceding tokens as context up to max_len positions
    assert rolling_windows(list(range(7)), 99, 3) == [([99], [0, 1, 2]), ([2], [3, 4, 5]), ([3, 4, 5], [6])]
    assert rolling_windows([4], 99, 3) == [([99], [4])]
    assert rolling_windows([], 99, 3) == []
    for n in range(1, 20):
        for m in range(1, 6):
            windows = rolling_windows(list(range(n)), 99, m)
            assert [t for _, y in windows for t in y] == list(range(n))
            assert all(len(c) + len(y) - 1 <= m for c, y in windows)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_rolling_equals_hf_and_a_second_run_computes_no_context(kind, dtype):
    model, tok = make_tiny_model(kind, dtype=dtype)
    adapter = Adapter(model, tok)
    docs = [" ".join(CORPUS[:3]), CORPUS[3], "x"]
    head = prefix_token_id(adapter)
    for max_length in (None, 16):
        want = []
        for doc in docs:
            ids = tok(doc, add_special_tokens=False)["input_ids"]
            want.append(sum(_hf_score(model, c, y)[0] for c, y in rolling_windows(ids, head, max_length or 512)))
        with KVStore("memory://", chunk_tokens=CHUNK) as store:
            first = adapter.score_rolling(docs, store=store, max_length=max_length, batch_size=3)
            second = adapter.score_rolling(docs, store=store, max_length=max_length, batch_size=3)
            ref = adapter.score_rolling(docs, use_cache=False, max_length=max_length)
            for got in (first, second, ref):
                assert [abs(r.logprob - w) <= TOL[dtype] * 10 for r, w in zip(got, want)] == [True] * 3
            assert [r.n_tokens for r in first] == [len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs]
            assert all(r.cached_tokens == r.context_tokens for r in second)
            assert second.prefill_tokens_computed == 0 < first.prefill_tokens_computed
            assert second.prefill_tokens_saved == sum(r.context_tokens for r in second)
            assert first[0].windows == (1 if max_length is None else -(-first[0].n_tokens // 16))
            # the document's first window was stored as a chain ([head] + its tokens): a question about
            # the document loads that much
            ids = [head] + tok(docs[1], add_special_tokens=False)["input_ids"]
            hit = adapter.greedy_sample([ids], [[5]], 2, store=store, return_details=True)
            assert hit.cached_tokens == [len(ids) if max_length is None else 1 + max_length]
    r = first[1]
    assert r.n_chars == len(docs[1]) and r.bits_per_char is not None
    assert abs(r.perplexity - torch.exp(torch.tensor(-r.logprob / r.n_tokens, dtype=F64)).item()) < 1e-6 * r.perplexity


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_context_wraps_only_the_continuation_forwards(tiny_neox, use_cache):
    model, tok = tiny_neox
    adapter = Adapter(model, tok)
    state = {"on": False}
    seen: list[tuple[bool, int]] = []

    @contextlib.contextmanager
    def hooked(m):
        assert m is model
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False

    handle = model.register_forward_pre_hook(lambda mod, args, kw: seen.append((state["on"], kw["input_ids"].shape[1])),
                                             with_kwargs=True)  # fmt: skip
    try:
        adapter.kv_shapes()
        seen.clear()
        with KVStore("memory://", chunk_tokens=CHUNK) as store:
            adapter.score([CORPUS[0]] * 2, [" a", " b c"], store=store if use_cache else None, use_cache=use_cache,
                          generation_context=hooked)  # fmt: skip
    finally:
        handle.remove()
    n = len(adapter.encode_context(CORPUS[0]))
    assert (False, n) in seen  # the context's prefill, outside
    assert [s for s in seen if s[0]] == [(True, 1 + 2)]  # the one scoring forward, inside


def test_bad_rows_get_one_line_naming_them(tiny_neox):
    adapter = Adapter(*tiny_neox)
    with pytest.raises(DatasetError, match=r"^q7: the continuation is empty"):
        adapter.score(["a", "b"], [" x", ""], labels=["q6", "q7"])
    with pytest.raises(ValueError, match="2 contexts but 1 continuations"):
        adapter.score(["a", "b"], [" x"])
    long = list(range(5, 300)) * 2  # 590 ids, 512 positions
    with pytest.raises(ContextTooLongError, match=r"^row 0: context \(590\) \+ continuation \(3\)"):
        adapter.score([long], [[7, 8, 9]])
    # truncate: lm-eval's rule, the last max_positions + 1 tokens of context + continuation
    got = adapter.score([long], [[7, 8, 9]], truncate=True, use_cache=False)
    want = adapter.score([long[-(512 + 1 - 3) :]], [[7, 8, 9]], use_cache=False)
    assert got.logprobs == want.logprobs
    with pytest.raises(ContextTooLongError):
        adapter.score([[5]], [list(range(5, 600))], truncate=True)


def test_windowed_models_are_scored_without_the_cache_or_refused_with_it():
    model, tok = make_family_model("mistral", dtype=F64)
    adapter = Adapter(model, tok)
    contexts, conts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6]], [[15, 16, 17], [20]]
    with pytest.raises(ModelError, match=r"mistral\) has sliding-window, chunked or state layers"):
        adapter.score(contexts, conts)
    got = adapter.score(contexts, conts, use_cache=False, batch_size=2)
    for r, c, y in zip(got.rows, contexts, conts):
        assert abs(r.logprob - _hf_score(model, c, y)[0]) <= 1e-10


def test_half_precision_log_softmax_runs_in_float32(tiny_llama):
    """16-bit logits are upcast before log_softmax: per-token log-probs come back as float32 values
    (not bfloat16's 8-bit mantissa), and the cached path stays close to the no-cache one."""
    model, tok = tiny_llama
    adapter = Adapter(model.to(torch.bfloat16), tok)
    contexts, conts = [CORPUS[0], CORPUS[1]], [" The dog sleeps", " Paris"]
    cached = adapter.score(contexts, conts, token_logprobs=True)
    ref = adapter.score(contexts, conts, use_cache=False, token_logprobs=True)
    values = [x for r in ref.rows for x in (r.token_logprobs or ())]
    assert values and all(torch.isfinite(torch.tensor(values)))
    assert any(float(torch.tensor(x, dtype=torch.bfloat16)) != x for x in values)  # not rounded to bf16
    for a, b in zip(cached.rows, ref.rows):
        assert abs(a.logprob - b.logprob) < 0.5 * a.n_tokens


def test_a_batch_out_of_memory_runs_again_in_halves():
    model, tok = make_tiny_model("neox", dtype=F64)
    adapter = Adapter(model, tok)
    contexts, conts = _rows(tok, model)
    want = [_hf_score(model, c, y) for c, y in zip(contexts, conts)]
    forward = model.forward
    sizes: list[int] = []

    def small_batches_only(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return forward(*args, **kwargs)

    model.forward = small_batches_only
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        for use_cache in (True, False):
            sizes.clear()
            got = adapter.score(contexts, conts, store=store, use_cache=use_cache, batch_size=8)
            _check(got, want, F64)
            assert max(sizes) > 2 and sizes[-1] <= 2  # it ran out, then ran in halves


def test_a_lossy_store_scores_from_what_it_stored(tiny_llama):
    """With a lossy codec the first run already scores from the values the stored codes decode to
    (as every later run will): cold and warm agree exactly, and stay near the lossless scores."""
    adapter = Adapter(*tiny_llama)
    contexts, conts = [CORPUS[0], CORPUS[0], CORPUS[2]], [" The dog", " The fox runs", " eight legs"]
    exact = adapter.score(contexts, conts, use_cache=False)
    with KVStore("memory://", chunk_tokens=CHUNK, codec="int8") as store:
        cold = adapter.score(contexts, conts, store=store)
        warm = adapter.score(contexts, conts, store=store)
    assert warm.prefill_tokens_computed == 0 and warm.logprobs == cold.logprobs
    assert cold.logprobs != exact.logprobs
    assert all(abs(a - b) < 0.1 * abs(b) for a, b in zip(cold.logprobs, exact.logprobs))


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_split_matches_lm_eval_itself(kind):
    """Where lm-eval is installed (the eval extra): its own ``_encode_pair`` and empty-context rule,
    run on the same tokenizer, give the ids ``encode_pair(..., special_tokens=False)`` gives."""
    model_api = pytest.importorskip("lm_eval.api.model")
    model, tok = make_tiny_model(kind, dtype=F64)
    adapter = Adapter(model, tok)

    class Like:  # what TemplateLM._encode_pair reads from its instance
        backend = "causal"

        @staticmethod
        def tok_encode(text, add_special_tokens=None):
            return tok(text, add_special_tokens=False)["input_ids"]

    pairs = [("The capital of France is Par", "is."), ("Question: how many legs? Answer: ", "eight"),
             ("def add(x, y):\n   ", " return x + y"), ("hello there!", "\nassistant: Hi!")]  # fmt: skip
    for context, continuation in pairs:
        want = model_api.TemplateLM._encode_pair(Like(), context, continuation)
        assert encode_pair(adapter, context, continuation, special_tokens=False) == tuple(want)


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_decode_attention_scores_agree_cached_and_without_cache(kind):
    """Top-k attention over the continuation forwards: cold, warm and no-cache runs give the same
    scores (the reference splits like the cached path), and they differ from dense scores, so the
    attention really ran; the store holds what a dense run stores (a later dense run hits it)."""
    model, tok = make_tiny_model(kind, dtype=F64, seed=7)
    adapter = Adapter(model, tok)
    contexts, conts = _rows(tok, model, seed=3)
    dense = adapter.score(contexts, conts, use_cache=False)
    ref = adapter.score(contexts, conts, use_cache=False, decode_attention="topk:2")
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        cold = adapter.score(contexts, conts, store=store, decode_attention="topk:2")
        warm = adapter.score(contexts, conts, store=store, decode_attention="topk:2")
        after = adapter.score(contexts, conts, store=store)
    assert warm.prefill_tokens_computed == 0 and after.prefill_tokens_computed == 0
    for got in (cold, warm):
        for i, (a, b) in enumerate(zip(got.logprobs, ref.logprobs)):
            assert abs(a - b) <= TOL[F64], f"row {i}: {a} vs {b}"
    assert max(abs(a - b) for a, b in zip(ref.logprobs, dense.logprobs)) > 1e-6
    for i, (a, b) in enumerate(zip(after.logprobs, dense.logprobs)):
        assert abs(a - b) <= TOL[F64], f"row {i}: {a} vs {b}"


def test_a_bad_decode_attention_spec_is_one_line(tiny_llama):
    adapter = Adapter(*tiny_llama)
    with pytest.raises(HookError) as err:
        adapter.score(["a b"], [" c"], use_cache=False, decode_attention="topk:zero")
    assert "\n" not in str(err.value)


def test_score_sweep_equals_separate_runs_from_one_load(tiny_llama):
    adapter = Adapter(*tiny_llama)
    contexts, conts = [CORPUS[0]] * 3 + [CORPUS[1]], [" a", " b c", " d", " e f"]
    variants = ["dense", "topk:2", "sparq:2:3"]
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        swept = adapter.score_sweep(contexts, conts, variants=variants, store=store)
    assert list(swept) == variants and [r.variant for r in swept.values()] == variants
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        one = adapter.score(contexts, conts, store=store)
    assert {r.prefill_tokens_computed for r in swept.values()} == {one.prefill_tokens_computed}  # computed once
    for v in variants:
        alone = adapter.score(contexts, conts, use_cache=False, decode_attention=v)
        assert swept[v].logprobs == pytest.approx(alone.logprobs, abs=1e-4), v
    with pytest.raises(HookError):
        adapter.score_sweep(contexts, conts, variants=["topk:2", "topk:2"])


def test_a_hooked_rolling_run_stores_no_hooked_keys_and_values():
    """Rolling scoring stores a document's first window from its scoring forward; under a hook that
    forward's keys and values are not the model's, so nothing is kept: a later request starting with
    the document scores as without any cache."""
    model, tok = make_tiny_model("llama", dtype=F64, seed=11)
    adapter = Adapter(model, tok)
    doc = CORPUS[2]
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        adapter.score_rolling([doc], store=store, decode_attention="topk:2")
        ids = [prefix_token_id(adapter)] + adapter.encode_question(doc)
        got = adapter.score([ids], [" and"], store=store)
    want = adapter.score([ids], [" and"], use_cache=False)
    assert abs(got.logprobs[0] - want.logprobs[0]) <= TOL[F64]


def test_scoring_loads_the_next_batch_ahead_and_counts_the_wait(tiny_llama, monkeypatch):
    """With a store, each batch's load after the first runs on the loader thread while the batch
    before it scores (as sampling's does), the scores equal those of loads made in turn, and the
    time scoring waited for them is reported (here each load is made to take 0.3 s longer)."""
    import threading
    import time

    from kvstore.model.pipelines import score as score_mod

    adapter = Adapter(*tiny_llama)
    contexts = [CORPUS[i % len(CORPUS)] for i in range(3)]
    conts = [" a", " b c", " d"]
    with KVStore("memory://", chunk_tokens=16) as store:
        adapter.score(contexts, conts, store=store, batch_size=1)  # stored
        in_turn = adapter.score(contexts, conts, store=store, batch_size=1)
        threads: list[str] = []
        real_load = score_mod.load

        def slow_load(*args):
            threads.append(threading.current_thread().name)
            time.sleep(0.3)
            return real_load(*args)

        monkeypatch.setattr(score_mod, "load", slow_load)
        ahead = adapter.score(contexts, conts, store=store, batch_size=1)
    assert len(threads) == 2 and all(t.startswith("kvstore-load") for t in threads), threads
    assert [r.logprob for r in ahead.rows] == [r.logprob for r in in_turn.rows]
    assert ahead.load_wait_seconds >= 0.2, "the wait for the loads done ahead was not counted"
    assert in_turn.load_wait_seconds < ahead.load_wait_seconds
