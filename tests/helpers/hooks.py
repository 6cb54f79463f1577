"""Shared pieces of the decode-time hook tests (tests/model/test_hooks.py, test_decode_attention.py):
a tiny float64 model and greedy answers with scores, compared by their largest logit difference."""

from __future__ import annotations

import torch

from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter

N_NEW = 6


def tiny_adapter(kind: str = "llama", dtype=torch.float64) -> Adapter:
    model, tok = make_tiny_model(kind, dtype=dtype)
    return Adapter(model, tok)


def sample(adapter, contexts, questions, **kw):
    """``N_NEW`` greedy tokens per row with their scores (no stop at EOS unless asked)."""
    kw.setdefault("stop_at_eos", False)
    return adapter.greedy_sample(contexts, questions, N_NEW, return_details=True, return_scores=True, **kw)


def max_diff(a, b) -> float:
    """The largest logit difference between two results' scores."""
    return max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores))
