"""Copies that verify: a chunk's records copied or decoded into place while its frame's checksum is
computed over the stored bytes they read, so that each block is hashed right after its copy, still
in the CPU's cache (one pass over memory instead of two).

A chunk's work is a list of :class:`Unit`: a callable that reads some stored bytes of the frame
(a block of a run of raw bytes, or one record decoded from its planes and zstd frames) and the
spans of the frame it reads. :func:`plan` checks that the units' spans are disjoint and inside the
frame and hands back a :class:`FrameDigest` and the units in the order their bytes lie in the
frame; each unit, once it ran, feeds its spans to the digest (:meth:`FrameDigest.feed`), which
hashes, in the frame's order, every span whose turn has come (and the bytes between spans: the
frame's header, the payload's own header, padding). xxh3-64 is a streaming hash, so a chunk's
spans are hashed in order: a unit run ahead of its turn on another thread is hashed when the turn
comes (later, maybe no longer in cache). One chunk per thread keeps every hash in cache.

The checksum on disk is the one every store has (xxh3-64 of the frame, :mod:`kvstore.store.frame`):
nothing changes in the format, and old stores verify as before. :meth:`FrameDigest.check` raises
:class:`CorruptEntryError` unless every span was fed and the digest matched: only then may the
copied bytes be used (sent to a device, or counted as loaded).
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvstore.errors import CorruptEntryError
from kvstore.store.codecs.records import buffer_view
from kvstore.store.frame import TRAILER_BYTES

BLOCK = 256 << 10  # bytes of a run of raw bytes copied, then hashed, in one go (in L2 once copied)


@dataclass(frozen=True)
class Unit:
    """``work`` (reads ``spans``, ``(start, end)`` byte offsets in the frame) of one chunk."""

    work: Callable[[], object]
    spans: tuple[tuple[int, int], ...]


def address(buf: Any) -> int:
    """The address of the first byte of ``buf`` (bytes, memoryview, a contiguous CPU tensor)."""
    if isinstance(buf, torch.Tensor):
        return buf.data_ptr()
    return buffer_view(memoryview(buf)).data_ptr() if len(buf) else 0


def _span(part: Any, base: int, end: int) -> tuple[int, int] | None:
    if isinstance(part, torch.Tensor):
        if part.device.type != "cpu" or not part.is_contiguous():
            return None
        nbytes = part.numel() * part.element_size()
    elif isinstance(part, memoryview):
        if not part.contiguous:
            return None
        nbytes = part.nbytes
    else:  # bytes decompressed already (not the frame's)
        return None
    if nbytes == 0:
        return (0, 0)
    start = address(part) - base
    return (start, start + nbytes) if 0 <= start and start + nbytes <= end else None


def record_spans(record: Any, base: int, end: int) -> tuple[tuple[int, int], ...] | None:
    """The spans of the frame (address ``base``, ``end`` bytes before its trailer) that decoding
    ``record`` reads: its bytes, its planes, its zstd frames. None when any of them lies outside
    the frame (decompressed already) or the record is of a kind not known here (a quantized
    reader): such a chunk is verified before it is decoded."""
    from kvstore.store.codecs.records import TensorRecord
    from kvstore.store.codecs.split import SplitRecord

    parts: list[Any]
    if isinstance(record, SplitRecord):
        parts = [data for _, data, _, _ in record.pieces]
    elif type(record) is TensorRecord:
        if record.frames is not None:
            parts = [frame for frame, _ in record.frames]
        elif record.planes is not None:
            parts = list(record.planes)
        else:
            parts = [record.source]
    else:
        return None
    spans = [_span(p, base, end) for p in parts]
    if any(s is None for s in spans):
        return None
    return tuple(s for s in spans if s is not None and s[1] > s[0])


class FrameDigest:
    """The xxh3-64 of a frame (``buf``), fed by the units of its chunk (``spans``: every span they
    read, sorted and disjoint) from any thread: see the module docstring."""

    def __init__(self, buf: Any, spans: Sequence[tuple[int, int]]):
        self.view = memoryview(buf).cast("B")
        self.end = len(self.view) - TRAILER_BYTES
        self.spans = list(spans)
        self.index = {s: i for i, s in enumerate(self.spans)}
        self.ready = [False] * len(self.spans)
        self.cursor = 0  # the next span to hash
        self.pos = 0  # bytes of the frame hashed so far
        self.busy = False  # a thread is hashing (only it touches ``state`` and ``pos``)
        self.state = xxhash.xxh3_64()
        self.lock = threading.Lock()

    def feed(self, spans: Sequence[tuple[int, int]]) -> None:
        """Mark ``spans`` read; hash, in order, every span whose turn has come (unless another
        thread is hashing: it takes these too)."""
        with self.lock:
            for s in spans:
                self.ready[self.index[s]] = True
            if self.busy:
                return
            self.busy = True
        while True:
            with self.lock:
                todo = []
                while self.cursor < len(self.spans) and self.ready[self.cursor]:
                    todo.append(self.spans[self.cursor])
                    self.cursor += 1
                if not todo:
                    self.busy = False
                    return
            for start, stop in todo:
                if start > self.pos:  # the bytes no unit reads: headers, padding
                    self.state.update(self.view[self.pos : start])
                self.state.update(self.view[start:stop])
                self.pos = stop

    def check(self) -> None:
        """Raise CorruptEntryError unless every span was fed and the frame's digest matches its
        trailer (call once every unit ran)."""
        if self.cursor != len(self.spans) or self.busy:
            raise CorruptEntryError("entry was not read whole")
        if self.end < 0:
            raise CorruptEntryError("entry is truncated")
        if self.end > self.pos:
            self.state.update(self.view[self.pos : self.end])
            self.pos = self.end
        (want,) = struct.unpack_from("<Q", self.view, self.end)
        if self.state.intdigest() != want:
            raise CorruptEntryError("entry checksum mismatch (flipped or truncated bytes)")


def plan(buf: Any, units: Sequence[Unit]) -> tuple[FrameDigest, list[Callable[[], None]]] | None:
    """The digest of the frame ``buf`` and ``units`` as callables that feed it, in the order their
    bytes lie in the frame; None when their spans overlap or leave the frame (verify first)."""
    end = len(buf) - TRAILER_BYTES
    spans = sorted(s for u in units for s in u.spans)
    if any(a < 0 or b > end or a >= b for a, b in spans) or any(b > c for (_, b), (c, _) in zip(spans, spans[1:])):
        return None
    digest = FrameDigest(buf, spans)
    ordered = sorted(units, key=lambda u: min(u.spans, default=(end, end)))
    return digest, [_fed(u, digest) for u in ordered]


def _fed(unit: Unit, digest: FrameDigest) -> Callable[[], None]:
    def run() -> None:
        unit.work()
        digest.feed(unit.spans)

    return run


def copy_units(buf: Any, dest: torch.Tensor, start: int, nbytes: int, at: int) -> list[Unit]:
    """Units copying the frame's bytes ``[start, start + nbytes)`` (``buf``) into the contiguous
    CPU bytes of ``dest`` from byte ``at`` on, one :data:`BLOCK` each (``ctypes.memmove``: no
    per-call overhead of a tensor copy, and it releases the GIL)."""
    import ctypes

    src, dst = address(buf) + start, dest.data_ptr() + at
    return [
        Unit(
            functools.partial(ctypes.memmove, dst + a, src + a, min(BLOCK, nbytes - a)),
            ((start + a, start + min(a + BLOCK, nbytes)),),
        )  # fmt: skip
        for a in range(0, nbytes, BLOCK)
    ]


def tasks(chunks: Sequence[list[Callable[[], None]]], threads: int) -> list[tuple[int, Callable[[], None]]]:
    """``(chunk index, task)`` pairs running every chunk's callables in order: one task per chunk
    where there are at least as many chunks as ``threads`` (every hash in cache), else each chunk
    cut into consecutive pieces, enough to keep every thread busy."""
    pieces = 1 if len(chunks) >= threads else -(-threads // max(len(chunks), 1))
    out: list[tuple[int, Callable[[], None]]] = []
    for j, fns in enumerate(chunks):
        size = max(1, -(-len(fns) // pieces))
        out += [(j, _in_turn(fns[i : i + size])) for i in range(0, len(fns), size)]
    return out


def _in_turn(fns: Sequence[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()

    return run


def prepare(
    buf: Any, pairs: Sequence[tuple[Any, Any]], fns: Sequence[Callable[[], object]]
) -> tuple[FrameDigest | None, list[Callable[[], None]]]:
    """The digest of the frame ``buf`` (None: verified already) and ``fns`` (``fns[i]`` decodes the
    record of ``pairs[i]``, a ``(record, dest)`` pair) made to feed it, in the frame's order; or
    ``(None, fns)`` when ``buf`` is None, or a record's bytes are not all the frame's: then verify
    the frame before any of ``fns`` runs."""
    units = None if buf is None else record_units(buf, [(rec, fn) for (rec, _), fn in zip(pairs, fns)])
    planned = None if units is None else plan(buf, units)
    if planned is not None:
        return planned
    return None, [functools.partial(_call, fn) for fn in fns]


def _call(fn: Callable[[], object]) -> None:
    fn()


def record_units(buf: Any, work: Sequence[tuple[Any, Callable[[], object]]]) -> list[Unit] | None:
    """``work``, ``(record, what decodes it)`` pairs of the frame ``buf``, as units; None when a
    record's bytes are not all the frame's (:func:`record_spans`)."""
    base, end = address(buf), len(buf) - TRAILER_BYTES
    units = []
    for record, fn in work:
        spans = record_spans(record, base, end)
        if spans is None:
            return None
        units.append(Unit(fn, spans))
    return units


__all__ = [
    "BLOCK",
    "FrameDigest",
    "Unit",
    "address",
    "copy_units",
    "plan",
    "prepare",
    "record_spans",
    "record_units",
    "tasks",
]
