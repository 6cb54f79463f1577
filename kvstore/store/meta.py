"""A store's description (backend key ``meta``): format version, default codec, chunk size, when
it was created. Written once by whoever creates the store, read back by every later open."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from kvstore.errors import CodecError, FormatVersionError, KVStoreError
from kvstore.store.backends import Backend
from kvstore.store.codecs import DEFAULT_CODEC, LEGACY_CODEC, Codec, get_codec
from kvstore.store.codecs.choice import CodecChoice
from kvstore.store.header import STORE_FORMAT
from kvstore.store.keys import DEFAULT_CHUNK_TOKENS
from kvstore.store.keyspace import META

MAX_CHUNK_TOKENS = 1 << 20


@dataclass(frozen=True)
class StoreMeta:
    """``codec``: the store's default codec; ``codec_reason``: why it was chosen, when kvstore chose
    it by the device (``kvstore.store.codecs.choice``; empty otherwise, and then not recorded);
    ``new``: this open created the store (not recorded)."""

    format: int
    codec: str
    chunk_tokens: int
    created: float
    codec_reason: str = ""
    new: bool = field(default=False, compare=False)

    def record(self) -> bytes:
        d = {"format": self.format, "codec": self.codec, "chunk_tokens": self.chunk_tokens, "created": self.created}
        if self.codec_reason:  # an older kvstore ignores it
            d["codec_reason"] = self.codec_reason
        return json.dumps(d, sort_keys=True).encode()


def load_meta(
    backend: Backend, url: str, codec: Codec | None, chunk_tokens: int | None, *, readonly: bool,
    default: CodecChoice | None = None,
) -> StoreMeta:  # fmt: skip
    """The description of the store in ``backend``; a new store (none yet) gets one, with
    ``codec`` (if lossless; else ``default``, a choice made for the device, else the default
    codec) and ``chunk_tokens``, unless ``readonly``. A format-1 store opened for writing is
    upgraded in place. Raises KVStoreError for an unreadable description, FormatVersionError for a
    newer format."""
    raw = backend.get(META)
    if raw is None:
        # a new store records its (lossless) codec and chunk size, so a reopen uses them again
        if codec is not None and codec.lossless:
            spec, reason = codec.spec, ""
        else:
            spec, reason = (default.spec, default.reason) if default is not None else (DEFAULT_CODEC, "")
        meta = StoreMeta(STORE_FORMAT, spec, chunk_tokens or DEFAULT_CHUNK_TOKENS, time.time(), reason, new=True)
        if readonly or backend.put_if_absent(META, meta.record()):
            return meta
        raw = backend.get(META)  # another process created the store meanwhile: use its description
        if raw is None:
            raise KVStoreError(f"store {url} lost its description record while opening; open it again")
    try:
        d = json.loads(raw)
        fmt = int(d["format"])
        meta = StoreMeta(fmt, str(d.get("codec", LEGACY_CODEC)), int(d.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)),
                         float(d.get("created", 0.0)), str(d.get("codec_reason", "")))  # fmt: skip
        get_codec(meta.codec)
        if not 1 <= meta.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError, CodecError):
        raise KVStoreError(f"store {url} has an unreadable description record; is it a kvstore store?") from None
    if fmt > STORE_FORMAT:
        raise FormatVersionError(
            f"store {url} was written by format version {fmt}; this kvstore reads up to {STORE_FORMAT} - "
            "upgrade kvstore"
        )
    if fmt < STORE_FORMAT and not readonly:
        # a format-1 store: its entries stay as they are (and readable); new ones are chunks
        meta = StoreMeta(STORE_FORMAT, meta.codec, DEFAULT_CHUNK_TOKENS, meta.created, meta.codec_reason)
        backend.put(META, meta.record())
    return meta


__all__ = ["MAX_CHUNK_TOKENS", "StoreMeta", "load_meta"]
