"""A build, planned once: per distinct context what is stored of it and what the build does.

:func:`plan_build` makes a frozen :class:`BuildPlan` before any work: per distinct context of this
shard a :class:`ContextStep` saying what is stored of it (its verified chunks) and what the build
does: ``skip`` (stored whole and recorded), ``record`` (stored whole, its record missing),
``migrate`` (a format-1 entry holding exactly it: rewritten as a chain, nothing recomputed),
``compute`` (its chunks from the stored prefix on), or ``none`` (dense chains not kept and none
stored), and which pressed caches and scores it lacks (verified as its chunks are: a corrupt one is
made again). ``kvstore build --dry-run`` prints it;
:func:`kvstore.model.pipelines.build.run_build` carries it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import ContextTooLongError
from kvstore.model.handle import row_label
from kvstore.model.io import chains
from kvstore.model.io.chains import Chain, Keying
from kvstore.model.io.probes import has_v1, verified_depth
from kvstore.model.options import BuildOptions
from kvstore.model.press.spec import Press
from kvstore.model.press.stored import FORWARD_READS, pressed_key, scores_key, storable, stored_intact
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import PRESSED, SCORES

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds


def in_shard(key: str, i: int, n: int) -> bool:
    """Whether shard ``i`` of ``n`` builds ``key``: its first 16 hex digits, read as a number,
    are ``i`` modulo ``n`` (keys are sha256 hex, so shards get near-equal shares)."""
    return int(key[:16], 16) % n == i


@dataclass(frozen=True)
class ContextStep:
    """One distinct context's part of a build: its ``chain``, the leading chunks found stored and
    intact (``depth``), what the build does with its dense chain (``action``: ``skip``, ``record``,
    ``migrate``, ``compute``; ``none`` when dense chains are not kept and it has none), and the
    presses and scorers whose pressed caches and scores it lacks."""

    chain: Chain
    depth: int
    action: str
    presses: tuple[Press, ...] = ()
    scores: tuple[Press, ...] = ()

    @property
    def tokens_to_compute(self) -> int:
        """Context tokens the build runs through the model for it (its missing chunks; with
        ``dense=False`` the whole context when a press or scorer needs it and none is stored)."""
        if self.action == "compute":
            return self.chain.n_tokens - (self.chain.spans[self.depth - 1][1] if self.depth else 0)
        if self.action == "none" and (self.presses or self.scores):
            return self.chain.n_tokens - (self.chain.spans[self.depth - 1][1] if self.depth else 0)
        return 0

    @property
    def chunks_to_compute(self) -> int:
        return len(self.chain.keys) - self.depth if self.action == "compute" else 0


@dataclass(frozen=True)
class BuildPlan:
    """What a build will do, made before any work (see the module docstring): per given context
    its chain (None: refused, its message in ``errors``), the ``steps`` of the distinct contexts of
    this shard, the contexts left to other shards, and the options it was made for. The counts
    below are what ``--dry-run`` prints."""

    chains: tuple[Chain | None, ...]
    steps: tuple[ContextStep, ...]
    errors: tuple[str, ...]
    other_shards: int
    options: BuildOptions

    def count(self, action: str) -> int:
        return sum(1 for s in self.steps if s.action == action)

    @property
    def tokens_to_compute(self) -> int:
        return sum(s.tokens_to_compute for s in self.steps)

    @property
    def chunks_to_compute(self) -> int:
        return sum(s.chunks_to_compute for s in self.steps)

    @property
    def pressed_to_make(self) -> int:
        return sum(len(s.presses) for s in self.steps)

    @property
    def scores_to_make(self) -> int:
        return sum(len(s.scores) for s in self.steps)

    def summary(self, kv_bytes_per_token: int) -> dict:
        """The plan's counts; ``dense_bytes_to_write``: raw (uncompressed) bytes of the chunks to
        compute, ``kv_bytes_per_token`` each."""
        return {
            "contexts": len(self.chains),
            "distinct": len(self.steps),
            "other_shards": self.other_shards,
            "refused": len(self.errors),
            **{f"to_{a}": self.count(a) for a in ("skip", "record", "migrate", "compute")},
            "tokens_to_compute": self.tokens_to_compute,
            "chunks_to_compute": self.chunks_to_compute,
            "dense_bytes_to_write": self.chunks_to_compute
            and sum(s.tokens_to_compute for s in self.steps if s.action == "compute") * kv_bytes_per_token,
            "pressed_to_make": self.pressed_to_make,
            "scores_to_make": self.scores_to_make,
        }


def plan_build(
    handle: ModelHandle, contexts: Sequence[TextOrIds], store: KVStore, options: BuildOptions, keying: Keying,
    labels: Sequence[str] | None,
) -> BuildPlan:  # fmt: skip
    """The :class:`BuildPlan` of building ``contexts`` into ``store`` (nothing is written). Raises
    ContextTooLongError for a context too long unless ``options.truncate`` or ``options.skip_errors``."""
    found: list[Chain | None] = []
    errors: list[str] = []
    for i, c in enumerate(contexts):
        try:
            ids = handle.context_ids(
                c, special_tokens=keying.special_tokens, truncate=options.truncate,
                max_context_tokens=options.max_context_tokens, label=row_label(labels, i),
            )  # fmt: skip
            found.append(
                chains.chain_of(handle, ids, store, prefix=keying.prefix, special_tokens=keying.special_tokens)
            )
        except ContextTooLongError as exc:
            if not options.skip_errors:
                raise
            errors.append(str(exc))
            found.append(None)
    distinct = list({p.key: p for p in found if p is not None}.values())
    other = 0
    if options.shard is not None:
        mine = [p for p in distinct if in_shard(p.key, *options.shard)]
        other, distinct = len(distinct) - len(mine), mine
    steps = [_step(handle, store, chain, options) for chain in distinct]
    return BuildPlan(tuple(found), tuple(steps), tuple(errors), other, options)


def _step(handle: ModelHandle, store: KVStore, chain: Chain, options: BuildOptions) -> ContextStep:
    depth = verified_depth(handle, store, chain)  # verified: corrupt chunks are rebuilt
    if depth == len(chain.keys):
        action = "skip" if store.context(chain.key) is not None else "record"  # read-only: a dry run's store
    elif depth == 0 and has_v1(handle, store, chain):
        action = "migrate"
    else:
        action = "compute" if options.dense else "none"

    # verified as the chunks are: a corrupt or foreign pressed cache or scores entry is made again
    def lacks(key: str, kind: str) -> bool:
        return not stored_intact(store, handle, chain, key, kind)

    presses = tuple(p for p in options.presses if lacks(pressed_key(chain, p, store.codec), PRESSED))
    # a press that runs a scoring forward stores its scores too (on first use): the build makes
    # those it lacks, whether asked for (--score) or not, so that --dry-run counts what it writes
    # and a corrupt one stored beside an earlier build's pressed cache is made again
    wanted = {scores_key(chain, s): s for s in options.scores}
    for p in options.presses:
        if storable(p) and p.record.reads in FORWARD_READS:
            wanted.setdefault(scores_key(chain, p), p)
    scores = tuple(s for key, s in wanted.items() if lacks(key, SCORES))
    return ContextStep(chain, depth, action, presses, scores)


__all__ = ["BuildPlan", "ContextStep", "in_shard", "plan_build"]
