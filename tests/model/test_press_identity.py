"""A registered press is keyed by what it computes: redefining it under the same name misses its
stored scores and pressed caches (it never answers from the old scorer's), re-registering the same
scorer keeps hitting, and the identity is a digest that every process computes alike."""

from __future__ import annotations

import enum
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kvstore
from helpers.rows import random_ids
from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.press.identity import OpaqueValueError, scorer_identity
from kvstore.model.press.registry import press_method, register_press, unregister_press
from kvstore.model.press.spec import parse_press
from kvstore.model.press.stored import pressed_spec, scores_spec
from kvstore.store.kvstore import KVStore

NAME = "vn_identity_test"


def _value_norm(inputs):
    return inputs.values.norm(dim=-1)


def _negative_value_norm(inputs):
    return -inputs.values.norm(dim=-1)


@pytest.fixture(scope="module")
def llama():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=5)
    return Adapter(model, tok)


@pytest.fixture
def registered():
    yield
    unregister_press(NAME)


def _sweep(adapter, contexts, questions, **kw):
    kw.setdefault("stop_at_eos", False)
    return adapter.sweep(contexts, questions, variants=[f"{NAME}:0.5"], num_new_tokens=4, return_scores=True,
                         **kw)[f"{NAME}:0.5"]  # fmt: skip


def _same(a, b) -> bool:
    worst = max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores))
    return torch.equal(a.tokens, b.tokens) and worst < 1e-10


def test_a_redefined_press_misses_its_old_entries_and_the_same_scorer_hits(llama, registered):
    contexts = random_ids(llama.tokenizer, [70, 90], rng=3)
    questions = random_ids(llama.tokenizer, [3, 2], rng=4)
    register_press(NAME, _value_norm)
    old_ref = _sweep(llama, contexts, questions, use_cache=False)
    with KVStore("memory://", chunk_tokens=32) as store:
        built = llama.build(contexts, store, presses=[f"{NAME}:0.5"], scores=[NAME])
        assert built.pressed_written == 2 and built.scores_written == 2
        unregister_press(NAME)
        register_press(NAME, _negative_value_norm)  # another scorer under the same name
        plan = llama.plan_build(contexts, store, presses=[f"{NAME}:0.5"], scores=[NAME])
        assert plan.pressed_to_make == 2 and plan.scores_to_make == 2  # the old entries are not this press's
        got = _sweep(llama, contexts, questions, store=store)
        new_ref = _sweep(llama, contexts, questions, use_cache=False)
        assert not _same(old_ref, new_ref)  # the two scorers answer differently
        assert _same(got, new_ref) and got.kept_tokens == new_ref.kept_tokens
        assert got.prefill_tokens_computed == 0  # the dense chains still hit
        # the same scorer registered again: its entries hit (once built)
        llama.build(contexts, store, presses=[f"{NAME}:0.5"], scores=[NAME])
        unregister_press(NAME)
        register_press(NAME, _negative_value_norm)
        plan = llama.plan_build(contexts, store, presses=[f"{NAME}:0.5"], scores=[NAME])
        assert plan.pressed_to_make == 0 and plan.scores_to_make == 0
        again = _sweep(llama, contexts, questions, store=store)
        assert all(again.cache_hit) and _same(again, new_ref)


def test_a_version_bump_or_another_default_misses_and_built_in_keys_stay():
    register_press(NAME, _value_norm)
    try:
        first = press_method(NAME).identity
        unregister_press(NAME)
        register_press(NAME, _value_norm, version="2")
        assert press_method(NAME).identity not in ("", first)
        unregister_press(NAME)
        register_press(NAME, _value_norm, params={"alpha": 1.0})
        assert press_method(NAME).identity not in ("", first)
        unregister_press(NAME)
        register_press(NAME, _value_norm)
        assert press_method(NAME).identity == first
        assert pressed_spec(parse_press(f"{NAME}:0.5")) == f"{NAME}:0.5@{first}"
    finally:
        unregister_press(NAME)
    # built-ins: the spec alone (their stored entries keep hitting; tests/golden pins the keys)
    assert pressed_spec(parse_press("kvzip:0.75")) == "kvzip:0.75"
    assert scores_spec(parse_press("kvzip:0.75")) == "kvzip:chunk=2048:n_sink=4:plus=false"


def test_the_identity_follows_the_code_and_falls_back_to_the_name():
    assert scorer_identity(_value_norm) != scorer_identity(_negative_value_norm)
    assert scorer_identity(_value_norm) == scorer_identity(_value_norm)
    assert scorer_identity(_value_norm, "2") != scorer_identity(_value_norm)
    part = functools.partial(_value_norm)
    assert scorer_identity(part) != scorer_identity(functools.partial(_negative_value_norm))

    def scaled(k):
        return lambda inputs: inputs.values.norm(dim=-1) * k

    assert scorer_identity(scaled(1.0)) != scorer_identity(scaled(2.0))  # closure values count

    class Scorer:
        def __call__(self, inputs):
            return inputs.values.norm(dim=-1)

    assert scorer_identity(Scorer()) == scorer_identity(Scorer())  # an object: its name (and version) alone
    assert scorer_identity(Scorer(), "1") != scorer_identity(Scorer(), "2")


def test_the_identity_is_the_same_in_another_process(tmp_path):
    (tmp_path / "idmod.py").write_text(
        textwrap.dedent("""
        def score(inputs, words=("a", "b"), scale=0.5):
            if inputs in {"x", "y", "z"}:  # a frozenset constant: its order varies with the hash seed
                return None
            return inputs.values.norm(dim=-1) * scale
    """)
    )
    code = "import idmod; from kvstore.model.press.identity import scorer_identity as s; print(s(idmod.score, 'v'))"
    runs = []
    for seed in ("1", "2"):
        env = {"PYTHONPATH": f"{tmp_path}:{Path(kvstore.__file__).parent.parent}", "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.append(out.stdout.strip())
    sys.path.insert(0, str(tmp_path))
    try:
        import idmod

        assert runs == [scorer_identity(idmod.score, "v")] * 2
    finally:
        sys.path.remove(str(tmp_path))


def test_build_options_refuse_scores_alone_without_dense_and_dedupe(llama):
    from kvstore.model.options import BuildOptions

    with pytest.raises(ValueError, match="no stored context keeps"):
        BuildOptions(scores=["kvzip"], dense=False)
    with pytest.raises(ValueError, match="stores nothing"):
        BuildOptions(dense=False)
    both = BuildOptions(presses=["kvzip:0.75", "kvzip:0.75:global"], scores=["kvzip", "kvzip:0.5"], dense=False)
    assert [p.name for p in both.presses] == ["kvzip:0.75"] and len(both.scores) == 1


def test_a_corrupt_scores_entry_is_rebuilt_by_the_next_build(llama):
    from kvstore.model.press.spec import parse_scorer
    from kvstore.model.press.stored import scores_key
    from kvstore.store.keyspace import derived_entry_key

    contexts = random_ids(llama.tokenizer, [50, 60], rng=7)
    with KVStore("memory://", chunk_tokens=32) as store:
        assert llama.build(contexts, store, scores=["expected_attention"]).scores_written == 2
        chain = llama.chain(contexts[0], store)
        name = derived_entry_key(chain.context_key, scores_key(chain, parse_scorer("expected_attention")))
        good = store.backend.get(name)
        raw = bytearray(good)
        raw[len(raw) // 2] ^= 0xFF
        store.backend.put(name, bytes(raw))
        with pytest.warns(Warning, match="corrupt"):
            plan = llama.plan_build(contexts, store, scores=["expected_attention"])
        assert plan.scores_to_make == 1
        with pytest.warns(Warning, match="corrupt"):
            assert llama.build(contexts, store, scores=["expected_attention"]).scores_written == 1
        assert store.backend.get(name) != bytes(raw) and not store.verify().corrupt


def _weighted(weights):
    def score(inputs):
        return inputs.values.norm(dim=-1) * weights.sum()

    return score


_F4 = np.dtype("f4")


class _Mode(enum.Enum):
    UP = 1
    DOWN = -1


def test_tensors_arrays_enums_and_dtypes_count_by_content():
    assert scorer_identity(_weighted(torch.ones(64))) != scorer_identity(_weighted(-torch.ones(64)))
    assert scorer_identity(_weighted(torch.ones(64))) == scorer_identity(_weighted(torch.ones(64)))
    assert scorer_identity(_weighted(torch.ones(64))) != scorer_identity(_weighted(torch.ones(64, dtype=torch.float64)))
    assert scorer_identity(_weighted(torch.ones(64))) != scorer_identity(_weighted(torch.ones(8, 8)))
    assert scorer_identity(_weighted(torch.ones(4, 4).t())) == scorer_identity(_weighted(torch.ones(4, 4)))
    bf = torch.arange(6, dtype=torch.bfloat16)
    assert scorer_identity(_weighted(bf)) != scorer_identity(_weighted(bf.flip(0)))
    assert scorer_identity(_weighted(np.ones(3))) != scorer_identity(_weighted(np.zeros(3)))
    assert scorer_identity(_weighted(np.float32(1))) != scorer_identity(_weighted(np.float32(2)))

    def with_defaults(inputs, mode=_Mode.UP, dtype=torch.float32, np_dtype=_F4):
        return inputs.values.norm(dim=-1)

    def other(**kw):
        return scorer_identity(functools.partial(with_defaults, **kw))

    assert other(mode=_Mode.UP) != other(mode=_Mode.DOWN)
    assert other(dtype=torch.float32) != other(dtype=torch.float16)
    assert other(np_dtype=np.dtype("f4")) != other(np_dtype=np.dtype("f8"))
    assert other(mode=_Mode.UP) == other(mode=_Mode.UP)

    class Weighted:  # an object's attributes count too
        def __init__(self, w):
            self.w = w

        def __call__(self, inputs):
            return inputs.values.norm(dim=-1) * self.w.sum()

    assert scorer_identity(Weighted(torch.ones(3))) != scorer_identity(Weighted(-torch.ones(3)))


def test_a_value_without_content_is_refused_unless_a_version_is_given(registered):
    class Opaque:  # no dataclass, no content the digest can read
        pass

    holder = Opaque()
    with pytest.raises(OpaqueValueError, match=rf"press {NAME}: .*Opaque.*pass version="):
        register_press(NAME, _weighted_by(holder))
    assert press_method(NAME) is None
    register_press(NAME, _weighted_by(holder), version="1")  # the version is the author's promise
    assert press_method(NAME).identity


def _weighted_by(holder):
    return lambda inputs: inputs.values.norm(dim=-1) * (holder is not None)


def test_a_press_registered_again_with_other_weights_misses(llama, registered):
    contexts = random_ids(llama.tokenizer, [70, 90], rng=3)
    questions = random_ids(llama.tokenizer, [3, 2], rng=4)
    register_press(NAME, _weighted(torch.ones(64)))
    old_ref = _sweep(llama, contexts, questions, use_cache=False)
    with KVStore("memory://", chunk_tokens=32) as store:
        built = llama.build(contexts, store, presses=[f"{NAME}:0.5"], scores=[NAME])
        assert built.pressed_written == 2 and built.scores_written == 2
        unregister_press(NAME)
        register_press(NAME, _weighted(-torch.ones(64)))  # the same code, other weights
        plan = llama.plan_build(contexts, store, presses=[f"{NAME}:0.5"], scores=[NAME])
        assert plan.pressed_to_make == 2 and plan.scores_to_make == 2
        got = _sweep(llama, contexts, questions, store=store)
        new_ref = _sweep(llama, contexts, questions, use_cache=False)
        assert not _same(old_ref, new_ref)
        assert _same(got, new_ref) and got.kept_tokens == new_ref.kept_tokens


def test_a_corrupt_scores_entry_stored_beside_a_pressed_cache_is_remade_by_build_press(llama, tmp_path):
    """Issue 45, finding 7: ``build --press P --codec C`` stores P's scores as a side effect; a
    corrupt one is made again by the next ``build --press P`` (with or without C), and the plan
    (``--dry-run``) counts exactly the scores the build writes."""
    from kvstore.model.press.stored import scores_key
    from kvstore.store.keyspace import derived_entry_key

    contexts = random_ids(llama.tokenizer, [50, 60], rng=7)
    path = str(tmp_path / "store")
    with KVStore(path, chunk_tokens=32, codec="int8") as store:
        plan = llama.plan_build(contexts, store, presses=["snapkv:0.5"])
        built = llama.build(contexts, store, presses=["snapkv:0.5"])
        assert (plan.scores_to_make, built.scores_written, built.pressed_written) == (2, 2, 2)
        chain = llama.chain(contexts[0], store)
        name = derived_entry_key(chain.context_key, scores_key(chain, parse_press("snapkv:0.5")))
        raw = bytearray(store.backend.get(name))
        raw[len(raw) // 2] ^= 0xFF
        store.backend.put(name, bytes(raw))
        with pytest.warns(Warning, match="corrupt"):
            plan = llama.plan_build(contexts, store, presses=["snapkv:0.5"])
        assert (plan.pressed_to_make, plan.scores_to_make) == (0, 1)
        with pytest.warns(Warning, match="corrupt"):
            built = llama.build(contexts, store, presses=["snapkv:0.5"])
        assert (built.pressed_written, built.scores_written) == (0, 1)
        assert not store.verify().corrupt
    with KVStore(path, codec="zstd-split:1:16") as store:  # lossless: other pressed caches and scores
        plan = llama.plan_build(contexts, store, presses=["snapkv:0.5"])
        built = llama.build(contexts, store, presses=["snapkv:0.5"])
        assert plan.scores_to_make == built.scores_written == 2 and built.pressed_written == 2
