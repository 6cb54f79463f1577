"""The leaderboard's presses: KVzip, ExpectedAttention, AdaKV and PyramidKV budgets, KVzip's global
cut, and a press registered from Python.

Float64 tiny models with a wide initialization and contexts of random ids (no two scores tie but
where a press makes them equal on purpose: sinks, windows, AdaKV's safeguard). The independent
implementation shares no code with kvstore's: KVzip's scores come from the model's own attention
weights over the context followed by its replay (one forward from position 0, eager attention,
renormalized over the columns KVzip reads), ExpectedAttention's from the query projection's
outputs and the model's own rotary module, the budgets from ``torch.topk`` as kvpress cuts, and
the answers from the model's full dense cache with every dropped (layer, head, position) masked
out (kvpress's way) instead of kvstore's compacted per-head buffers.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama import modeling_llama

from helpers.rows import random_ids
from helpers.tiny import make_tiny_model
from kvstore.errors import PressError
from kvstore.model.adapter import Adapter
from kvstore.model.press.registry import (
    BudgetRule,
    Param,
    budget_names,
    press_catalog,
    press_table,
    register_budget,
    register_press,
    unregister_budget,
    unregister_press,
)
from kvstore.model.press.select import PressMemo, kept_positions
from kvstore.model.press.spec import parse_press
from kvstore.model.stages.answer import prefill_contexts
from kvstore.store.kvstore import KVStore

N_NEW = 5
PYRAMID = "snapkv:0.5:pyramid:window=4:beta=2"  # a schedule that fits ~100-token contexts
LENGTHS = [96, 130, 75, 151]
Q_LENGTHS = [3, 1, 5, 2]
NEW = ["kvzip:0.5", "kvzip:0.75:layer", "kvzip:0.5:chunk=40", "kvzip:0.5:plus", "expected_attention:0.5",
       "snapkv:0.5:adakv", "expected_attention:0.75:adakv", PYRAMID, "knorm:0.6:global"]  # fmt: skip


@pytest.fixture(scope="module")
def eager():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=3, attn_implementation="eager")
    return Adapter(model, tok)


@pytest.fixture(scope="module")
def rows(eager):
    contexts = random_ids(eager.tokenizer, LENGTHS, rng=11)
    opening, _ = _template(eager.tokenizer)
    contexts[1] = opening + contexts[1][len(opening) :]  # one context opens with the chat template's user turn
    return contexts, random_ids(eager.tokenizer, Q_LENGTHS, rng=12)


def _sweep(adapter, contexts, questions, variants, **kw):
    kw.setdefault("stop_at_eos", False)
    return adapter.sweep(contexts, questions, variants=variants, num_new_tokens=N_NEW, return_scores=True, **kw)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores))


# -- the independent implementation ------------------------------------------------------------------
def _template(tok) -> tuple[list[int], list[int]]:
    """The chat template's text before and after a user message, as ids (kvpress's dummy-message split)."""
    text = tok.apply_chat_template([{"role": "user", "content": "dummy context\n#############"}],
                                   add_generation_prompt=True, tokenize=False)  # fmt: skip
    before, after = text.split("\n#############")
    return tok.encode(before.split("dummy context")[0], add_special_tokens=False), tok.encode(
        after, add_special_tokens=False
    )


def _replay_chunks(tok, ids: list[int], chunk: int) -> list[tuple[int, int, list[int]]]:
    opening, suffix = _template(tok)
    p = len(opening) if ids[: len(opening)] == opening else 0
    body = ids[p:]
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    out, at = [], p
    for i, piece in enumerate(pieces):
        if i == 0:
            prompt = tok.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
        else:
            prompt = tok.encode("\n\nRepeat the part of the previous context exactly, starting with",
                                add_special_tokens=False) + pieces[i - 1][-8:]  # fmt: skip
        out.append((at, at + len(piece), prompt + suffix + piece))
        at += len(piece)
    return out


def _keep_hidden(into: dict, i: int):
    def hook(module, args, kwargs):
        into[i] = kwargs["hidden_states"][0]

    return hook


@torch.inference_mode()
def _kvzip_scores(model, tok, ids: list[int], chunk: int = 2048, plus: bool = False) -> torch.Tensor:
    """``[L, H, c]`` from the model's attention weights over ``ids + replay``, renormalized over the
    sinks, the chunk and the replay (a softmax over a subset of keys is the full one renormalized)."""
    cfg = model.config
    L, H, G = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    c = len(ids)
    scores = torch.zeros((L, H, c), dtype=torch.float64)
    for start, end, replay in _replay_chunks(tok, ids, chunk):
        hidden: dict[int, torch.Tensor] = {}
        handles = [layer.self_attn.register_forward_pre_hook(_keep_hidden(hidden, i), with_kwargs=True)
                   for i, layer in enumerate(model.model.layers)]  # fmt: skip
        out = model(input_ids=torch.tensor([ids + replay]), output_attentions=True, use_cache=True)
        for h in handles:
            h.remove()
        q = len(replay)
        sink = min(4, start)
        cols = list(range(sink)) + list(range(start, end)) + list(range(c, c + q))
        for layer in range(L):
            w = out.attentions[layer][0][:, c:, cols]  # [Hq, q, n]
            w = w / w.sum(dim=-1, keepdim=True)
            if plus:
                w = w / hidden[layer].norm(dim=-1)[c:][None, :, None]
                values = out.past_key_values.layers[layer].values[0][:, cols]  # [H, n, d]
                wo = model.model.layers[layer].self_attn.o_proj.weight  # [hidden, Hq * d]
                d = values.shape[-1]
                norms = torch.stack([(values[hq // G] @ wo[:, hq * d : (hq + 1) * d].T).norm(dim=-1)
                                     for hq in range(H * G)])  # fmt: skip
                w = w * norms[:, None, :]
            s = w[:, :, sink : sink + end - start].reshape(H, G * q, end - start).amax(dim=1)
            scores[layer, :, start:end] = s
    scores[:, :, :4] = scores.max() + 1
    return scores


@torch.inference_mode()
def _expected_attention_scores(model, ids: list[int]) -> torch.Tensor:
    """``[L, H, c]``: ExpectedAttentionPress's formula on the query projection's own outputs."""
    cfg = model.config
    L, H, Hq = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    d = cfg.hidden_size // Hq
    c, sinks, n_future = len(ids), 4, 512
    captured = {}
    handles = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(i, o[0]))
               for i, layer in enumerate(model.model.layers)]  # fmt: skip
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    for h in handles:
        h.remove()
    pos = torch.arange(c, c + n_future)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), pos)
    cos, sin = cos[0], sin[0]
    rot = torch.zeros((n_future, d, d), dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    swap = torch.zeros((d, d), dtype=torch.float64)
    swap[d // 2 :, : d // 2], swap[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    rot = (cos[:, None, :] * eye + sin[:, None, :] * swap).mean(dim=0)
    scores = torch.zeros((L, H, c), dtype=torch.float64)
    for layer in range(L):
        q = captured[layer][sinks:].view(c - sinks, Hq, d).transpose(0, 1)  # [Hq, n, d] before RoPE
        mu = q.mean(dim=1)
        centered = q - mu[:, None]
        cov = torch.einsum("hni,hnj->hij", centered, centered) / (c - sinks)
        mu, cov = mu @ rot.T, rot @ cov @ rot.T
        keys = out.past_key_values.layers[layer].keys[0][:, sinks:].repeat_interleave(Hq // H, dim=0)
        values = out.past_key_values.layers[layer].values[0][:, sinks:]
        logits = torch.einsum("hd,hnd->hn", mu, keys) / math.sqrt(d)
        logits = logits + torch.einsum("hnd,hde,hne->hn", keys, cov, keys) / d / 2
        s = torch.softmax(logits, dim=-1).view(H, Hq // H, -1).mean(dim=1) * values.norm(dim=-1)
        scores[layer, :, sinks:] = s
        scores[layer, :, :sinks] = s.max() + 1
    return scores


@torch.inference_mode()
def _snapkv_scores(model, ids: list[int], w: int) -> torch.Tensor:
    """``[L, H, c]`` SnapKV scores from the model's attention weights (window ``w``, pool 5)."""
    c = len(ids)
    out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    H = model.config.num_key_value_heads
    rows = []
    for a in out.attentions:
        s = a[0][:, c - w :, : c - w].mean(dim=1)
        s = torch.nn.functional.avg_pool1d(s[:, None], kernel_size=5, padding=2, stride=1)[:, 0]
        s = s.view(H, -1, c - w).mean(dim=1)
        rows.append(torch.cat([s, torch.full((H, w), float(s.max()) + 1, dtype=s.dtype)], dim=1))
    return torch.stack(rows)


@torch.inference_mode()
def _knorm_scores(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    return torch.stack([-layer.keys[0].norm(dim=-1) for layer in out.past_key_values.layers])


def _best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` highest scores of the last dimension, ties to the lower index (the order
    kvstore documents; kvpress's ``torch.topk`` leaves it open)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n]


def _kept(scores: torch.Tensor, spec: str) -> torch.Tensor:
    """``[L, H, c]`` bool: what kvpress's budget keeps (its cuts, ties to the lower index)."""
    press = parse_press(spec)
    L, H, c = scores.shape
    keep = torch.zeros_like(scores, dtype=torch.bool)
    n = max(1, int(c * (1 - press.ratio)))
    if press.budget == "global":
        keep.view(-1)[_best(scores.reshape(-1), scores.numel() - int(scores.numel() * press.ratio))] = True
        return keep
    for layer in range(L):
        s = scores[layer].clone()
        if press.budget == "layer":
            keep[layer].view(-1)[_best(s.reshape(-1), H * c - int(H * c * press.ratio))] = True
        elif press.budget == "adakv":
            s.scatter_(-1, _best(s, max(1, int(n * 0.2))), torch.finfo(s.dtype).max)
            keep[layer].view(-1)[_best(s.reshape(-1), H * n)] = True
        elif press.budget == "pyramid":  # PyramidKVPress.get_layer_budget
            w, beta = int(press.param("window")), int(press.param("beta"))
            most = w + c * (1 - press.ratio)
            low = (most - w) / beta
            high = (most - w) * 2 - low
            if high >= c - w:
                high, low = c - w, (most - w) * 2 - (c - w)
            fits = c >= high >= low >= w
            n_l = round(high - layer * (high - low) / (L - 1)) if fits else round(c * (1 - press.ratio))
            keep[layer].scatter_(-1, _best(s, n_l), True)
        else:
            keep[layer].scatter_(-1, _best(s, n), True)
    return keep


def _scores_for(adapter, ids: list[int], spec: str) -> torch.Tensor:
    model, press = adapter.model, parse_press(spec)
    if press.method == "kvzip":
        return _kvzip_scores(model, adapter.tokenizer, ids, int(press.param("chunk")), bool(press.param("plus")))
    if press.method == "expected_attention":
        return _expected_attention_scores(model, ids)
    if press.method == "snapkv":
        return _snapkv_scores(model, ids, int(press.param("window")))
    return _knorm_scores(model, ids)


def _masked_attention(dropped: list[torch.Tensor], c: int):
    """An eager attention that adds -inf on each layer's dropped context positions, per KV head."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        extra = torch.zeros((1, query.shape[1], 1, key.shape[2]), dtype=query.dtype)
        drop = dropped[module.layer_idx].repeat_interleave(query.shape[1] // key.shape[1], dim=0)  # [Hq, c]
        extra[0, :, 0, :c] = torch.where(drop, -math.inf, 0.0)
        mask = extra if attention_mask is None else attention_mask + extra
        return modeling_llama.eager_attention_forward(module, query, key, value, mask, **kwargs)

    return attention


@torch.inference_mode()
def _independent_answer(model, ctx: list[int], q: list[int], keep: torch.Tensor) -> list[int]:
    """Greedy tokens over the whole dense cache with the dropped pairs masked out (kvpress's way)."""
    c, nq = len(ctx), len(q)
    out = model(input_ids=torch.tensor([ctx]), use_cache=True)
    cache = out.past_key_values
    AttentionInterface.register("test-dropped", _masked_attention(list(~keep), c))
    AttentionMaskInterface.register("test-dropped", eager_mask)
    before = model.config._attn_implementation
    model.config._attn_implementation = "test-dropped"
    try:
        logits = model(input_ids=torch.tensor([q]), position_ids=torch.arange(c, c + nq)[None], past_key_values=cache,
                       use_cache=True).logits[0, -1]  # fmt: skip
        tokens = []
        for t in range(N_NEW):
            nxt = int(logits.argmax())
            tokens.append(nxt)
            if t == N_NEW - 1:
                break
            logits = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[c + nq + t]]),
                           past_key_values=cache, use_cache=True).logits[0, -1]  # fmt: skip
    finally:
        model.config._attn_implementation = before
    return tokens


# -- the tests ---------------------------------------------------------------------------------------
def test_new_presses_keep_and_answer_what_an_independent_implementation_does(eager, rows):
    contexts, questions = rows
    with KVStore("memory://", chunk_tokens=32) as store:
        eager.build(contexts, store)
        got = _sweep(eager, contexts, questions, NEW, store=store, batch_size=3)
    cache = prefill_contexts(eager.handle, contexts, 1, False)
    memo = PressMemo()
    for spec in NEW:
        press = parse_press(spec)
        for r, (ctx, q) in enumerate(zip(contexts, questions)):
            keep = _kept(_scores_for(eager, ctx, spec), spec)
            mine = kept_positions(eager.handle, cache, press, r, memo)
            for layer, heads in enumerate(mine):
                for h, positions in enumerate(heads):
                    assert positions.tolist() == keep[layer, h].nonzero().flatten().tolist(), (spec, r, layer, h)
            assert got[spec].tokens[r].tolist() == _independent_answer(eager.model, ctx, q, keep), (spec, r)
            assert got[spec].kept_tokens[r] == round(int(keep.sum()) / (keep.shape[0] * keep.shape[1]))
        assert (
            got[spec].cache_bytes
            == sum(int(_kept(_scores_for(eager, ctx, spec), spec).sum()) for ctx in contexts)
            * 2
            * 8
            * eager.model.config.hidden_size
            // eager.model.config.num_attention_heads
        ), spec


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_cached_equals_the_press_in_memory_without_a_store(kind):
    model, tok = make_tiny_model(kind, dtype=torch.float64, seed=5)
    adapter = Adapter(model, tok)
    contexts, questions = random_ids(tok, LENGTHS, rng=21), random_ids(tok, Q_LENGTHS, rng=22)
    specs = ["kvzip:0.5", "kvzip:0.25:layer", "expected_attention:0.5", "snapkv:0.75:adakv", "keydiff:0.5:adakv",
             PYRAMID, "snapkv:0.5:q:adakv", "tova:0.75:q:global"]  # fmt: skip
    with KVStore("memory://", chunk_tokens=40) as store:
        cold = _sweep(adapter, contexts, questions, specs, store=store, batch_size=4)
        warm = _sweep(adapter, contexts, questions, specs, store=store, batch_size=3)
    ref = _sweep(adapter, contexts, questions, specs, use_cache=False, batch_size=2)
    dense = _sweep(adapter, contexts, questions, ["dense"], use_cache=False, batch_size=2)["dense"]
    for spec in specs:
        assert all(warm[spec].cache_hit) and warm[spec].prefill_tokens_computed == 0
        for got in (cold[spec], warm[spec]):
            assert torch.equal(got.tokens, ref[spec].tokens), spec
            assert _max_diff(got, ref[spec]) < 1e-10, spec
        assert not torch.equal(ref[spec].tokens, dense.tokens) or spec.endswith(":layer"), spec  # presses bite


def test_ratio_zero_gives_the_dense_tokens_bit_for_bit(eager, rows):
    contexts, questions = rows
    specs = ["dense", "kvzip:0", "expected_attention:0", "snapkv:0:adakv", "snapkv:0:pyramid:window=4",
             "knorm:0:global"]  # fmt: skip
    with KVStore("memory://", chunk_tokens=32) as store:
        got = _sweep(eager, contexts, questions, specs, store=store, batch_size=4)
    for spec in specs[1:]:
        assert torch.equal(got[spec].tokens, got["dense"].tokens), spec
        assert all(torch.equal(a, b) for a, b in zip(got[spec].scores, got["dense"].scores)), spec
        assert got[spec].kept_tokens == [len(c) for c in contexts]
        assert got[spec].scoring_tokens_computed == got["dense"].scoring_tokens_computed  # nothing scored at 0


def test_heads_keep_their_own_counts_in_buffers_sized_by_what_they_keep(eager, rows):
    from kvstore.model.press.prune import press_cache

    contexts, _ = rows
    cache = prefill_contexts(eager.handle, contexts, 8, False)
    memo = PressMemo()
    for spec in ["kvzip:0.75", "snapkv:0.5:adakv", PYRAMID]:
        pressed = press_cache(eager.handle, cache, parse_press(spec), memo)
        assert pressed.heads is not None, spec
        counts = pressed.heads.counts
        assert any(len(set(n.flatten().tolist())) > 1 for n in counts), spec  # heads or rows keep different counts
        for (kb, _), n, P in zip(pressed.bufs, counts, pressed.heads.slots):
            assert P == int(n.max()) and kb.shape[2] == P + cache.slots - cache.first_free  # sized by the most kept
        dense_slots = sum(kb.shape[2] for kb, _ in cache.bufs)
        assert sum(kb.shape[2] for kb, _ in pressed.bufs) < dense_slots, spec
        if spec.startswith("kvzip"):  # the global cut keeps int(L H c (1 - 0.75)) pairs per row... or fewer dropped
            for r, c in enumerate(contexts):
                total = len(counts) * counts[0].shape[1] * len(c)
                assert pressed.heads.row_pairs(r) == total - int(total * 0.75)


def test_kvzip_replays_each_chunk_once_for_every_ratio_and_counts_it_apart(eager, rows):
    contexts, questions = rows
    specs = ["kvzip:0.25", "kvzip:0.5", "kvzip:0.75:layer", "kvzip:0.5:adakv"]
    with KVStore("memory://", chunk_tokens=32) as store:
        eager.build(contexts, store)
        got = _sweep(eager, contexts, questions, specs + ["kvzip:0.5:chunk=40"], store=store, batch_size=4)
    replayed = sum(len(r) for c in contexts for _, _, r in _replay_chunks(eager.tokenizer, c, 2048))
    replayed += sum(len(r) for c in contexts for _, _, r in _replay_chunks(eager.tokenizer, c, 40))
    for spec in specs:
        res = got[spec]
        assert res.replay_tokens_computed == replayed and res.scoring_tokens_computed == replayed, spec
        assert res.prefill_tokens_computed == 0 and res.window_tokens_computed == 0, spec


def test_new_presses_compose_with_decode_attention_and_lossy_codecs(eager, rows):
    contexts, questions = rows
    specs = ["kvzip:0.5+topk:8", "snapkv:0.5:adakv+sparq:4:8", "expected_attention:0.5:pyramid+topk:16"]
    with KVStore("memory://", chunk_tokens=32) as store:
        got = _sweep(eager, contexts, questions, specs, store=store, batch_size=4)
    ref = _sweep(eager, contexts, questions, specs, use_cache=False, batch_size=3)
    for spec in specs:
        assert torch.equal(got[spec].tokens, ref[spec].tokens) and _max_diff(got[spec], ref[spec]) < 1e-10, spec
    with KVStore("memory://", codec="int8", chunk_tokens=32) as store:
        miss = _sweep(eager, contexts, questions, ["kvzip:0.5"], store=store)["kvzip:0.5"]
        hit = _sweep(eager, contexts, questions, ["kvzip:0.5"], store=store)["kvzip:0.5"]
    assert all(hit.cache_hit) and not any(miss.cache_hit)
    assert torch.equal(miss.tokens, hit.tokens) and _max_diff(miss, hit) == 0


def test_scores_under_new_presses_equal_the_press_in_memory(eager, rows):
    contexts, _ = rows
    conts = random_ids(eager.tokenizer, [4, 2, 6, 3], rng=31)
    variants = ["dense", "kvzip:0.5", "snapkv:0.5:adakv", "expected_attention:0.75:pyramid"]
    with KVStore("memory://", chunk_tokens=32) as store:
        cached = eager.score_sweep(contexts, conts, variants=variants, store=store, batch_size=3)
    ref = eager.score_sweep(contexts, conts, variants=variants, use_cache=False, batch_size=2)
    for v in variants:
        assert max(abs(a - b) for a, b in zip(cached[v].logprobs, ref[v].logprobs)) < 1e-10, v
    assert cached["kvzip:0.5"].replay_tokens_computed > 0
    assert max(abs(a - b) for a, b in zip(cached["kvzip:0.5"].logprobs, cached["dense"].logprobs)) > 1e-6


def _value_norm(inputs):
    return inputs.values.norm(dim=-1) * float(inputs.press.param("scale"))


def test_a_press_registered_from_python_works_by_name_everywhere(eager, rows):
    contexts, questions = rows
    register_press("vnorm_test", _value_norm, params={"scale": 1.0}, keeps="the largest value norms")
    try:
        assert parse_press("vnorm_test:0.5:scale=2").name == "vnorm_test:0.5:scale=2"
        with KVStore("memory://", chunk_tokens=32) as store:
            one = eager.sample(contexts, questions, store=store, press="vnorm_test:0.5", num_new_tokens=N_NEW,
                               stop_at_eos=False, return_scores=True)  # fmt: skip
            swept = _sweep(eager, contexts, questions, ["vnorm_test:0.5", "vnorm_test:0.5:adakv"], store=store)
            scored = eager.score(contexts, random_ids(eager.tokenizer, [2, 2, 2, 2], rng=5), store=store,
                                 press="vnorm_test:0.5")  # fmt: skip
        assert torch.equal(one.tokens, swept["vnorm_test:0.5"].tokens) and one.variant == "vnorm_test:0.5"
        assert scored.kept_tokens == [max(1, int((len(c) - 1) * 0.5)) for c in contexts]
        # the kept tokens are those of the largest value norms, per head
        cache = prefill_contexts(eager.handle, contexts, 1, False)
        kept = kept_positions(eager.handle, cache, parse_press("vnorm_test:0.5"), 0, PressMemo())
        norms = cache.bufs[0][1][0, :, : len(contexts[0])].norm(dim=-1)
        assert kept[0][0].tolist() == sorted(torch.topk(norms[0], len(contexts[0]) // 2).indices.tolist())
        with pytest.raises(PressError, match="registered already"):
            register_press("vnorm_test", _value_norm)
    finally:
        unregister_press("vnorm_test")
    with pytest.raises(PressError, match="unknown press 'vnorm_test'"):
        parse_press("vnorm_test:0.5")


def _keep_first(press, scores, c):
    """A toy budget: every head keeps its first ``n_kept(c) - skip`` positions, whatever they score."""
    n = press.n_kept(c) - int(press.param("skip"))
    return [torch.arange(c, device=s.device).expand(s.shape) < n for s in scores]


def test_a_budget_registered_from_python_is_a_record_with_its_keep_function(eager, rows):
    contexts, questions = rows
    register_budget(BudgetRule("first_test", (Param("skip", 0, "positions fewer"),), "the first n", keep=_keep_first))
    try:
        assert "first_test" in budget_names() and "first_test(skip=0)" in press_catalog()
        assert "| `first_test` | the first n | `skip=0` |" in press_table()
        cache = prefill_contexts(eager.handle, contexts, 1, False)
        for spec, n in (("knorm:0.5:first_test", max(1, int(len(contexts[0]) * 0.5))),
                        ("knorm:0.5:first_test:skip=3", max(1, int(len(contexts[0]) * 0.5)) - 3)):  # fmt: skip
            kept = kept_positions(eager.handle, cache, parse_press(spec), 0, PressMemo())
            assert all(head.tolist() == list(range(n)) for layer in kept for head in layer)
        with KVStore("memory://", chunk_tokens=32) as store:  # through a pipeline, by name
            swept = _sweep(eager, contexts, questions, ["knorm:0.5:first_test"], store=store)
        assert swept["knorm:0.5:first_test"].tokens.shape[0] == len(contexts)
        with pytest.raises(PressError, match="built in"):
            unregister_budget("head")
    finally:
        unregister_budget("first_test")
    with pytest.raises(PressError, match="keep must be a function"):
        register_budget(BudgetRule("nokeep_test", (), "nothing"))
    register_budget(
        BudgetRule("bad_test", (), "wrong shapes", keep=lambda press, scores, c: [s > 0 for s in scores[:1]])
    )
    try:
        with pytest.raises(PressError, match="one bool mask per layer"):
            kept_positions(eager.handle, cache, parse_press("knorm:0.5:bad_test"), 0, PressMemo())
    finally:
        unregister_budget("bad_test")


def test_a_registered_scorer_of_the_wrong_shape_is_one_line_naming_the_spec(eager, rows):
    contexts, questions = rows
    register_press("bad_shape_test", lambda inputs: inputs.keys.norm(dim=-1)[:, :-1])
    try:
        with pytest.raises(PressError) as exc:
            eager.sample(contexts, questions, press="bad_shape_test:0.5", num_new_tokens=2, use_cache=False)
        assert "\n" not in str(exc.value) and "bad_shape_test:0.5" in str(exc.value) and "shape" in str(exc.value)
    finally:
        unregister_press("bad_shape_test")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("bogus:0.5", "unknown press 'bogus'"),
        ("snapkv:0.5:window=8:window=16", "given twice"),
        ("snapkv:0.5:q:q", "given twice"),
        ("snapkv:0.5:window=²", "ASCII digits"),
        ("snapkv:+0.5", "'snapkv:+0.5'"),
        ("snapkv:0.5+topk:4", "decode_attention="),
        ("snapkv:0.5:adakv:pyramid", "two budgets"),
        ("snapkv:0.5:alpha_safeguard=0.1", "add ':adakv'"),
        ("kvzip:0.5:q", "question-aware"),
        ("kvzip:0.5:plus=maybe", "true or false"),
        ("snapkv:0.5:adakv:alpha_safeguard=2", "alpha_safeguard"),
        ("snapkv:0.5::q", "empty field"),
        ("snapkv:nan", "not a number"),
    ],
)
def test_bad_specs_are_one_line_naming_the_spec(spec, says):
    with pytest.raises(PressError) as exc:
        parse_press(spec)
    assert "\n" not in str(exc.value) and says in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("snapkv:+0.5", "variant 'snapkv:+0.5': a ratio is written without a sign"),
        ("topk:²", "'topk:²': expected topk:N with positive integers in ASCII digits"),
        ("sparq:²:8", "ASCII digits"),
        ("snapkv:0.5+topk:²", "'topk:²'"),
        ("bogus:0.5", "unknown press 'bogus' (presses: knorm"),
    ],
)
def test_bad_variants_are_one_line_naming_what_was_typed(spec, says):
    """The variant parser (what --variant, --press and --decode-attention go through) quotes the spec
    as given and names what to do; Unicode digits never reach int()."""
    from kvstore.errors import KVStoreError
    from kvstore.model.variants.variant import parse_variant

    with pytest.raises(KVStoreError) as exc:
        parse_variant(spec)
    assert "\n" not in str(exc.value) and says in str(exc.value), str(exc.value)


def test_specs_have_one_printed_form():
    assert parse_press("kvzip:0.5:global").name == "kvzip:0.5"  # the default budget is not printed
    assert parse_press("kvzip:.5:plus=true:layer").name == "kvzip:0.5:layer:plus"
    assert parse_press("snapkv:0.5:adakv:alpha_safeguard=0.2").name == "snapkv:0.5:adakv"
    no_cov = "expected_attention:0.5:use_covariance=false"
    assert parse_press(no_cov).name == no_cov
    assert parse_press("snapkv:0.5:adakv").scorer_key() == parse_press("snapkv:0.25:pyramid").scorer_key()
    assert parse_press("kvzip:0.5").scorer_spec == "kvzip:chunk=2048:n_sink=4:plus=false"


def _skewed_scores(keys: torch.Tensor) -> torch.Tensor:
    """Head 0's tokens all score above head 1's (AdaKV's safeguard is then all head 1 keeps)."""
    s = -keys.norm(dim=-1)
    return s + 1000.0 * (s.shape[0] - 1 - torch.arange(s.shape[0], dtype=s.dtype))[:, None]


def _skewed(inputs):
    return _skewed_scores(inputs.keys)


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.0])
def test_adakv_shares_a_layer_budget_over_its_heads_with_a_safeguard(eager, rows, alpha):
    contexts, questions = rows
    register_press("skewed_test", _skewed)
    try:
        spec = f"skewed_test:0.5:adakv:alpha_safeguard={alpha}"
        cache = prefill_contexts(eager.handle, contexts, 1, False)
        memo = PressMemo()
        for r, c in enumerate(contexts):
            n = int(len(c) * 0.5)
            safe = max(1, int(n * alpha)) if alpha > 0 else 0
            for heads in kept_positions(eager.handle, cache, parse_press(spec), r, memo):
                assert [len(h) for h in heads] == [2 * n - safe, safe], (alpha, r)
        if alpha != 0.2:
            return  # the independent cut below has kvpress's default safeguard
        ref = _sweep(eager, contexts, questions, [spec], use_cache=False)[parse_press(spec).name]
        for r, (ctx, q) in enumerate(zip(contexts, questions)):
            layers = eager.model(input_ids=torch.tensor([ctx]), use_cache=True).past_key_values.layers
            keep = _kept(torch.stack([_skewed_scores(layer.keys[0]) for layer in layers]), spec)
            assert ref.tokens[r].tolist() == _independent_answer(eager.model, ctx, q, keep)
    finally:
        unregister_press("skewed_test")


def test_the_docs_tables_are_the_registrys():
    from pathlib import Path

    from kvstore.model.press.registry import press_table

    text = (Path(__file__).parents[2] / "docs" / "presses.md").read_text()
    start = text.index("-->\n", text.index("<!-- press-table")) + len("-->\n")
    assert text[start : text.index("\n<!-- /press-table -->")] == press_table()
