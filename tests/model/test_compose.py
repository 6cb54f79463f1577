"""Contexts composed of stored passages, answered under a policy (Adapter.sample(compose=...)).

``full`` must be the no-cache answer on every row; ``none`` must be what the model answers over
each passage computed alone at its own offset (checked against Hugging Face's ``generate`` over a
cache built that way, without kvstore's rotation); ``last:N`` covering the whole context is the
full prefill again. Models are tiny and random with a scaled-up init, so a position bug shows."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import DynamicCache

from helpers.tiny import make_family_model, make_tiny_model
from kvstore.errors import ComposeError
from kvstore.model.adapter import Adapter
from kvstore.model.compose.recompute import selected
from kvstore.model.compose.rows import compose_inputs
from kvstore.model.compose.run import _Parts, assemble
from kvstore.model.compose.spec import BLEND_LAYER, SEPARATOR, Passages
from kvstore.model.io.chains import Keying
from kvstore.store.kvstore import KVStore

WORDS = "alpha beta gamma delta river stone cloud paper window garden silver music field train".split()
N_NEW = 8


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _rows(seed: int = 0, n_rows: int = 6, k: int = 3):
    """Rows of ``k`` passages drawn from a pool of 4, in shuffled orders, and their questions."""
    rng = random.Random(seed)
    pool = [_text(rng, rng.randint(3, 8)) for _ in range(4)]
    contexts = [Passages(tuple(rng.sample(pool, k))) for _ in range(n_rows)]
    questions = [f"which {rng.choice(WORDS)}?" for _ in range(n_rows)]
    return contexts, questions


def _blocked_reference(model, tok, adapter, passages: Passages, question: str) -> torch.Tensor:
    """Greedy tokens from ``generate`` over a cache whose head and passages were each computed
    alone at their own offsets by the model (position ids), with no rotation by kvstore."""
    head = adapter.handle.encode_context("", special_tokens=True)
    pieces = [head] + [tok(t + SEPARATOR, add_special_tokens=False)["input_ids"] for t in passages.texts]
    layers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    at = 0
    for ids in pieces:
        if not ids:
            continue
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), position_ids=torch.arange(at, at + len(ids))[None], cache=cache,
                  use_cache=True)  # fmt: skip
        layers.append([(layer.keys, layer.values) for layer in cache.layers])
        at += len(ids)
    kv = [
        (torch.cat([p[i][0] for p in layers], 2), torch.cat([p[i][1] for p in layers], 2))
        for i in range(len(layers[0]))
    ]
    full = [t for p in pieces for t in p] + adapter.handle.encode_question(question)
    x = torch.tensor([full])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), cache=DynamicCache(kv),
                         max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)  # fmt: skip
    return out[0, len(full) :]


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_full_equals_no_cache_and_the_prefix_chains_on_every_row(kind, tmp_path):
    model, tok = make_tiny_model(kind, seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows()
    kw = dict(num_new_tokens=N_NEW, stop_at_eos=False)
    ref = adapter.sample(contexts, questions, use_cache=False, **kw)
    full = adapter.sample(contexts, questions, compose="full", **kw)
    assert full.compose == "full" and ref.compose is None
    assert torch.equal(full.tokens, ref.tokens)
    with KVStore(tmp_path / "s", chunk_tokens=16) as store:  # the exact prefix chains of the composed ids
        chained = adapter.sample(contexts, questions, store=store, **kw)
    assert torch.equal(chained.tokens, ref.tokens)
    redone = adapter.sample(contexts, questions, compose="last:100000", **kw)  # everything recomputed
    assert redone.compose == "last:100000" and torch.equal(redone.tokens, ref.tokens)


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_none_answers_over_each_passage_computed_at_its_offset(kind, tmp_path):
    model, tok = make_tiny_model(kind, seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(seed=1)
    with KVStore(tmp_path / "s", chunk_tokens=16) as store:
        got = adapter.sample(contexts, questions, store=store, compose="none", num_new_tokens=N_NEW, stop_at_eos=False)
    assert got.compose == "none"
    for i, (c, q) in enumerate(zip(contexts, questions)):
        assert got.tokens[i].tolist() == _blocked_reference(model, tok, adapter, c, q).tolist(), f"row {i}"
    ref = adapter.sample(contexts, questions, use_cache=False, num_new_tokens=N_NEW, stop_at_eos=False)
    assert not torch.equal(got.tokens, ref.tokens)  # approximate: passages do not see each other


def test_each_distinct_passage_is_stored_once_and_read_back(tmp_path):
    model, tok = make_tiny_model("llama", seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(seed=3, n_rows=8)
    distinct = {t for c in contexts for t in c.texts}
    kw = dict(num_new_tokens=4, compose="last:5")
    with KVStore(tmp_path / "s", chunk_tokens=16) as store:
        first = adapter.sample(contexts, questions, store=store, **kw)
        records = [store.context(k) for k in store.context_keys()]
        passages = [r for r in records if r is not None and r.passage]
        assert len(passages) == len(distinct)  # each once, whatever its positions
        assert len(records) == len(distinct) + 1  # and the head (a BOS) as an ordinary chain
        again = adapter.sample(contexts, questions, store=store, **kw)
    assert not any(first.cache_hit) and all(again.cache_hit)
    assert again.prefill_tokens_computed == 5 * len(contexts)  # only the recomputed tails
    assert torch.equal(first.tokens, again.tokens)


def test_a_passage_stored_int8_answers_under_composition(tmp_path):
    model, tok = make_tiny_model("llama", seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(seed=4)
    with KVStore(tmp_path / "s", chunk_tokens=16, codec="int8") as store:
        adapter.sample(contexts, questions, store=store, compose="none", num_new_tokens=4)
        got = adapter.sample(contexts, questions, store=store, compose="none", num_new_tokens=4)
        assert all(got.cache_hit) and set(got.codecs) == {store.codec.spec}


def test_composition_is_refused_in_one_line_where_it_cannot_run(tmp_path):
    model, tok = make_tiny_model("llama", seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows()
    cases = [
        (dict(contexts=["plain text"] * len(questions), compose="none"), "is for contexts given as passages"),
        (dict(compose="none", press="knorm:0.5"), "answered densely"),
        (dict(compose="last:0"), "compose policy 'last:0'"),
        (dict(compose="blend:2"), "compose policy 'blend:2'"),
        (dict(contexts=[contexts[0], "plain"] * 3), "some contexts are passage lists"),
    ]
    for kw, message in cases:
        args = {"contexts": contexts, **kw}
        with pytest.raises(ComposeError, match=message) as err:
            adapter.sample(args.pop("contexts"), questions, num_new_tokens=2, **args)
        assert "\n" not in str(err.value)
    gpt2, gtok = make_family_model("gpt2")
    with pytest.raises(ComposeError, match="cannot compose passages on .*gpt2") as err:
        Adapter(gpt2, gtok).sample(contexts, questions, compose="none", num_new_tokens=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_blend_recomputes_its_share_and_spans_none_to_full(kind):
    model, tok = make_tiny_model(kind, seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(seed=5)
    kw = dict(num_new_tokens=N_NEW, stop_at_eos=False)
    ref = adapter.sample(contexts, questions, use_cache=False, **kw)
    none = adapter.sample(contexts, questions, compose="none", **kw)
    everything = adapter.sample(contexts, questions, compose="blend:1", **kw)  # every passage token: the prefill
    assert everything.compose == "blend:1" and torch.equal(everything.tokens, ref.tokens)
    assert torch.equal(adapter.sample(contexts, questions, compose="blend:0", **kw).tokens, none.tokens)
    some = adapter.sample(contexts, questions, compose="blend:0.15", **kw)
    assert some.compose == "blend:0.15" and some.prefill_tokens_computed > 0
    composed = compose_inputs(adapter.handle, None, contexts, questions, Keying())
    assert composed is not None
    for row in composed.rows:
        layers = assemble(adapter.handle, row, None, _Parts())[0]
        pick = selected(adapter.handle, row, layers, 0.15).tolist()
        passage_tokens = len(row.ids) - len(row.head)
        assert len(pick) == math.ceil(0.15 * passage_tokens) and pick == sorted(set(pick))
        assert min(pick) >= len(row.head) and max(pick) < len(row.ids)


def test_blend_selects_the_passage_tokens_that_deviate_most_at_its_layer():
    """``selected`` on crafted caches: the model's own keys and values with known positions moved
    by known amounts at :data:`BLEND_LAYER` (keys at some, values at one, the head by far the most).
    The largest passage deviations must be picked, never the head; picking the smallest (or the
    head, or another layer's) would return other positions."""
    model, tok = make_tiny_model("llama", seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(seed=6, n_rows=1)
    composed = compose_inputs(adapter.handle, None, contexts, questions, Keying())
    assert composed is not None
    row = composed.rows[0]
    head, total = len(row.head), len(row.ids)
    assert head >= 1 and total - head >= 12
    (exact,) = adapter.prefill([list(row.ids)])
    gen = torch.Generator().manual_seed(0)
    layers = [(k.clone(), v.clone()) for k, v in exact]
    for k, v in layers:  # a small deviation everywhere (no ties), on every layer
        k.add_(1e-3 * torch.randn(k.shape, generator=gen))
        v.add_(1e-3 * torch.randn(v.shape, generator=gen))
    k, v = layers[BLEND_LAYER]
    moved = {head + 1: 3.0, total - 1: 2.0, head + 5: 1.5}  # keys moved at these positions
    for pos, amount in moved.items():
        k[:, pos] += amount
    v[:, head + 8] += 2.5  # values only
    k[:, :head] += 50.0  # the head deviates most of all: it is never recomputed
    other = layers[BLEND_LAYER - 1][0]
    other[:, head + 3] += 100.0  # another layer's deviation does not count
    want = sorted([*moved, head + 8])
    ratio = (len(want) - 0.5) / (total - head)  # ceil(ratio x passage tokens) = 4
    assert selected(adapter.handle, row, tuple(layers), ratio).tolist() == want
    assert selected(adapter.handle, row, tuple(layers), 0.0).tolist() == []


def test_build_compose_stores_what_a_composed_sample_reads(tmp_path):
    model, tok = make_tiny_model("llama", seed=2)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(seed=7, n_rows=6)
    distinct = {t for c in contexts for t in c.texts}
    with KVStore(tmp_path / "s", chunk_tokens=16) as store:
        plan = adapter.plan_build(contexts, store, compose=True)
        assert len(plan.steps) == len(distinct) + 1 and plan.count("compute") == len(plan.steps)
        report = adapter.build(contexts, store, compose=True)
        assert report.built == len(distinct) + 1 and report.tokens == plan.tokens_to_compute
        assert adapter.build(contexts, store, compose=True).skipped == len(distinct) + 1
        got = adapter.sample(contexts, questions, store=store, compose="none", num_new_tokens=4)
        assert all(got.cache_hit) and got.prefill_tokens_computed == 0
    with KVStore(tmp_path / "t") as other, pytest.raises(ComposeError, match="is for contexts given as passages"):
        adapter.build(["plain text"], other, compose=True)
