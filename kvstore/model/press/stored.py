"""Presses and the store: scores computed once and stored, pressed caches stored at their size.

A query-agnostic press's scores (every press whose record is ``ratio_free``, without ``:q``) depend
on the context alone, so they are stored once per context as a derived entry
(:mod:`kvstore.store.derived`, kind ``scores``, keyed by the context's key and the scorer with its
parameters, :attr:`kvstore.model.press.spec.Press.scorer_spec`, and for a press registered with
:func:`~kvstore.model.press.registry.register_press` its identity:
:func:`scores_spec`, :func:`pressed_spec`): afterwards
every ratio and budget of that press reads them and runs no scoring forward. :class:`StoredScores` is what a batch's
:class:`~kvstore.model.press.select.PressMemo` asks first; a writable store gets the scores of a
press that runs a scoring forward (a window, a re-run of the context, a replay) on their first use,
and ``kvstore build --score`` stores any storable scorer's.

A **pressed cache** is one more derived entry of its context (kind ``pressed``), keyed by the
context, the press's canonical spec and the codec's lossy identity: per layer and KV head the kept
tokens' keys and values (stored with the codec: int8, 4-bit...) and their positions. With a lossy
codec ``C`` a press reads the dense cache as ``C`` stores it and its kept tokens are stored with
``C`` again; an answer pressed from the dense cache goes through the same encoding, so it is the
answer a stored pressed entry gives (:func:`round_trip`). Derived entries are filed under the
chain's :attr:`~kvstore.model.io.chains.Chain.context_key`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import CorruptEntryWarning
from kvstore.model.io.chains import Chain
from kvstore.model.press.spec import Press
from kvstore.store.codecs import Codec
from kvstore.store.kind_pressed import encode_pressed
from kvstore.store.kind_scores import encode_scores
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import ANY_OWNED, PRESSED, SCORES, DerivedFacts, DerivedView, decode_derived, derived_key_of

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer

# per layer, per KV head: (keys [n, d], values [n, d], positions [n] int64) of the kept tokens
KeptLayers = Sequence[Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
FORWARD_READS = ("window", "context", "replay")  # presses whose scores cost a forward: stored on first use


def storable(press: Press) -> bool:
    """Whether ``press``'s scores depend on the context alone (no ratio, no question)."""
    return press.record.ratio_free and not press.question


def owned_facts_of(handle: ModelHandle, chain: Chain) -> DerivedFacts:
    """What ties a derived entry of ``chain``'s context to this model."""
    return DerivedFacts(chain.context_key, handle.fingerprint, handle.name, handle.dtype_name, chain.n_tokens,
                        handle.numerics)  # fmt: skip


def press_record(press: Press) -> dict[str, Any]:
    """What made a pressed cache or scores, as the entry records it (``ls`` shows it)."""
    return {
        "method": press.method,
        "ratio": press.ratio,
        "budget": press.budget,
        "params": dict(press.params + press.budget_params),
        "scorer": press.scorer_spec,
    }


def _with_identity(press: Press, spec: str) -> str:
    """``spec`` with a registered press's
    :attr:`~kvstore.model.press.registry.PressMethod.identity` after an ``@`` (a built-in's spec
    alone: their keys never change), so that a redefined press misses its old entries."""
    identity = press.record.identity
    return f"{spec}@{identity}" if identity else spec


def scores_spec(press: Press) -> str:
    """The spec ``press``'s stored scores are keyed by (and their header names): its scorer's."""
    return _with_identity(press, press.scorer_spec)


def pressed_spec(press: Press) -> str:
    """The spec a pressed cache of ``press`` is keyed by (and its header names): the press's own."""
    return _with_identity(press, press.name)


def scores_key(chain: Chain, press: Press) -> str:
    return derived_key_of(chain.context_key, SCORES, scores_spec(press), "")


def pressed_key(chain: Chain, press: Press, codec: Codec) -> str:
    return derived_key_of(chain.context_key, PRESSED, pressed_spec(press), codec.identity)


def derived_fits(handle: ModelHandle, view: DerivedView, chain: Chain, kind: str) -> bool:
    """Whether a stored derived entry is this model's, for this context, of this kind and with this
    model's layer shapes (its key already says so; a misfiled entry must never answer)."""
    h = view.header
    shapes = handle.kv_shapes()
    return (
        h.kind == kind
        and h.context == chain.context_key
        and h.model == handle.fingerprint
        and h.dtype == handle.dtype_name
        and h.n_tokens == chain.n_tokens
        and len(h.layers) == len(shapes)
        and all(
            layer.kv_heads == heads and layer.head_dim in (0, dk)  # 0: a kind keeping no keys (scores)
            for layer, (heads, dk, _) in zip(h.layers, shapes)
        )
    )


def _warn_mismatch(chain: Chain, kind: str) -> None:
    warnings.warn(
        f"kvstore: the {kind} entry of context {chain.key[:16]} is another model's or context's; treating it as a miss",
        CorruptEntryWarning,
        stacklevel=3,
    )


class StoredScores:
    """A batch's stored scores (the :class:`~kvstore.model.press.select.ScoreSource` of its
    presses): looked up by the rows' context ids (``chains``: the chain of each distinct context),
    saved on first use when ``writable`` (the scores of presses that run a scoring forward: others
    cost no more than reading them back). ``saved``: derived keys this source wrote;
    ``saved_bytes``: their stored bytes."""

    def __init__(
        self, handle: ModelHandle, store: KVStore, chains: Sequence[Chain], writable: bool, writer: Writer | None = None
    ):
        self.handle = handle
        self.store = store
        self.writer = writer  # writes what is saved off the compute thread (a build's); None: written now
        self.chains = {c.ids: c for c in chains}
        self.writable = writable and not store.readonly
        self.saved: list[str] = []
        self.saved_bytes = 0

    def lookup(self, press: Press, ids: Sequence[int], shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor] | None:
        chain = self.chains.get(tuple(ids))
        if chain is None or not storable(press):
            return None
        key = scores_key(chain, press)
        with self.store.open(ANY_OWNED, key, chain.context_key) as view:
            if view is None:
                return None
            got = (
                [view.scores(i) for i in range(len(view.header.layers))]
                if derived_fits(self.handle, view, chain, SCORES)
                else []
            )
            if [tuple(map(int, s.shape)) for s in got] != list(shapes):
                _warn_mismatch(chain, SCORES)
                return None
            return [s.to(self.handle.device) for s in got]

    def save(self, press: Press, ids: Sequence[int], scores: Sequence[torch.Tensor], force: bool = False) -> None:
        """Store ``scores`` of the context ``ids`` under ``press`` (``force``: whatever the press
        reads, as ``build --score`` asks, whose plan found them missing or corrupt: a corrupt entry is
        replaced); nothing where they are stored already."""
        chain = self.chains.get(tuple(ids))
        if chain is None or not self.writable or not storable(press):
            return
        if not force and press.record.reads not in FORWARD_READS:
            return
        key = scores_key(chain, press)
        if key in self.saved or (not force and self.store.has(ANY_OWNED, key, chain.context_key)):
            return
        exact = [
            s if s.dtype in (torch.float32, torch.float64) else s.float() for s in scores
        ]  # 16-bit: widened, exact
        key, blob = encode_scores(owned_facts_of(self.handle, chain), scores_spec(press), press_record(press), exact,
                                  self.store.meta.codec)  # fmt: skip
        if self.writer is not None:
            self.writer.put_owned(blob)
            self.saved_bytes += len(blob)
        else:
            self.saved_bytes += self.store.put(blob)
        self.saved.append(key)


def encode_kept(handle: ModelHandle, chain: Chain, press: Press, kept: KeptLayers, codec: Codec) -> tuple[str, bytes]:
    """A row's kept tokens as a pressed derived entry: ``(derived key, bytes)``."""
    spec = pressed_spec(press)
    return encode_pressed(owned_facts_of(handle, chain), spec, press_record(press), kept, codec, rotary=handle.rotary)


def round_trip(handle: ModelHandle, chain: Chain, press: Press, kept: KeptLayers, codec: Codec) -> DerivedView:
    """The kept tokens as a stored pressed entry would give them back under ``codec`` (encoded and
    decoded: what a lossy codec's later load reads)."""
    _, blob = encode_kept(handle, chain, press, kept, codec)
    return decode_derived(blob)


def open_fitting(
    store: KVStore, handle: ModelHandle, chain: Chain, key: str, kind: str, stack: Any
) -> DerivedView | None:
    """The stored derived entry ``key`` (of ``kind``) of ``chain``'s context, verified and kept
    open on ``stack`` (an ``ExitStack``), or None when it is missing, corrupt or not this model's
    and context's (a warning)."""
    view = stack.enter_context(store.open(ANY_OWNED, key, chain.context_key))
    if view is not None and not derived_fits(handle, view, chain, kind):
        _warn_mismatch(chain, kind)
        return None
    return view


def open_pressed(store: KVStore, handle: ModelHandle, chain: Chain, key: str, stack: Any) -> DerivedView | None:
    """The stored pressed entry ``key`` of ``chain``'s context (:func:`open_fitting`)."""
    return open_fitting(store, handle, chain, key, PRESSED, stack)


def stored_intact(store: KVStore, handle: ModelHandle, chain: Chain, key: str, kind: str) -> bool:
    """Whether the derived entry ``key`` of ``chain``'s context is stored, intact and this model's
    (:func:`open_fitting`: verified as a load verifies it), as the build plan asks of each entry it
    would keep: a corrupt or foreign one is made again, as corrupt chunks are."""
    with contextlib.ExitStack() as stack:
        return open_fitting(store, handle, chain, key, kind, stack) is not None


def has_pressed(store: KVStore, filed: Sequence[Chain], press: Press, chains: Sequence[Chain]) -> Mapping[str, str]:
    """``{chains[i].key: derived key}`` of the pressed entries ``store`` holds under ``filed[i]``
    (the chain each context's derived entries are filed under)."""
    out = {}
    for f, c in zip(filed, chains):
        key = pressed_key(f, press, store.codec)
        if store.has(ANY_OWNED, key, f.context_key):
            out[c.key] = key
    return out


facts = owned_facts_of  # deprecated: the old name, for one release

__all__ = [
    "FORWARD_READS",
    "KeptLayers",
    "StoredScores",
    "encode_kept",
    "pressed_spec",
    "scores_spec",
    "facts",
    "owned_facts_of",
    "derived_fits",
    "has_pressed",
    "open_fitting",
    "open_pressed",
    "press_record",
    "pressed_key",
    "round_trip",
    "scores_key",
    "storable",
    "stored_intact",
]
