"""Presses applied to stored dense caches: the same tokens as the press in memory without a store,
the tokens an independent implementation keeps (Hugging Face's own cache, attention weights and
``gather``, nothing of kvstore's), dense tokens at ratio 0, and never a stored byte changed.

Float64 tiny models with a wide initialization (a wrong position or a wrong token kept changes the
argmax) and contexts of random ids (no two scores tie, except where a press makes them equal on
purpose: the window tokens, StreamingLLM's ones and zeros).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.nn import functional as F

from helpers.rows import random_ids
from helpers.tiny import make_family_model, make_tiny_model
from kvstore.errors import HookError, ModelError, PressError
from kvstore.model.adapter import Adapter
from kvstore.model.press.spec import Press, parse_press
from kvstore.model.variants.variant import parse_variant
from kvstore.store.kvstore import KVStore

N_NEW = 5
LENGTHS = [96, 130, 75, 151]  # every context longer than SnapKV's 64-token window
Q_LENGTHS = [3, 1, 5, 2]
PRESSES = ["knorm", "streaming_llm", "random", "keydiff", "snapkv", "tova"]


@pytest.fixture(scope="module")
def eager():
    """A float64 llama (grouped-query: 4 query heads, 2 KV heads) with eager attention, whose
    attention weights the independent reference reads."""
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=3, attn_implementation="eager")
    return Adapter(model, tok)


@pytest.fixture(scope="module")
def rows(eager):
    return random_ids(eager.tokenizer, LENGTHS, rng=11), random_ids(eager.tokenizer, Q_LENGTHS, rng=12)


def _sweep(adapter, contexts, questions, variants, **kw):
    kw.setdefault("stop_at_eos", False)
    return adapter.sweep(contexts, questions, variants=variants, num_new_tokens=N_NEW, return_scores=True, **kw)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores))


# -- an independent implementation: Hugging Face's cache and attention weights, plain gathers ------
def _scores(press: Press, keys: torch.Tensor, attn: torch.Tensor | None, c: int, q: int) -> torch.Tensor:
    """``[kv_heads, c]`` scores of one layer from kvpress's formulas: ``keys`` ``[kv_heads, c, d]``,
    ``attn`` the layer's attention weights ``[heads, n, n]`` over context (and question)."""
    kv_heads = keys.shape[0]
    if press.method == "knorm":
        return -keys.norm(dim=-1)
    if press.method == "keydiff":
        anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)
    if press.method == "random":
        g = torch.Generator().manual_seed(0)
        return torch.rand((1, kv_heads, c), generator=g, dtype=keys.dtype)[0]
    if press.method == "streaming_llm":
        s = torch.ones(kv_heads, c)
        s[:, 4 : 4 + c - press.n_kept(c)] = 0
        return s
    assert attn is not None
    if press.question:
        rows, cols = attn[:, c : c + q, :c], c
    else:
        w = 64 if press.method == "snapkv" else 1
        rows, cols = attn[:, c - w : c, : c - w], c - w
    if press.method == "tova":
        s = rows[:, -1].mean(dim=0, keepdim=True).expand(kv_heads, cols)
    else:
        s = F.avg_pool1d(rows.mean(dim=1)[:, None], kernel_size=5, padding=2, stride=1)[:, 0]
        s = s.view(kv_heads, -1, cols).mean(dim=1)
    if cols < c:  # the window: above every other score
        s = torch.cat([s, torch.full((kv_heads, c - cols), float(s.max()) + 1, dtype=s.dtype)], dim=1)
    return s


@torch.inference_mode()
def _independent(model, ctx: list[int], q: list[int], press: Press) -> list[int]:
    """``N_NEW`` greedy tokens: the context (and question, when question-aware) prefilled by the
    model itself, the press's tokens kept per head with ``torch.gather`` on its ``DynamicCache``,
    then the question at positions ``c..`` and the answer, one row, no padding."""
    c, nq = len(ctx), len(q)
    seq = ctx + q if press.question else ctx
    out = model(input_ids=torch.tensor([seq]), use_cache=True, output_attentions=True)
    cache = out.past_key_values
    keep = press.n_kept(c)
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys[0, :, :c], layer.values[0, :, :c]
        s = _scores(press, keys, out.attentions[i][0], c, nq)
        idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :keep].sort(dim=-1).values
        kk = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))
        vv = values.gather(1, idx[..., None].expand(-1, -1, values.shape[-1]))
        if press.question:  # the question's own keys and values stay
            kk, vv = torch.cat([kk, layer.keys[0, :, c:]], 1), torch.cat([vv, layer.values[0, :, c:]], 1)
        layer.keys, layer.values = kk[None].contiguous(), vv[None].contiguous()
    if press.question:
        logits = out.logits[0, -1]
    else:
        logits = model(input_ids=torch.tensor([q]), position_ids=torch.arange(c, c + nq)[None],
                       past_key_values=cache, use_cache=True).logits[0, -1]  # fmt: skip
    tokens = []
    for t in range(N_NEW):
        nxt = int(logits.argmax())
        tokens.append(nxt)
        if t == N_NEW - 1:
            break
        logits = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[c + nq + t]]),
                       past_key_values=cache, use_cache=True).logits[0, -1]  # fmt: skip
    return tokens


SPECS = [f"{p}:0.5" for p in PRESSES] + ["snapkv:0.75", "knorm:0.25", "snapkv:0.5:q", "tova:0.5:q"]


def test_stored_answers_under_each_press_are_the_independent_implementations(eager, rows):
    contexts, questions = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        eager.build(contexts, store)
        got = _sweep(eager, contexts, questions, SPECS, store=store, batch_size=3)
    for spec in SPECS:
        press = parse_press(spec)
        want = [_independent(eager.model, c, q, press) for c, q in zip(contexts, questions)]
        assert got[spec].tokens.tolist() == want, spec
        assert got[spec].kept_tokens == [press.n_kept(len(c)) for c in contexts]


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_cached_equals_the_press_in_memory_without_a_store(kind):
    model, tok = make_tiny_model(kind, dtype=torch.float64, seed=5)
    adapter = Adapter(model, tok)
    contexts, questions = random_ids(tok, LENGTHS, rng=21), random_ids(tok, Q_LENGTHS, rng=22)
    with KVStore("memory://", chunk_tokens=40) as store:
        cold = _sweep(adapter, contexts, questions, SPECS, store=store, batch_size=4)  # computed and stored
        warm = _sweep(adapter, contexts, questions, SPECS, store=store, batch_size=3)  # loaded
    ref = _sweep(adapter, contexts, questions, SPECS, use_cache=False, batch_size=2)
    dense = _sweep(adapter, contexts, questions, ["dense"], use_cache=False, batch_size=2)["dense"]
    for spec in SPECS:
        assert all(warm[spec].cache_hit) and warm[spec].prefill_tokens_computed == 0
        for got in (cold[spec], warm[spec]):
            assert torch.equal(got.tokens, ref[spec].tokens), spec
            assert _max_diff(got, ref[spec]) < 1e-10, spec
        assert not torch.equal(ref[spec].tokens, dense.tokens) or spec.endswith(":0.25"), spec  # presses bite


def test_ratio_zero_gives_the_dense_tokens_bit_for_bit(eager, rows):
    contexts, questions = rows
    specs = ["dense", "knorm:0", "snapkv:0", "snapkv:0:q", "tova:0:q"]
    with KVStore("memory://", chunk_tokens=32) as store:
        got = _sweep(eager, contexts, questions, specs, store=store, batch_size=4)
    for spec in specs[1:]:
        assert torch.equal(got[spec].tokens, got["dense"].tokens), spec
        assert all(torch.equal(a, b) for a, b in zip(got[spec].scores, got["dense"].scores)), spec
        assert got[spec].kept_tokens == [len(c) for c in contexts]


def _digest(store: KVStore) -> dict[bytes, str]:
    """sha256 of every entry and context record (access times excluded)."""
    return {k: hashlib.sha256(store.backend.get(k) or b"").hexdigest() for p in (b"e/", b"r/")
            for k in store.backend.keys(p)}  # fmt: skip


def _contents(store: KVStore) -> dict:
    """Every context record's chunks and every entry's token ids, keys and values (bytes: what two
    stores written at other times share; their headers differ by the time of writing)."""
    out: dict = {("r", k): store.context(k).chunks for k in store.context_keys()}
    for raw in store.backend.keys(b"e/"):
        key = raw.decode()[2:]
        entry = store.get(key)
        tensors = [entry.token_ids, *(t for kv in entry.layers for t in kv)]
        out[("e", key)] = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                                                 for t in tensors)).hexdigest()  # fmt: skip
    return out


def test_a_press_never_changes_or_adds_a_stored_byte(eager, rows, tmp_path):
    contexts, questions = rows
    with KVStore(str(tmp_path / "plain")) as plain:
        eager.sample(contexts, questions, store=plain, num_new_tokens=2)
        written_by_dense = _contents(plain)
    with KVStore(str(tmp_path / "pressed")) as store:  # cold: the press run stores the dense caches
        _sweep(eager, contexts, questions, ["snapkv:0.5", "knorm:0.75"], store=store)
        cold, cold_bytes = _contents(store), _digest(store)
        _sweep(eager, contexts, questions, SPECS, store=store)  # warm: nothing written, nothing rewritten
        warm_bytes = _digest(store)
    assert cold == written_by_dense
    assert warm_bytes == cold_bytes


def test_kept_tokens_cache_bytes_and_window_tokens(eager, rows):
    contexts, questions = rows
    specs = ["dense", "snapkv:0.25", "snapkv:0.5", "snapkv:0.75", "knorm:0.5"]
    with KVStore("memory://", chunk_tokens=32) as store:
        got = _sweep(eager, contexts, questions, specs, store=store, batch_size=4)
    per_token = eager.kv_bytes_per_token()
    for spec in specs:
        kept = got[spec].kept_tokens
        assert got[spec].cache_bytes == sum(kept) * per_token
    assert got["snapkv:0.5"].cache_bytes < got["dense"].cache_bytes
    # one window forward per context, shared by every ratio (and not prefill)
    assert got["dense"].window_tokens_computed == sum(min(64, c - 1) for c in LENGTHS)
    assert all(r.prefill_tokens_computed == sum(LENGTHS) for r in got.values())  # the cold run's own prefill


def test_press_specs_have_one_printed_form_and_one_line_errors():
    assert parse_press("snapkv:.5").name == parse_press("snapkv:0.50").name == "snapkv:0.5"
    assert parse_press("snapkv:0.5:window=64").name == "snapkv:0.5"  # a default parameter is not printed
    assert parse_press("streaming_llm:0.25:n_sink=8").name == "streaming_llm:0.25:n_sink=8"
    assert parse_press(" tova:0.3:q ").name == "tova:0.3:q"
    assert parse_press("knorm:0").n_kept(10) == 10 and parse_press("knorm:0.99").n_kept(10) == 1
    assert parse_variant("snapkv:0.5+sparq:16:64").name == "snapkv:0.5+sparq:16:64"
    assert parse_variant("snapkv:0.5+sparq:16:64").press == parse_press("snapkv:0.5")
    for bad in ["snapkv", "snapkv:1", "snapkv:-0.1", "snapkv:x", "nope:0.5", "knorm:0.5:q", "snapkv:0.5:size=3",
                "snapkv:0.5:window=0", "snapkv:0.5:zz"]:  # fmt: skip
        with pytest.raises(PressError) as exc:
            parse_press(bad)
        assert "\n" not in str(exc.value)
    with pytest.raises(HookError, match="only a press"):
        parse_variant("topk:4+snapkv:0.5")


def test_score_under_a_press_from_the_store_equals_the_press_in_memory(eager, rows):
    contexts, _ = rows
    conts = random_ids(eager.tokenizer, [4, 2, 6, 3], rng=31)
    variants = ["dense", "knorm:0", "snapkv:0.5", "streaming_llm:0.5", "tova:0.75"]
    with KVStore("memory://", chunk_tokens=32) as store:
        cached = eager.score_sweep(contexts, conts, variants=variants, store=store, batch_size=3)
    ref = eager.score_sweep(contexts, conts, variants=variants, use_cache=False, batch_size=2)
    plain = eager.score(contexts, conts, use_cache=False)
    for v in variants:
        assert max(abs(a - b) for a, b in zip(cached[v].logprobs, ref[v].logprobs)) < 1e-10, v
        assert cached[v].kept_tokens == [len(c) - 1 if v.endswith(":0") or v == "dense" else
                                         parse_press(v).n_kept(len(c) - 1) for c in contexts]  # fmt: skip
    assert cached["knorm:0"].logprobs == cached["dense"].logprobs
    # the one-forward reference lays rows out otherwise, and eager attention's softmax runs in float32
    assert max(abs(a - b) for a, b in zip(cached["knorm:0"].logprobs, plain.logprobs)) < 1e-5
    assert max(abs(a - b) for a, b in zip(cached["snapkv:0.5"].logprobs, plain.logprobs)) > 1e-3
    with pytest.raises(PressError, match="question-aware"):
        eager.score(contexts, conts, press="snapkv:0.5:q")


@torch.inference_mode()
def _independent_score(model, ctx: list[int], cont: list[int], press: Press) -> float:
    """The continuation's log-likelihood with ``press`` applied to ``ctx[:-1]`` (what scoring reads of
    a context) by Hugging Face's own cache and ``torch.gather``, then ``ctx[-1] + cont[:-1]`` fed at
    positions ``c - 1 ..``."""
    head = ctx[:-1]
    c = len(head)
    out = model(input_ids=torch.tensor([head]), use_cache=True, output_attentions=True)
    cache, keep = out.past_key_values, press.n_kept(c)
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys[0], layer.values[0]
        s = _scores(press, keys, out.attentions[i][0] if out.attentions else None, c, 0)
        idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :keep].sort(dim=-1).values
        layer.keys = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))[None].contiguous()
        layer.values = values.gather(1, idx[..., None].expand(-1, -1, values.shape[-1]))[None].contiguous()
    fed = [ctx[-1], *cont[:-1]]
    logits = model(input_ids=torch.tensor([fed]), position_ids=torch.arange(c, c + len(fed))[None],
                   past_key_values=cache, use_cache=True).logits[0]  # fmt: skip
    lp = torch.log_softmax(logits, dim=-1)
    return float(lp.gather(-1, torch.tensor(cont)[:, None]).sum())


def test_scores_under_a_press_are_the_independent_implementations():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=8)
    adapter = Adapter(model, tok)
    contexts, conts = random_ids(tok, LENGTHS, rng=41), random_ids(tok, [4, 2, 6, 3], rng=42)
    specs = ["knorm:0.5", "keydiff:0.75", "streaming_llm:0.5", "random:0.25"]
    with KVStore("memory://", chunk_tokens=32) as store:
        got = adapter.score_sweep(contexts, conts, variants=specs, store=store, batch_size=3)
    for spec in specs:
        want = [_independent_score(model, c, y, parse_press(spec)) for c, y in zip(contexts, conts)]
        assert max(abs(a - b) for a, b in zip(got[spec].logprobs, want)) < 1e-10, spec


def test_presses_compose_with_decode_attention_and_lossy_codecs(eager, rows):
    contexts, questions = rows
    specs = ["snapkv:0.5+topk:8", "knorm:0.5+sparq:4:8"]
    with KVStore("memory://", chunk_tokens=32) as store:
        got = _sweep(eager, contexts, questions, specs, store=store, batch_size=4)
    ref = _sweep(eager, contexts, questions, specs, use_cache=False, batch_size=3)
    for spec in specs:
        assert torch.equal(got[spec].tokens, ref[spec].tokens) and _max_diff(got[spec], ref[spec]) < 1e-10
    # a lossy store: the press runs on what the codes decode to, on a miss (computed, reloaded) as on a hit
    for codec in ("int8", "ecq", "int4h"):
        with KVStore("memory://", codec=codec, chunk_tokens=32) as store:
            miss = _sweep(eager, contexts, questions, ["snapkv:0.5"], store=store)["snapkv:0.5"]
            hit = _sweep(eager, contexts, questions, ["snapkv:0.5"], store=store)["snapkv:0.5"]
        assert all(hit.cache_hit) and not any(miss.cache_hit), codec
        assert torch.equal(miss.tokens, hit.tokens) and _max_diff(miss, hit) == 0, codec
        assert hit.codecs[0].startswith(codec), (codec, hit.codecs[0])


def test_the_single_variant_keywords_are_a_sweep_of_one(eager, rows):
    contexts, questions = rows
    one = eager.greedy_sample(contexts, questions, N_NEW, press="snapkv:0.5", decode_attention="topk:8",
                              use_cache=False, stop_at_eos=False, return_details=True)  # fmt: skip
    swept = _sweep(eager, contexts, questions, ["snapkv:0.5+topk:8"], use_cache=False)["snapkv:0.5+topk:8"]
    assert one.variant == "snapkv:0.5+topk:8" and torch.equal(one.tokens, swept.tokens)


def test_windowed_and_recurrent_models_refuse_presses_in_one_line():
    adapter = Adapter(*make_family_model("mistral", dtype=torch.float64))
    with pytest.raises(ModelError) as exc:
        adapter.sample([[5, 6, 7, 8]], [[9]], num_new_tokens=2, press="knorm:0.5", use_cache=False)
    assert "\n" not in str(exc.value) and "presses" in str(exc.value)
