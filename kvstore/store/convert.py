"""Converting stored contexts to a lossy codec without recomputing them.

A lossy codec is part of a chain's identity (:func:`kvstore.store.keys.chain_seed`), so a
converted context gets new chunk keys: the same spans and token ids, chained from the lossy seed of
the same model, dtype, device type and attention implementation (all recorded in every format-2
entry). Each chunk is decoded, quantized from its exact values, and written under its new key, then
the context's record; the lossless chain stays where it is (in the same store, or the source). A
passage (:mod:`kvstore.model.compose`) stays one: chained from the passage seed of the lossy seed, its
record flagged ``passage``, as a composed sample in that codec stores and looks it up.

Refused (counted, with the reason): contexts whose chain is incomplete or corrupt, format-1 entries
(no numerics to seed a chain from: ``kvstore build`` migrates them first), chains already lossy,
and models with windowed or recurrent layers (lossy codecs are for full-attention models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.facts import ATTN
from kvstore.progress import Progress
from kvstore.store.codecs import Codec, get_codec, identity_of
from kvstore.store.codecs.hadamard import layer_refusal
from kvstore.store.codecs.prerope import Rotary, needs_rotary
from kvstore.store.entry import Entry
from kvstore.store.keys import chain_keys, chain_seed, passage_seed
from kvstore.store.kvstore import KVStore


@dataclass
class ConvertReport:
    """What :func:`convert_contexts` did: contexts looked at, converted, already present in the
    codec, refused (``problems``: one line each), chunks written, and their raw and stored bytes."""

    contexts: int = 0
    converted: int = 0
    present: int = 0
    chunks_written: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # source context key -> converted context key

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0


def _chain(src: KVStore, dst: KVStore, key: str, codec: Codec, load: bool) -> tuple[list[str], list[Entry]] | str:
    """The converted keys of context ``key`` and (when ``load`` and ``dst`` lacks them) its
    materialized chunks, or why it cannot be converted. Raises CodecError when ``codec`` names layers
    the context's model lacks (``int4h:k8=L``): a wrong spec, not a context to skip."""
    record = src.context(key)
    if record is None:
        return "no context record"
    entries: list[Entry] = []
    with src.open_chain(record.chunks) as views:
        if len(views) != len(record.chunks):
            return "its chain is incomplete or corrupt (kvstore verify)"
        for view in views:
            h = view.header
            if h.format < 2 or "device" not in h.numerics or "attn" not in h.numerics:
                return "it is a format-1 entry (run kvstore build on its dataset first, which migrates it)"
            try:
                if identity_of(h.codec):
                    return f"it is stored with lossy codec {h.codec_spec} already"
            except CorruptEntryError:
                return "its entry names an unknown codec"
            if any(spec.kind != ATTN for spec in h.layers):
                return "its model has windowed or recurrent layers (lossy codecs are for full-attention models)"
            why = layer_refusal(codec, len(h.layers))
            if why is not None:
                raise CodecError(why)
        h0 = views[0].header
        seed = chain_seed(
            h0.model, h0.dtype, device=h0.numerics["device"], attn=h0.numerics["attn"], lossy=codec.identity
        )
        if record.passage:  # a passage keeps its own seed: composed samples in the codec look it up there
            seed = passage_seed(seed)
        ids = [t for view in views for t in view.token_ids()]
        keys = chain_keys(seed, ids, [(view.header.start, view.header.end) for view in views])
        if load and not (dst.context(keys[-1]) is not None and dst.stored_prefix(keys) == len(keys)):
            entries = [view.materialize() for view in views]
    return keys, entries


def convert_contexts(
    src: KVStore,
    dst: KVStore,
    codec: str | Codec,
    keys: Sequence[str] | None = None,
    *,
    progress: Progress | None = None,
    dry_run: bool = False,
    rotary: Rotary | None = None,
) -> ConvertReport:
    """Write ``src``'s contexts (``keys``, default all) into ``dst`` (which may be ``src``) as chains
    of ``codec``, a lossy codec (``dry_run``: count what would be converted, write nothing).
    Raises CodecError for a lossless one (copying is ``kvstore sync``'s job: lossless codecs are
    interchangeable). ``rotary``: the model's rotary embedding (``Adapter.rotary``), which a codec
    quantizing keys before it (``int4r``, ``int8r``) needs; such a codec without it raises CodecError.
    A codec naming a layer a context's model lacks (``int4h:k8=L``) raises CodecError at that context,
    before anything of it is written (contexts converted before it stay: they are valid)."""
    codec = get_codec(codec)
    if needs_rotary(codec) and rotary is None:
        raise CodecError(
            f"{codec.spec} quantizes keys before their rotary embedding: converting needs the model's rotary "
            "parameters (rotary=Adapter.rotary)"
        )
    if codec.lossless:
        raise CodecError(
            f"{codec.spec} is lossless: its entries are interchangeable with the source's, nothing to convert"
        )
    report = ConvertReport()
    for key in src.context_keys() if keys is None else keys:
        report.contexts += 1
        got = _chain(src, dst, key, codec, load=not dry_run)
        if isinstance(got, str):
            report.problems.append(f"context {key[:12]}: {got}")
        else:
            new_keys, entries = got
            report.keys[key] = new_keys[-1]
            if dry_run:
                present = dst.context(new_keys[-1]) is not None and dst.stored_prefix(new_keys) == len(new_keys)
                report.present += present
                report.converted += not present
            elif not entries:
                report.present += 1
            else:
                for j, (new, entry) in enumerate(zip(new_keys, entries)):
                    moved = dataclasses.replace(entry, key=new, parent=new_keys[j - 1] if j else "", rotary=rotary)
                    blob = dst.encode(moved, codec)
                    dst.put_bytes(new, blob)
                    report.chunks_written += 1
                    report.stored_bytes += len(blob)
                    report.raw_bytes += moved.kv_bytes + moved.state_bytes + 8 * moved.n_tokens
                passage = (record := src.context(key)) is not None and record.passage
                dst.put_context(new_keys[-1], new_keys, sum(e.n_tokens for e in entries), passage=passage)
                report.converted += 1
        if progress:
            progress(1, 0)
    return report


__all__ = ["ConvertReport", "convert_contexts"]
