"""Fixed-shape decode steps (``steps="static"``) and compiled ones (``sample --compile``) give the
tokens of the eager loop and of Hugging Face ``generate``, on stored and computed contexts."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.cli import read_predictions, run_main, write_dataset
from helpers.rows import random_rows
from helpers.tiny import make_family_model, make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.compute import static
from kvstore.store.kvstore import KVStore

N_NEW = 10
ROWS = dict(context_tokens=[1, 4, 17, 40, 63], question_tokens=(1, 6))


def _hf_generate(model, ids: list[int], n: int) -> torch.Tensor:
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :]


def _sample(adapter, contexts, questions, steps, **kw):
    kw.setdefault("stop_at_eos", False)
    return adapter.sample(contexts, questions, num_new_tokens=N_NEW, steps=steps, return_scores=True, **kw)


@pytest.mark.parametrize("kind", ["neox", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_steps_equal_eager_steps_and_generate(kind, attn):
    """float64: fixed-shape steps over a bucket of zeroed slots give every row's tokens of the eager
    loop and of ``generate`` (one row alone), logits within 1e-10 (1e-5 with eager attention, whose
    softmax runs in float32 over more slots), cached and without a cache, at
    batch sizes 1 and 4 (rows padded to each other)."""
    model, tok = make_tiny_model(kind, dtype=torch.float64, seed=3, attn_implementation=attn)
    adapter = Adapter(model, tok)
    contexts, questions = random_rows(tok, 6, 1, **ROWS)
    want = torch.stack([_hf_generate(model, c + q, N_NEW) for c, q in zip(contexts, questions)])
    with KVStore("memory://") as store:
        adapter.generate_kv_cache(contexts[:3], store)
        for use_cache in (True, False):
            for bs in (1, 4):
                kw = dict(use_cache=use_cache, store=store if use_cache else None, batch_size=bs)
                eager = _sample(adapter, contexts, questions, "dynamic", **kw)
                fixed = _sample(adapter, contexts, questions, "static", **kw)
                assert torch.equal(eager.tokens, want), (use_cache, bs)
                assert torch.equal(fixed.tokens, want), (use_cache, bs)
                tol = 1e-10 if attn == "sdpa" else 1e-5  # eager attention's softmax runs in float32
                for a, b in zip(fixed.scores, eager.scores):
                    torch.testing.assert_close(a, b, atol=tol, rtol=0)


def test_compiled_steps_equal_eager_and_compile_once_per_shape(tiny_llama_dir):
    """``compile=True`` (torch.compile, float64): the same tokens as the eager loop, logits within
    1e-4 (the compiled graph runs its own kernels: up to 3.3e-6 apart when this was written); a
    later batch whose slots fall in the same bucket and batch size reuses the compiled step."""
    adapter = Adapter.from_pretrained(str(tiny_llama_dir), dtype="float64")
    contexts, questions = random_rows(adapter.tokenizer, 4, 2, **ROWS)
    torch._dynamo.reset()
    with KVStore("memory://") as store:
        eager = _sample(adapter, contexts, questions, "dynamic", store=store, batch_size=2)
        compiled = _sample(adapter, contexts, questions, "compiled", store=store, batch_size=2)
        assert torch.equal(compiled.tokens, eager.tokens)
        for a, b in zip(compiled.scores, eager.scores):  # other kernels: up to 3.3e-6 apart
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        shorter = [c[: max(1, len(c) // 2)] for c in contexts]
        again = _sample(adapter, shorter, questions, "compiled", store=store, batch_size=2)
        want = _sample(adapter, shorter, questions, "dynamic", store=store, batch_size=2)
        assert torch.equal(again.tokens, want.tokens)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles, "recompiled for a shape it had"


def test_bucket_slots():
    assert static.bucket_slots(1, True) == static.SLOT_BUCKET
    assert static.bucket_slots(static.SLOT_BUCKET, True) == static.SLOT_BUCKET
    assert static.bucket_slots(static.SLOT_BUCKET + 1, True) == 2 * static.SLOT_BUCKET
    assert static.bucket_slots(300, False) == 300


def test_fixed_steps_need_full_attention_and_valid_steps():
    model, tok = make_family_model("mistral")
    adapter = Adapter(model, tok)
    with pytest.raises(ValueError, match="full attention"):
        adapter.greedy_sample([[5, 6, 7]], [[8]], 2, use_cache=False, compile=True)
    llama = Adapter(*make_tiny_model("llama"))
    with pytest.raises(ValueError, match="steps must be one of"):
        llama.sample([[5, 6, 7]], [[8]], num_new_tokens=2, steps="fast")


def test_cli_sample_compile(tiny_llama_dir, tmp_path, capsys):
    """``sample --compile`` answers as ``sample`` does and says so in its summary."""
    data = write_dataset(tmp_path / "d.jsonl", range(3))
    base = ["--model", tiny_llama_dir, "--store", tmp_path / "s", "--quiet", "--format", "json", "-n", "6"]
    summaries = []
    for name, extra in (("a", ()), ("b", ("--compile",))):
        code, out, err = run_main(capsys, "sample", data, *base, "-o", tmp_path / f"{name}.jsonl", *extra)
        assert code == 0, err
        summaries.append(json.loads(out))
    assert [s["compiled"] for s in summaries] == [False, True]
    a, b = read_predictions(tmp_path / "a.jsonl"), read_predictions(tmp_path / "b.jsonl")
    assert {k: r["raw_output"] for k, r in a.items()} == {k: r["raw_output"] for k, r in b.items()}
