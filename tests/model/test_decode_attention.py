"""Decode-time attention functions (topk, sparq, plug-ins) and the model running under them.

The functions are checked against a loop-by-loop reference written from the definitions (per
batch row, query head and query: gather the allowed keys, pick, softmax), on grouped-query shapes
with pads whose keys would win every top-k if they were let in; and end to end: K at least the
context gives the dense logits (float64, 1e-10), small K still gives cached == no-cache and
batched == alone (pads never selected).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from helpers.hooks import max_diff as _max_diff
from helpers.hooks import sample as _sample
from helpers.hooks import tiny_adapter as _adapter
from kvstore.errors import HookError
from kvstore.model.variants import sparse
from kvstore.model.variants.hooks import attention_context
from kvstore.model.variants.variant import parse_attention
from kvstore.store.kvstore import KVStore


# -- the functions against a reference written from the definitions --------------------------------
def _ref_attention(q, k, v, ok, scale, pick):
    """``pick(q_vec, keys) -> (chosen index tensor, alpha or None, mean weight)`` per query; the
    output as the definitions say, with python loops over batch, head and query."""
    B, H, Lq, D = q.shape
    groups = H // k.shape[1]
    out = torch.zeros(B, Lq, H, D, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // groups], v[b, h // groups]
            for i in range(Lq):
                valid = ok[b, 0, i].nonzero().flatten()
                if len(valid) == 0:
                    continue
                keys, vals = kh[valid], vh[valid]
                chosen, alpha = pick(q[b, h, i], keys)
                w = torch.softmax((keys[chosen] @ q[b, h, i]) * scale, -1)
                y = w @ vals[chosen]
                if alpha is not None:
                    y = alpha * y + (1 - alpha) * vals.mean(0)
                out[b, i, h] = y
    return out


def _topk_pick(K):
    def pick(qv, keys):
        return torch.topk(keys @ qv, min(K, len(keys))).indices, None

    return pick


def _sparq_pick(R, K):
    def pick(qv, keys):
        comp = torch.topk(qv.abs(), R).indices
        temp = math.sqrt(len(qv) * float(qv[comp].abs().sum() / qv.abs().sum()))
        s_hat = torch.softmax((keys[:, comp] @ qv[comp]) / temp, -1)
        chosen = torch.topk(s_hat, min(K, len(keys))).indices
        return chosen, s_hat[chosen].sum()

    return pick


def _inputs(seed=0, B=3, H=4, H_kv=2, Lq=3, S=20, D=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    ok = torch.ones(B, 1, Lq, S, dtype=torch.bool)
    ok[1, :, :, :7] = False  # a left-padded row
    ok[2, :, :, 5:9] = False  # a hole (pads between context and question)
    for i in range(Lq):  # causal over the last Lq slots
        ok[:, :, i, S - Lq + i + 1 :] = False
    # pads whose keys align with every query: they would top any ranking if not masked
    big = q.mean(dim=(1, 2))[:, None, None, :] * 50
    k[1, :, :7] = big[1]
    k[2, :, 5:9] = big[2]
    v[1, :, :7] = 1e3
    v[2, :, 5:9] = 1e3
    return q, k, v, ok


class _Module(torch.nn.Module):
    pass


@pytest.mark.parametrize("K", [1, 3, 8, 100])
def test_topk_matches_reference(K):
    q, k, v, ok = _inputs()
    got, _ = sparse.topk_attention(K)(_Module(), q, k, v, ok, scaling=0.3)
    ref = _ref_attention(q, k, v, ok, 0.3, _topk_pick(K))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("R,K", [(1, 1), (2, 5), (4, 8), (8, 3), (8, 100)])
def test_sparq_matches_reference(R, K):
    q, k, v, ok = _inputs(seed=1)
    got, _ = sparse.sparq_attention(R, K)(_Module(), q, k, v, ok, scaling=8**-0.5)
    ref = _ref_attention(q, k, v, ok, 8**-0.5, _sparq_pick(R, K))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_pads_never_selected_and_never_averaged():
    q, k, v, ok = _inputs()
    for fn in (sparse.topk_attention(2), sparse.sparq_attention(2, 2)):
        got, _ = fn(_Module(), q, k, v, ok, scaling=0.3)
        assert got[1:].abs().max() < 100  # a pad value (1e3) with any weight would show


def test_mask_forms_agree():
    q, k, v, ok = _inputs()
    additive = torch.zeros(ok.shape, dtype=q.dtype).masked_fill(~ok, torch.finfo(q.dtype).min)
    for fn in (sparse.topk_attention(3), sparse.sparq_attention(2, 3)):
        a, _ = fn(_Module(), q, k, v, ok, scaling=0.3)
        b, _ = fn(_Module(), q, k, v, additive, scaling=0.3)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        causal = torch.ones_like(ok)
        for i in range(q.shape[2]):
            causal[:, :, i, k.shape[2] - q.shape[2] + i + 1 :] = False
        c, _ = fn(_Module(), q, k, v, None, scaling=0.3)
        d, _ = fn(_Module(), q, k, v, causal, scaling=0.3)
        torch.testing.assert_close(c, d, rtol=0, atol=1e-12)


def test_a_query_with_nothing_to_see_gets_zeros_not_nan():
    q, k, v, ok = _inputs()
    ok[0, :, 0] = False
    for fn in (sparse.topk_attention(3), sparse.sparq_attention(2, 3)):
        got, _ = fn(_Module(), q, k, v, ok, scaling=0.3)
        assert not got.isnan().any()
        assert (got[0, 0] == 0).all()


# -- specs and plug-ins ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", ["topk", "topk:0", "topk:x", "topk:4:4", "sparq:8", "sparq:0:4", "bogus", "nosuchmodule:fn", "json:nope"]
)
def test_bad_specs_are_one_line(spec):
    with pytest.raises(HookError) as exc:
        parse_attention(spec)
    assert "\n" not in str(exc.value)


def test_plugin_by_path(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def plain(module, query, key, value, attention_mask, **kwargs):
        calls.append(query.shape)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    mod = types.ModuleType("kvstore_test_plugin")
    mod.plain = plain  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvstore_test_plugin", mod)
    adapter = _adapter()
    contexts, questions = _rows()
    dense = _sample(adapter, contexts, questions, use_cache=False)
    for spec in ("kvstore_test_plugin:plain", "kvstore_test_plugin.plain"):
        calls.clear()
        got = _sample(adapter, contexts, questions, use_cache=False, decode_attention=spec)
        assert torch.equal(got.tokens, dense.tokens)
        assert _max_diff(got, dense) < 1e-10
        assert calls and all(s[2] <= max(map(len, questions)) for s in calls)  # never the context's prefill


# -- the model under them ----------------------------------------------------------------------------
def _rows(seed: int = 0, lengths=(30, 12, 45, 30)):
    g = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in lengths]
    questions = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (3, 5, 1, 4)[: len(lengths)]]
    return contexts, questions


@pytest.mark.parametrize("kind", ["llama", "neox"])
@pytest.mark.parametrize("spec", ["topk:64", "sparq:16:64", "sparq:1:64"])  # 64 >= context + question + answer
def test_enough_keys_is_dense(kind, spec, tmp_path):
    adapter = _adapter(kind)
    head_dim = adapter.kv_shapes()[0][1]
    assert head_dim == 16  # sparq:16:K uses every component
    contexts, questions = _rows()
    with KVStore(str(tmp_path / "s")) as store:
        adapter.generate_kv_cache(contexts, store)
        dense = _sample(adapter, contexts, questions, store=store)
        got = _sample(adapter, contexts, questions, store=store, decode_attention=spec)
    ref = _sample(adapter, contexts, questions, use_cache=False, decode_attention=spec)
    for r in (got, ref):
        assert torch.equal(r.tokens, dense.tokens)
        assert _max_diff(r, dense) < 1e-10


@pytest.mark.parametrize("spec", ["topk:4", "sparq:4:6"])
def test_few_keys_cached_equals_no_cache_and_alone(spec, tmp_path):
    adapter = _adapter()
    contexts, questions = _rows()
    with KVStore(str(tmp_path / "s")) as store:
        adapter.generate_kv_cache(contexts, store)
        dense = _sample(adapter, contexts, questions, store=store)
        got = _sample(adapter, contexts, questions, store=store, decode_attention=spec)
        # each row alone: no pads at all; batched rows have left pads and holes
        alone = [_sample(adapter, [c], [q], store=store, decode_attention=spec) for c, q in zip(contexts, questions)]
    assert not torch.equal(got.tokens, dense.tokens)
    ref = _sample(adapter, contexts, questions, use_cache=False, decode_attention=spec)
    assert torch.equal(ref.tokens, got.tokens)
    assert _max_diff(ref, got) < 1e-10
    for i, a in enumerate(alone):
        assert torch.equal(a.tokens[0], got.tokens[i])
        assert float((a.scores[0] - got.scores[i]).abs().max()) < 1e-10


def test_float32_and_bfloat16_models_run():
    for dtype in (torch.float32, torch.bfloat16):
        adapter = _adapter(dtype=dtype)
        contexts, questions = _rows()
        dense = _sample(adapter, contexts, questions, use_cache=False)
        got = _sample(adapter, contexts, questions, use_cache=False, decode_attention="topk:64")
        tol = 1e-4 if dtype == torch.float32 else 0.5
        assert _max_diff(got, dense) < tol


def test_two_functions_of_one_name_each_run_their_own():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def make(fn):
        def attention(*args, **kwargs):
            return fn(*args, **kwargs)

        return attention

    first, second = make(sdpa_attention_forward), make(sparse.topk_attention(1))
    assert first.__qualname__ == second.__qualname__
    ctx_first, ctx_second = attention_context(parse_attention(first)), attention_context(parse_attention(second))
    adapter = _adapter()
    contexts, questions = _rows()
    dense = _sample(adapter, contexts, questions, use_cache=False)
    one = _sample(adapter, contexts, questions, use_cache=False, decode_attention="topk:1")
    assert torch.equal(_sample(adapter, contexts, questions, use_cache=False, generation_context=ctx_first).tokens,
                       dense.tokens)  # fmt: skip
    assert torch.equal(_sample(adapter, contexts, questions, use_cache=False, generation_context=ctx_second).tokens,
                       one.tokens)  # fmt: skip
    assert not torch.equal(one.tokens, dense.tokens)
