"""Cache paths: the one interface through which a batch's contexts are computed, loaded and answered.

A model's cache is stored and reused one of two ways, chosen once from its layout
(:func:`kvstore.model.paths.choice.path_of`):

* :class:`kvstore.model.paths.dense.DensePath` - every layer full attention: a context's keys and
  values as a chain of chunks, loaded into left-padded batch buffers with a corrected mask and
  explicit positions, by the stages of :mod:`kvstore.model.stages` (load, complete, transform,
  answer). Everything kvstore offers runs on it.
* :class:`kvstore.model.paths.families.FamiliesPath` - sliding-window, chunked-attention,
  state-space and hybrid models: per-layer records (kept windows, recurrent states) and position
  masks over slots. Build and sample are exact here; the features measured only on dense caches
  are not offered.

:class:`CachePath` is what the pipelines (:mod:`kvstore.model.pipelines`) call, with a
:class:`~kvstore.model.plan.batch.BatchPlan`; they ask :meth:`CachePath.supports` for the optional
features instead of branching on the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from kvstore.model.compute.forward import Decoding
from kvstore.model.io.chains import Chain
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.press.spec import ScoringTokens
from kvstore.model.stages.answer import Answer
from kvstore.model.stages.load import Loaded
from kvstore.model.stages.score import RowScore
from kvstore.model.variants.variant import Variant
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer
    from kvstore.model.options import BuildOptions
    from kvstore.progress import Progress

PreparedT = TypeVar("PreparedT")  # what a path's prepare hands its answer and score

# What a path may offer beyond building and sampling exactly.
FEATURES = (
    "lossy",  # lossy codecs (measured on full-attention caches only)
    "compile",  # fixed-shape and compiled decode steps
    "variants",  # generation contexts, decode-time attention, presses and variant sweeps
    "scoring",  # log-likelihoods from stored contexts
    "load_ahead",  # loading the next batch on a worker while a batch decodes
    "chunked_prefill",  # prefilling a long context in pieces
    "prefill",  # Adapter.prefill: plain per-layer keys and values of a batch
)


@dataclass(frozen=True)
class BuildCounts:
    """What computing build jobs did: contexts built (whole or from a stored prefix), context
    tokens run through the model, and context tokens found stored (stored prefixes)."""

    built: int = 0
    tokens: int = 0
    tokens_reused: int = 0

    def __add__(self, other: BuildCounts) -> BuildCounts:
        return BuildCounts(
            self.built + other.built, self.tokens + other.tokens, self.tokens_reused + other.tokens_reused
        )


@dataclass(frozen=True)
class Scoring:
    """What a scoring batch scores besides its plan, per caller row: the continuation's ids
    (``targets``, the fed tokens predict them), whether to keep each token's log-probability, and
    whether to store the row's context and fed tokens as a chain afterwards (``keep``: a rolling
    window's first, from the keys and values the scoring forward computed)."""

    targets: tuple[tuple[int, ...], ...]
    token_logprobs: bool = False
    keep: tuple[bool, ...] = ()


@dataclass(frozen=True)
class BatchSetup:
    """What a batch runs with besides its plan: the store (None: the no-cache reference), the
    writer (None: nothing is stored), how it decodes, the variants it answers or scores under, and
    for a scoring batch what it scores."""

    store: KVStore | None
    writer: Writer | None
    decoding: Decoding
    variants: tuple[Variant, ...]
    scoring: Scoring | None = None


@dataclass(frozen=True)
class BatchAnswers:
    """A batch answered: one :class:`~kvstore.model.stages.answer.Answer` per variant; per row,
    the context tokens loaded from the store (a row read from stored pressed entries counts its
    whole context) and the codec spec(s) they came from; context tokens computed (prefill); and
    the tokens the presses' scoring forwards ran (not prefill)."""

    answers: tuple[Answer, ...]
    cached_tokens: tuple[int, ...]
    computed: int
    codecs: tuple[str | None, ...]
    scoring: ScoringTokens = ScoringTokens()


@dataclass(frozen=True)
class BatchScores:
    """A batch scored: per variant, each batch row's ``(sum of log-probs, greedy, per-token
    log-probs or None)``, the context tokens each row was scored over and their bytes; per row the
    context tokens loaded; context tokens computed; the presses' scoring tokens."""

    rows: tuple[tuple[RowScore, ...], ...]
    kept_tokens: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    computed: int
    scoring: ScoringTokens = ScoringTokens()


class CachePath(ABC, Generic[PreparedT]):
    """How one family of caches is computed, stored and answered from (see the module docstring),
    generic in what :meth:`prepare` returns for :meth:`answer` and :meth:`score`."""

    name: str = ""
    features: frozenset[str] = frozenset()

    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(f"unknown cache-path feature {feature!r}")
        return feature in self.features

    @abstractmethod
    def compute(
        self, handle: ModelHandle, store: KVStore, jobs: Sequence[tuple[Chain, int]], writer: Writer,
        options: BuildOptions, progress: Progress | None, count: bool,
    ) -> BuildCounts:  # fmt: skip
        """Compute and write ``(chain, stored depth)`` jobs: each chain's chunks from its depth on,
        then (with ``count``: contexts, not shared prefixes) its record."""

    @abstractmethod
    def prepare(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, loaded: Loaded | None) -> PreparedT:
        """A batch's contexts from the store, whole: its load (``loaded``, when it was loaded
        ahead) and what is missing computed and handed to the writer. What it returns is this
        path's own, for :meth:`answer` and :meth:`score`."""

    @abstractmethod
    def answer(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, prepared: PreparedT) -> BatchAnswers:
        """Answer a prepared batch under every variant of ``work``."""

    @abstractmethod
    def reference(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup) -> BatchAnswers:
        """Answer a batch without a store (the reference)."""

    def score(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, prepared: PreparedT) -> BatchScores:
        """Score a prepared batch's continuations (``work.scoring``) under every variant of
        ``work`` (paths that offer ``scoring``)."""
        raise NotImplementedError(f"the {self.name} cache path does not score from stored contexts")


Work = BatchSetup  # deprecated: the old name, for one release

__all__ = [
    "FEATURES",
    "BatchAnswers",
    "BatchScores",
    "BatchSetup",
    "BuildCounts",
    "CachePath",
    "PreparedT",
    "Scoring",
    "Work",
]
