"""Generation contexts (decode-time hooks): where they are entered, what they may change.

A hook is entered around the question forward and the decode steps only; contexts are loaded, or
computed and stored, outside it. So: an identity hook changes nothing; a perturbing hook changes
the answers yet cached == no-cache under it, and the store's bytes are what a plain build writes;
the hook never sees a prefill; an error under it is one line naming it; sweeps answer every
variant from one load without touching the context slots.
"""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch

from helpers.hooks import N_NEW
from helpers.hooks import max_diff as _max_diff
from helpers.hooks import sample as _sample
from helpers.hooks import tiny_adapter as _adapter
from kvstore.errors import HookError, ModelError
from kvstore.model.adapter import Adapter
from kvstore.model.paths import dense
from kvstore.model.stages import complete as complete_stage
from kvstore.model.variants.hooks import attention_context
from kvstore.model.variants.variant import Variant, parse_attention
from kvstore.store.kvstore import KVStore


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (30, 12, 45, 30)]
    contexts[3] = list(contexts[0])  # two rows share a context
    questions = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (3, 5, 1, 4)]
    return contexts, questions


def _store_bytes(store: KVStore) -> dict[bytes, str]:
    """sha256 of every entry and context record (access times excluded)."""
    out = {}
    for prefix in (b"e/", b"r/"):
        for k in store.backend.keys(prefix):
            out[k] = hashlib.sha256(store.backend.get(k)).hexdigest()
    return out


def _store_content(store: KVStore) -> dict[str, tuple]:
    """Every entry and context record by key, all but its creation time (two writes of the same
    tensors differ only there): token ids, keys/values bit patterns, chain fields, numerics."""
    out: dict[str, tuple] = {}
    for key in store.keys():
        e = store.get(key)
        layers = tuple((k.view(torch.int64).tolist(), v.view(torch.int64).tolist()) for k, v in e.layers)
        out[key] = (e.token_ids.tolist(), layers, e.parent, e.start, dict(e.numerics), e.model)
    for key in store.context_keys():
        r = store.context(key)
        out["r/" + key] = (r.chunks, r.n_tokens)
    return out


def perturb(model: torch.nn.Module):
    """A hook that scales the first layer's attention output by 3 (changes the answers)."""

    def scale(module, args, output):
        return (output[0] * 3,) + tuple(output[1:])

    handle = None

    @contextlib.contextmanager
    def ctx():
        nonlocal handle
        attn = model.model.layers[0].self_attn if hasattr(model, "model") else model.gpt_neox.layers[0].attention
        handle = attn.register_forward_hook(scale)
        try:
            yield
        finally:
            handle.remove()

    return ctx()


class Counting:
    """A generation context counting the forwards it sees and their query lengths."""

    def __init__(self):
        self.lengths: list[int] = []
        self.entered = 0

    def __call__(self, model):
        @contextlib.contextmanager
        def ctx():
            self.entered += 1
            h = model.register_forward_pre_hook(lambda m, a, kw: self.lengths.append(kw["input_ids"].shape[1]),
                                                with_kwargs=True)  # fmt: skip
            try:
                yield
            finally:
                h.remove()

        return ctx()


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_identity_hook_is_plain(kind, tmp_path):
    adapter = _adapter(kind)
    contexts, questions = _rows()
    identity = lambda model: contextlib.nullcontext()  # noqa: E731
    with KVStore(str(tmp_path / "s")) as store:
        adapter.generate_kv_cache(contexts, store)
        plain = _sample(adapter, contexts, questions, store=store)
        hooked = _sample(adapter, contexts, questions, store=store, generation_context=identity)
    ref = _sample(adapter, contexts, questions, use_cache=False)
    ref_hooked = _sample(adapter, contexts, questions, use_cache=False, generation_context=identity)
    for got in (hooked, ref, ref_hooked):
        assert torch.equal(got.tokens, plain.tokens)
        assert _max_diff(got, plain) < 1e-10
    assert hooked.variant.endswith("<lambda>")


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_perturbing_hook_changes_answers_not_the_store(kind, tmp_path):
    adapter = _adapter(kind)
    contexts, questions = _rows()
    with KVStore(str(tmp_path / "plain")) as plain_store:
        adapter.generate_kv_cache(contexts, plain_store)
        plain = _sample(adapter, contexts, questions, store=plain_store)
        built = _store_bytes(plain_store)
        hooked = _sample(adapter, contexts, questions, store=plain_store, generation_context=perturb)
        assert _store_bytes(plain_store) == built  # answering under a hook writes nothing
    assert not torch.equal(hooked.tokens, plain.tokens)
    ref = _sample(adapter, contexts, questions, use_cache=False, generation_context=perturb)
    assert torch.equal(ref.tokens, hooked.tokens)
    assert _max_diff(ref, hooked) < 1e-10
    # misses computed during a hooked run are stored exactly as a plain run stores them
    with KVStore(str(tmp_path / "hooked")) as store, KVStore(str(tmp_path / "plain-run")) as plain_run:
        computed = _sample(adapter, contexts, questions, store=store, generation_context=perturb)
        _sample(adapter, contexts, questions, store=plain_run)
        assert computed.prefill_tokens_computed > 0
        assert torch.equal(computed.tokens, hooked.tokens)
        assert _store_bytes(store).keys() == built.keys()
        assert _store_content(store) == _store_content(plain_run)
        assert all(v[4]["attn"] == "sdpa" for k, v in _store_content(store).items() if not k.startswith("r/"))


@pytest.mark.parametrize("use_cache", [True, False])
def test_hook_never_sees_a_prefill(use_cache, tmp_path):
    adapter = _adapter()
    contexts, questions = _rows()
    counting = Counting()
    with KVStore(str(tmp_path / "s")) as store:  # empty: every context is computed during the run
        got = _sample(adapter, contexts, questions, store=store if use_cache else None, use_cache=use_cache,
                      generation_context=counting)  # fmt: skip
    if use_cache:
        assert got.prefill_tokens_computed > 0
    Q = max(len(q) for q in questions)
    assert counting.entered == 1  # one batch
    assert counting.lengths == [Q] + [1] * (N_NEW - 1)  # the question forward, then one token per step


def test_error_under_a_hook_is_one_line_naming_it(tmp_path):
    adapter = _adapter()
    contexts, questions = _rows()

    def broken(model):
        def boom(module, args, output):
            raise RuntimeError("layer exploded\nsecond line")

        @contextlib.contextmanager
        def ctx():
            h = model.model.layers[1].register_forward_hook(boom)
            try:
                yield
            finally:
                h.remove()

        return ctx()

    with KVStore(str(tmp_path / "s")) as store:
        adapter.generate_kv_cache(contexts, store)
        before = _store_bytes(store)
        expected = r"generation context 'test_error_under.*broken' failed: RuntimeError: layer exploded"
        with pytest.raises(HookError, match=expected) as exc:
            _sample(adapter, contexts, questions, store=store, generation_context=broken)
        assert "\n" not in str(exc.value)
        assert _store_bytes(store) == before
        # the model is left as it was: a plain run still answers
        _sample(adapter, contexts, questions, store=store)


def test_decode_attention_is_switched_off_after_an_error():
    adapter = _adapter()
    contexts, questions = _rows()

    def failing(module, query, key, value, attention_mask, **kwargs):
        raise ValueError("bad attention")

    with pytest.raises(HookError, match="failing.*ValueError: bad attention"):
        _sample(adapter, contexts, questions, use_cache=False, decode_attention=failing)
    assert adapter.model.config._attn_implementation == "sdpa"
    assert adapter.attn_implementation == "sdpa"


def test_keys_and_numerics_name_the_dense_attention_under_a_variant():
    adapter = _adapter()
    key = adapter.key([5, 6, 7])
    with attention_context(parse_attention("topk:4"))(adapter.model):
        assert adapter.model.config._attn_implementation.startswith("kvstore-")
        assert adapter.attn_implementation == "sdpa"
        assert adapter.key([5, 6, 7]) == key
    assert adapter.model.config._attn_implementation == "sdpa"


def test_compiled_steps_with_a_hook_are_refused():
    adapter = _adapter()
    with pytest.raises(HookError, match="drop compile"):
        adapter.greedy_sample([[5, 6]], [[7]], 2, decode_attention="topk:2", compile=True)
    with pytest.raises(HookError, match="drop compile"):
        adapter.sample([[5, 6]], [[7]], num_new_tokens=2, steps="static", generation_context=perturb)


def test_windowed_models_are_refused(tmp_path):
    from helpers.tiny import make_family_model

    model, tok = make_family_model("mistral")
    adapter = Adapter(model, tok)
    with pytest.raises(ModelError, match="every layer is full attention"):
        adapter.greedy_sample([[5, 6, 7]], [[8]], 2, decode_attention="topk:2")


# -- sweeps -----------------------------------------------------------------------------------------
VARIANTS = ["dense", "topk:3", "sparq:4:5"]


@pytest.mark.parametrize("use_cache", [True, False])
def test_sweep_equals_separate_runs(use_cache, tmp_path):
    adapter = _adapter()
    contexts, questions = _rows()
    kw = dict(use_cache=use_cache, batch_size=2, stop_at_eos=False, return_scores=True)
    with KVStore(str(tmp_path / "s")) as store:
        if use_cache:
            adapter.generate_kv_cache(contexts, store)
            kw["store"] = store
        swept = adapter.sweep(
            contexts, questions, num_new_tokens=N_NEW, variants=[*VARIANTS, Variant("scaled", perturb)], **kw
        )
        assert list(swept) == [*VARIANTS, "scaled"]
        for v in VARIANTS:
            alone = adapter.greedy_sample(contexts, questions, N_NEW, decode_attention=v, return_details=True, **kw)
            assert torch.equal(swept[v].tokens, alone.tokens), v
            assert _max_diff(swept[v], alone) < 1e-10
            assert swept[v].variant == v
        alone = adapter.greedy_sample(contexts, questions, N_NEW, generation_context=perturb, return_details=True, **kw)
        assert torch.equal(swept["scaled"].tokens, alone.tokens)
    assert not torch.equal(swept["topk:3"].tokens, swept["dense"].tokens)


def test_sweep_loads_once_and_leaves_context_slots_alone(tmp_path, monkeypatch):
    adapter = _adapter()
    contexts, questions = _rows()
    loads, prefills, checked = [], [], []
    real_load, real_prefill, real_answer = dense.load, complete_stage.prefill, dense.answer

    def load(*a, **k):
        loads.append(1)
        return real_load(*a, **k)

    def prefill(*a, **k):
        prefills.append(1)
        return real_prefill(*a, **k)

    def answer(handle, cache, *rest):
        P = cache.first_free
        before = [(k[:, :, :P].clone(), v[:, :, :P].clone()) for k, v in cache.bufs]
        out = real_answer(handle, cache, *rest)
        for (k, v), (k0, v0) in zip(cache.bufs, before):
            assert torch.equal(k[:, :, :P], k0) and torch.equal(v[:, :, :P], v0)
        checked.append(P)
        return out

    monkeypatch.setattr(dense, "load", load)
    monkeypatch.setattr(complete_stage, "prefill", prefill)
    monkeypatch.setattr(dense, "answer", answer)
    with KVStore(str(tmp_path / "s")) as store:
        adapter.generate_kv_cache(contexts, store)
        prefills.clear()
        swept = adapter.sweep(contexts, questions, num_new_tokens=N_NEW, variants=VARIANTS, store=store, batch_size=2,
                              stop_at_eos=False, load_ahead=False)  # fmt: skip
    assert len(loads) == 2  # two batches, each loaded once for three variants
    assert prefills == []
    assert len(checked) == 2 * len(VARIANTS)
    assert all(r.prefill_tokens_computed == 0 and all(r.cache_hit) for r in swept.values())


def test_sweep_variant_names_are_unique():
    adapter = _adapter()
    with pytest.raises(HookError, match="named twice: topk:2"):
        adapter.sweep([[5, 6]], [[7]], num_new_tokens=2, variants=["topk:2", "topk:2"])


def test_generation_context_and_decode_attention_together():
    adapter = _adapter()
    contexts, questions = _rows()
    alone = _sample(adapter, contexts, questions, use_cache=False, generation_context=perturb)
    both = _sample(adapter, contexts, questions, use_cache=False, generation_context=perturb,
                   decode_attention="topk:64")  # fmt: skip
    assert both.variant == "perturb+topk:64"
    assert torch.equal(both.tokens, alone.tokens)  # 64 keys cover every context: dense attention, scaled layer
    assert _max_diff(both, alone) < 1e-10
    few = _sample(adapter, contexts, questions, use_cache=False, generation_context=perturb, decode_attention="topk:2")
    assert not torch.equal(few.tokens, alone.tokens)
