"""Chunked prefill: a context longer than ``prefill_chunk_tokens`` runs in pieces on top of a
preallocated cache and gives the KV (and so the answers) of one forward."""

from __future__ import annotations

import pytest
import torch

from helpers.cli import read_predictions, run_main, write_dataset
from helpers.rows import random_ids
from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.store.kvstore import KVStore


@pytest.mark.parametrize("kind", ["neox", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chunked_prefill_gives_the_kv_of_one_forward(kind, attn):
    """float64, a right-padded batch of 5-, 40- and 63-token rows in pieces of 16 (and of 7: a piece
    boundary inside every row): every row's keys and values within 1e-10 of one forward (1e-5 with
    eager attention, whose softmax runs in float32)."""
    model, tok = make_tiny_model(kind, dtype=torch.float64, seed=2, attn_implementation=attn)
    adapter = Adapter(model, tok, prefill_chunk_tokens=0)
    batch = random_ids(tok, [5, 40, 63])
    whole = adapter.prefill(batch)
    tol = 1e-10 if attn == "sdpa" else 1e-5
    for piece in (16, 7):
        adapter.prefill_chunk_tokens = piece
        pieces = adapter.prefill(batch)
        for row_w, row_p, ids in zip(whole, pieces, batch):
            for (kw, vw), (kp, vp) in zip(row_w, row_p):
                assert kp.shape == kw.shape and kp.shape[1] == len(ids)
                torch.testing.assert_close(kp, kw, atol=tol, rtol=0)
                torch.testing.assert_close(vp, vw, atol=tol, rtol=0)


def test_answers_from_a_chunked_build_equal_the_no_cache_path(tiny_llama_dir, tmp_path, capsys):
    """``build --prefill-chunk 8`` stores contexts computed in pieces; ``sample`` from that store
    gives every row's text of ``sample --no-cache`` (the option's plumbing; the float64 tests above
    carry the exactness: this default-init model would hide a position bug)."""
    data = write_dataset(tmp_path / "d.jsonl", range(4), words=(20, 40))
    base = ["--model", tiny_llama_dir, "--store", tmp_path / "s", "--quiet", "--format", "json"]
    code, _, err = run_main(capsys, "build", data, *base, "--prefill-chunk", "8")
    assert code == 0, err
    outs = {}
    for name, extra in (("cached", ("--readonly-store",)), ("ref", ("--no-cache",))):
        code, _, err = run_main(capsys, "sample", data, *base, "-n", "8", "-o", tmp_path / f"{name}.jsonl", *extra)
        assert code == 0, err
        outs[name] = read_predictions(tmp_path / f"{name}.jsonl")
    assert all(r["cache_hit"] for r in outs["cached"].values())
    texts = {name: {k: r["raw_output"] for k, r in rows.items()} for name, rows in outs.items()}
    assert texts["cached"] == texts["ref"]


def test_chunked_prefill_into_a_store_matches_generate():
    """float64: contexts built in 8-token pieces, then answered from the store: Hugging Face
    ``generate`` on each whole prompt gives the same tokens."""
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=5)
    adapter = Adapter(model, tok, prefill_chunk_tokens=8)
    contexts = random_ids(tok, [3, 30, 61, 17], 1)
    questions = random_ids(tok, [2, 5, 1, 4], 2)
    with KVStore("memory://") as store:
        adapter.generate_kv_cache(contexts, store, batch_size=4)
        got = adapter.greedy_sample(contexts, questions, 6, store=store, stop_at_eos=False, batch_size=4)
    for row, (c, q) in enumerate(zip(contexts, questions)):
        x = torch.tensor([c + q])
        want = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, x.shape[1]:]  # fmt: skip
        assert torch.equal(got[row], want), row


def test_automatic_piece_follows_the_attention_implementation():
    """Unset, eager attention prefills in pieces of 512 and fused kernels in pieces of 8192; a set
    value wins, and 0 means one forward."""
    for attn, piece in (("eager", 512), ("sdpa", 8192)):
        model, tok = make_tiny_model("llama", attn_implementation=attn)
        adapter = Adapter(model, tok)
        assert adapter.prefill_piece == piece
        adapter.prefill_chunk_tokens = 64
        assert adapter.prefill_piece == 64
        adapter.prefill_chunk_tokens = 0
        assert adapter.prefill_piece == 0
