"""Options as values: one prompt format for build and sample (keys cannot drift apart), options
objects with per-call overrides, and the research code's calls still working."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import CORPUS, make_tiny_model
from kvstore.data.prompts import PromptFormat
from kvstore.model.adapter import Adapter
from kvstore.model.options import BuildOptions, SampleOptions, apply_prompt
from kvstore.store.kvstore import KVStore

N_NEW = 4


@pytest.fixture
def adapter() -> Adapter:
    return Adapter(*make_tiny_model("llama", dtype=torch.float64))


def _rows():
    contexts = [CORPUS[0], CORPUS[1], CORPUS[0]]
    questions = ["Who sleeps?", "What is it?", "Where?"]
    return contexts, questions


def test_one_prompt_format_for_build_and_sample_hits_and_equals_the_reference(adapter):
    fmt = PromptFormat.plain("Read this.\n{context}\nQ: {question}\nA:")
    contexts, questions = _rows()
    with KVStore("memory://", chunk_tokens=8) as store:
        report = adapter.build(contexts, store, prompt=fmt)
        assert report.built == 2
        got = adapter.sample(contexts, questions, store=store, prompt=fmt, num_new_tokens=N_NEW, stop_at_eos=False)
    assert all(got.cache_hit) and got.prefill_tokens_computed == 0
    ref = adapter.sample(contexts, questions, prompt=fmt, use_cache=False, num_new_tokens=N_NEW, stop_at_eos=False)
    assert torch.equal(got.tokens, ref.tokens)
    # the same as spelling the format out by hand, as the CLI used to
    by_hand = adapter.greedy_sample(
        [fmt.context_part(c) for c in contexts], [fmt.question_part(q) for q in questions], N_NEW, use_cache=False,
        special_tokens=fmt.add_special_tokens, prefix=fmt.head, stop_at_eos=False,
    )  # fmt: skip
    assert torch.equal(by_hand, ref.tokens)


def test_a_prompt_format_with_another_head_misses(adapter):
    contexts, questions = _rows()
    with KVStore("memory://", chunk_tokens=8) as store:
        adapter.build(contexts, store, prompt=PromptFormat.plain("Read this.\n{context}\nQ: {question}\nA:"))
        other = PromptFormat.plain("Read that.\n{context}\nQ: {question}\nA:")
        got = adapter.sample(contexts, questions, store=store, prompt=other, num_new_tokens=N_NEW)
    assert not any(got.cache_hit)


def test_prompt_and_its_parts_together_are_refused(adapter):
    fmt = PromptFormat.plain()
    with pytest.raises(ValueError, match="not both"):
        adapter.sample(["a b"], ["c"], prompt=fmt, prefix="a", use_cache=False)
    with pytest.raises(ValueError, match="not both"):
        apply_prompt(fmt, ["a"], special_tokens=False)
    with pytest.raises(TypeError, match="token ids"):
        adapter.sample([[5, 6]], ["c"], prompt=fmt, use_cache=False)


def test_options_objects_and_overrides(adapter):
    contexts, questions = _rows()
    opts = SampleOptions(num_new_tokens=N_NEW, stop_at_eos=False, use_cache=False)
    a = adapter.sample(contexts, questions, opts)
    b = adapter.sample(contexts, questions, opts, batch_size=1)  # a field named in the call overrides
    c = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, stop_at_eos=False)  # the research call
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, c)
    assert SampleOptions.of(opts, batch_size=2).batch_size == 2 and opts.batch_size == 8
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        adapter.sample(contexts, questions, opts, batchsize=2)
    with pytest.raises(TypeError, match="unknown SampleOptions field"):
        SampleOptions.of(opts, batchsize=2)
    with pytest.raises(TypeError, match="must be a SampleOptions"):
        adapter.sample(contexts, questions, BuildOptions())
    with pytest.raises(ValueError, match="steps must be one of"):
        SampleOptions(steps="fast")
    with pytest.raises(ValueError, match="at least 1"):
        SampleOptions(num_new_tokens=0)
    with KVStore("memory://", chunk_tokens=8) as store:
        report = adapter.generate_kv_cache(contexts, store, shard=(0, 2))  # legacy keywords become BuildOptions
        assert report.distinct + report.other_shards == 2
        with pytest.raises(ValueError, match="0 <= I < N"):
            adapter.build(contexts, store, BuildOptions(shard=(2, 2)))


def test_load_ahead_is_an_option_not_a_global(adapter, monkeypatch):
    """``load_ahead=False`` loads every batch in turn on the caller's thread; the answers agree."""
    import threading

    from kvstore.model.paths import dense
    from kvstore.model.pipelines import sample as sampling

    threads: list[str] = []
    real = sampling.load

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "load", spy)  # the next batch's load, submitted ahead
    monkeypatch.setattr(dense, "load", spy)  # a batch that loads itself
    contexts, questions = _rows()
    with KVStore("memory://", chunk_tokens=8) as store:
        adapter.build(contexts, store)
        on = adapter.sample(contexts, questions, store=store, batch_size=1, num_new_tokens=N_NEW)
        ahead = list(threads)
        threads.clear()
        off = adapter.sample(contexts, questions, store=store, batch_size=1, num_new_tokens=N_NEW, load_ahead=False)
    assert torch.equal(on.tokens, off.tokens)
    assert any(t.startswith("kvstore-load") for t in ahead)
    assert threads and not any(t.startswith("kvstore-load") for t in threads)


def test_press_and_decode_attention_keywords_say_what_to_give_instead(adapter):
    """One line naming the value given and what to write: a composed spec given to ``press=``
    points to ``decode_attention=`` (one variant) and ``variants=`` (a sweep); a press given to
    ``decode_attention=`` points to ``press=``; a bad press gets the press parser's message."""
    from kvstore.errors import HookError, PressError
    from kvstore.model.options import ScoreOptions

    contexts, questions = _rows()
    composed = [
        lambda: SampleOptions(press="snapkv:0.5+topk:4"),
        lambda: ScoreOptions(press="snapkv:0.5+topk:4"),
        lambda: adapter.sample(contexts, questions, use_cache=False, press="snapkv:0.5+topk:4"),
        lambda: adapter.score(contexts, questions, use_cache=False, press="snapkv:0.5+topk:4"),
    ]
    for call in composed:
        with pytest.raises(PressError) as exc:
            call()
        assert str(exc.value) == (
            "press='snapkv:0.5+topk:4' is a press and a decode attention: give press='snapkv:0.5' and "
            "decode_attention='topk:4' for one variant, or variants=['snapkv:0.5+topk:4'] in a sweep"
        )
    with pytest.raises(HookError, match=r"^decode_attention='knorm:0.5' names a press: give press='knorm:0.5'$"):
        SampleOptions(decode_attention="knorm:0.5")
    with pytest.raises(PressError, match=r"unknown press 'bogus' \(presses: knorm, "):
        SampleOptions(press="bogus:0.5")
    with pytest.raises(ValueError, match=r"a sweep takes its presses and decode attention from variants="):
        adapter.sweep(contexts, questions, use_cache=False, variants=["dense"], press="knorm:0.5")
    assert SampleOptions(decode_attention="dense").decode_attention is None  # dense: read by the variant parser


def test_takes_options_builds_keywords_signature_and_docs_from_the_fields():
    """The mechanism behind the Adapter's keywords: a field added to an options class is a keyword
    of every method that takes the class, with its default and doc; nothing else to edit."""
    import inspect
    from dataclasses import dataclass

    from kvstore.model.keywords import documented, field_default, option, takes_options

    @documented
    @dataclass(frozen=True)
    class Knobs:
        """Some knobs."""

        depth: int = option(3, "how deep")
        name: str = option("x", "what it is called")

    class Thing:
        @takes_options(Knobs)
        def run(self, items: list, options: Knobs | None = None, *, label: str = "", **fields: object) -> tuple:
            """Run over ``items``."""
            assert not fields  # folded into options before the body runs
            return items, options, label

        @takes_options(Knobs, first="depth")
        def legacy(self, items: list, depth: int | None = None, *, options: Knobs | None = None, **fields: object):
            """The old call."""
            assert depth is None and not fields
            return options

    sig = inspect.signature(Thing.run)
    assert list(sig.parameters) == ["self", "items", "options", "label", "depth", "name"]
    assert sig.parameters["depth"].default == 3 and sig.parameters["depth"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "``depth`` (int, default 3): how deep" in Thing.run.__doc__ and "``depth``" in Knobs.__doc__
    thing = Thing()
    assert thing.run([1], depth=5) == ([1], Knobs(depth=5), "")
    assert thing.run([1], Knobs(name="y"), depth=4)[1] == Knobs(depth=4, name="y")  # a keyword overrides a field
    assert thing.legacy([1], 7) == Knobs(depth=7)  # a field as the positional parameter after the written ones
    with pytest.raises(TypeError, match="unexpected keyword argument 'deep'"):
        thing.run([1], deep=2)
    with pytest.raises(TypeError, match="must be a Knobs"):
        thing.run([1], BuildOptions())
    assert field_default(Knobs, "name") == "x"
    assert list(inspect.signature(Thing.legacy).parameters) == ["self", "items", "depth", "options", "name"]
    with pytest.raises(TypeError, match="depth come from Knobs; do not declare them"):
        takes_options(Knobs)(lambda self, options, depth=1, **fields: None)
    with pytest.raises(TypeError, match="needs '\\*\\*fields' typed with Knobs's keywords"):
        takes_options(Knobs)(lambda self, options: None)
    with pytest.raises(TypeError, match="declare depth where it comes, with a default of None"):
        takes_options(Knobs, first="depth")(lambda self, depth=3, options=None, **fields: None)
    with pytest.raises(TypeError, match="declare size with option"):

        @documented
        @dataclass(frozen=True)
        class Bare:
            size: int = 1
