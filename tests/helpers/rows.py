"""Random token rows for the exactness tests: contexts and questions as token ids drawn from a
tokenizer's ordinary (non-special) vocabulary, reproducible from a seed.

``rng`` is a seed, a ``random.Random`` (shared across calls, so a test can draw lengths and
tokens from one stream) or a ``torch.Generator``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

Rng = int | random.Random | torch.Generator


def plain_vocab(tokenizer: Any) -> list[int]:
    """Every token id that is not a special token (no BOS/EOS/pad inside a random row)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _rng(rng: Rng) -> random.Random | torch.Generator:
    return random.Random(rng) if isinstance(rng, int) else rng


def _draw(vocab: list[int], n: int, rng: random.Random | torch.Generator) -> list[int]:
    if isinstance(rng, torch.Generator):
        return [vocab[int(i)] for i in torch.randint(len(vocab), (n,), generator=rng)]
    return [rng.choice(vocab) for _ in range(n)]


def random_ids(tokenizer: Any, lengths: Sequence[int], rng: Rng = 0) -> list[list[int]]:
    """One row of random ids per length."""
    vocab, rng = plain_vocab(tokenizer), _rng(rng)
    return [_draw(vocab, n, rng) for n in lengths]


def random_tokens(tokenizer: Any, n: int, rng: Rng = 0) -> list[int]:
    """One row of ``n`` random ids."""
    return random_ids(tokenizer, [n], rng)[0]


def _length(spec: tuple[int, int] | Sequence[int], rng: random.Random) -> int:
    """``(lo, hi)``: a length in that closed range; a longer list: one of its values."""
    return rng.randint(*spec) if isinstance(spec, tuple) else rng.choice(list(spec))


def random_rows(
    tokenizer: Any,
    n: int,
    rng: int | random.Random = 0,
    *,
    context_tokens: tuple[int, int] | Sequence[int] = (5, 30),
    question_tokens: tuple[int, int] | Sequence[int] = (1, 4),
    per_context: int = 1,
) -> tuple[list[list[int]], list[list[int]]]:
    """``(contexts, questions)``: ``n`` random contexts, each asked ``per_context`` random
    questions (so ``contexts`` repeats each context ``per_context`` times, row by row). Lengths
    come from ``context_tokens`` / ``question_tokens`` (see :func:`_length`); every context is
    drawn before the questions."""
    vocab = plain_vocab(tokenizer)
    r = random.Random(rng) if isinstance(rng, int) else rng
    contexts = [_draw(vocab, _length(context_tokens, r), r) for _ in range(n)]
    rows = [(c, _draw(vocab, _length(question_tokens, r), r)) for c in contexts for _ in range(per_context)]
    return [c for c, _ in rows], [q for _, q in rows]


__all__ = ["plain_vocab", "random_ids", "random_rows", "random_tokens"]
