"""Contexts as chains of chunks: their keys, and whether a stored chunk is the one planned.

A context's :class:`Chain` lists its chunks (spans of ``chunk_tokens`` tokens, restarting at
an explicit boundary such as the end of a prompt's fixed head) and their keys, seeded by the
model's identity and numerics and the store's lossy codec (``kvstore.store.keys``). Loading a
chain's stored prefix and computing the rest are stages (:mod:`kvstore.model.stages.load`,
:mod:`kvstore.model.stages.complete`); :func:`fits` is what a load checks every chunk against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import CorruptEntryError
from kvstore.facts import ATTN
from kvstore.model.compute.cache import LayerKV
from kvstore.store.codecs import get_codec, identity_of
from kvstore.store.entry import Entry, EntryView
from kvstore.store.keys import DEFAULT_CHUNK_TOKENS, cache_key, chain_keys, chunk_key, chunk_spans
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds

# Tokens at the end of a prompt head that may merge with the context's first word when tokenized together.
HEAD_MERGE_TOKENS = 2


@dataclass(frozen=True)
class Keying:
    """How contexts are tokenized and chunked, so that build, sample and score key them alike:
    with the model's special tokens or not, and their shared head (``prefix``: text or ids,
    stored once as its own chunk)."""

    special_tokens: bool = True
    prefix: TextOrIds | None = None


DEFAULT_KEYING = Keying()


@dataclass(frozen=True)
class Chain:
    """One tokenized context as a chain: ``spans[i]`` are chunk ``i``'s positions, ``keys[i]``
    its key. ``key`` (the last chunk's) names the context; ``v1_key`` is the format-1 key of the
    whole context, under which a phase-1 store may hold it. ``lossy``: the lossy codec the chain
    is stored with (its quantizer spec, part of the keys), ``""`` for lossless. ``whole``: the
    whole chain's key when this lists only its first chunks (:meth:`upto`), else ``""``."""

    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]
    v1_key: str
    lossy: str = ""
    whole: str = ""

    @property
    def key(self) -> str:
        return self.keys[-1]

    @property
    def context_key(self) -> str:
        """The key a context's derived entries (stored scores, pressed caches) are filed under: its
        record's, so that they belong to the context the store lists and removing it removes them
        (a chain cut at a stored shorter context's end is filed under that chain's key, as the
        record is; a later walk of the same store cuts it the same way)."""
        return self.whole or self.keys[-1]

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def upto(self, depth: int) -> Chain:
        """This chain listing only its first ``depth`` chunks (what a load reads; the same context)."""
        if depth >= len(self.keys):
            return self
        return Chain(self.ids, self.spans[:depth], self.keys[:depth], self.v1_key, self.lossy, self.context_key)

    def depth_of(self, n_tokens: int) -> int:
        """How many whole chunks ``n_tokens`` leading tokens cover."""
        return sum(1 for _, end in self.spans if end <= n_tokens)


def chain_of(
    handle: ModelHandle, ids: Sequence[int], store: KVStore | None = None, *, prefix: TextOrIds | None = None,
    special_tokens: bool = True,
) -> Chain:  # fmt: skip
    """A tokenized context as a chain of chunks for ``store`` (its chunk size and lossy codec;
    without a store: 512-token chunks, lossless), for this model, dtype and numerics.

    ``prefix``: the contexts' shared head (text or ids, e.g. a chat template's system turn or a
    few-shot block); a chunk ends where the context's ids stop agreeing with the head's, so the
    head is stored once for every context (a head ending in a space or newline may merge with the
    context's first word into one token: the boundary then falls just before that token). With a
    ``store`` whose lookups are local (LMDB, memory), a stored shorter context that ends inside one
    of this chain's chunks adds a boundary there (:func:`stored_tails`), so its last, partial chunk
    is reused too."""
    cuts = []
    if prefix is not None:
        head = handle.prefix_ids(prefix, special_tokens)
        agree = 0
        for a, b in zip(head, ids):
            if a != b:
                break
            agree += 1
        if agree >= max(1, len(head) - HEAD_MERGE_TOKENS) and agree < len(ids):
            cuts.append(agree)
    chunk_tokens = store.chunk_tokens if store is not None else DEFAULT_CHUNK_TOKENS
    lossy = store.codec.identity if store is not None else ""
    seed = handle.chain_seed(lossy)
    if store is not None and store.backend.local:
        cuts = stored_tails(seed, ids, chunk_tokens, cuts, store)
    spans = chunk_spans(len(ids), chunk_tokens, cuts)
    keys = tuple(chain_keys(seed, ids, spans))
    return Chain(tuple(ids), tuple(spans), keys, cache_key(handle.fingerprint, handle.dtype, ids), lossy)


def stored_tails(seed: str, ids: Sequence[int], chunk_tokens: int, cuts: list[int], store: KVStore) -> list[int]:
    """``cuts`` plus the ends of stored partial chunks this chain can continue: walk the chain
    while its chunks are stored; at the first one that is not, look for a stored chunk with the
    same parent holding a strict prefix of its tokens (the last chunk of a shorter context, e.g.
    the first half of this document), the longest first; if there is one, cut there and walk on.

    The canonical chain (no such cuts) is kept wherever it is stored, so a context stored before
    a shorter one still hits whole; each probe is up to ``chunk_tokens - 1`` local lookups."""
    cuts = list(cuts)
    while True:
        spans = chunk_spans(len(ids), chunk_tokens, cuts)
        keys = chain_keys(seed, ids, spans)
        j = next((j for j, k in enumerate(keys) if not store.contains(k)), None)
        if j is None:
            return cuts
        s, e = spans[j]
        parent = keys[j - 1] if j else seed
        m = next((m for m in range(e - s - 1, 0, -1) if store.contains(chunk_key(parent, ids[s : s + m]))), 0)
        if not m:
            return cuts
        cuts.append(s + m)


# The built-in lossy codecs at their default parameters: the codecs a plain (lossless) sample looks
# for a missed context under, to say that ``--codec`` would read it (:func:`lossy_copies`).
LOSSY_PROBES = ("int8", "int4", "fp8", "int8r", "int4r", "ecq", "int4h", "kvh")
PROBED_CONTEXTS = 16


def lossy_copies(handle: ModelHandle, chain_list: Sequence[Chain], store: KVStore) -> dict[str, int]:
    """For a lossless run over ``chain_list``: per lossy codec identity of :data:`LOSSY_PROBES` (e.g.
    ``int8:128/64``), how many of the distinct contexts ``store`` does not hold whole losslessly it
    holds more leading chunks of under that codec (the same spans, keyed for it), the first
    :data:`PROBED_CONTEXTS` such contexts looked at. Lookups only (nothing read, nothing verified);
    other parameters of a codec (``int8:64``) are not looked for."""
    identities = [get_codec(spec).identity for spec in LOSSY_PROBES]
    seeds = {lossy: handle.chain_seed(lossy) for lossy in identities}
    out: dict[str, int] = {}
    seen: set[str] = set()
    probed = 0
    for chain in chain_list:
        if chain.lossy or chain.key in seen or probed >= PROBED_CONTEXTS:
            continue
        seen.add(chain.key)
        depth = store.stored_prefix(chain.keys)
        if depth == len(chain.keys):
            continue
        probed += 1
        for lossy, seed in seeds.items():
            if store.stored_prefix(chain_keys(seed, chain.ids, chain.spans)) > depth:
                out[lossy] = out.get(lossy, 0) + 1
    return out


def chunk_entries(handle: ModelHandle, chain: Chain, layers: LayerKV, first: int = 0, offset: int = 0) -> list[Entry]:
    """Entries for chunks ``first..`` of ``chain`` cut from ``layers`` (per layer ``(keys, values)``
    ``[kv_heads, n, head_dim]`` holding positions ``offset..offset+n-1``)."""
    out = []
    for j in range(first, len(chain.spans)):
        s, e = chain.spans[j]
        kv = tuple((k[:, s - offset : e - offset], v[:, s - offset : e - offset]) for k, v in layers)
        out.append(handle.entry(chain.keys[j], chain.ids[s:e], kv, parent=chain.keys[j - 1] if j else "", start=s))
    return out


def fits(handle: ModelHandle, view: EntryView, chain: Chain, j: int) -> bool:
    """Whether a stored chunk is chunk ``j`` of ``chain`` for this model: its model, dtype, span,
    tokens and layer shapes. Its key already says all that; the entry must agree too, so that a
    misfiled or forged entry never feeds another model's tensors to this one, and a lossy entry
    never answers a lossless request (or one for another lossy codec)."""
    h = view.header
    start, end = chain.spans[j]
    try:
        if identity_of(h.codec) != chain.lossy:
            return False
    except CorruptEntryError:
        return False
    if not handle.layout.dense:  # every layer's record: kind, kept length, window, state shapes and dtypes
        return (
            h.model == handle.fingerprint
            and h.dtype == handle.dtype_name
            and (h.start, h.end) == (start, end)
            and h.layers == handle.layout.specs(start, end)
            and view.token_ids() == list(chain.ids[start:end])
        )
    shapes = handle.kv_shapes()
    return (
        h.model == handle.fingerprint
        and h.dtype == handle.dtype_name
        and (h.start, h.end) == (start, end)
        and h.n_layers == len(shapes)
        and all(s.kind == ATTN and (s.kv_heads, s.head_dim, s.head_dim) == shape for s, shape in zip(h.layers, shapes))
        and view.token_ids() == list(chain.ids[start:end])
    )


__all__ = [
    "DEFAULT_KEYING",
    "HEAD_MERGE_TOKENS",
    "LOSSY_PROBES",
    "PROBED_CONTEXTS",
    "Chain",
    "Keying",
    "chunk_entries",
    "fits",
    "chain_of",
    "lossy_copies",
    "stored_tails",
]
