"""Entries made by hand: valid ones with chosen contents, and damaged or hostile ones with valid
checksums (what an attacker, or a bug that checksums after the damage, would produce)."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from kvstore.store.entry import Entry, EntryView, decode_entry, encode_entry
from kvstore.store.header import MAGIC, read_frame
from kvstore.store.keys import chain_keys, chain_seed
from kvstore.store.kvstore import KVStore

FP_TINY = "1" * 64

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(_BITS[t.element_size()])


def kv_layers(n_layers=3, kv_heads=2, n_tokens=7, head_dim=8, dtype=torch.float32, seed=0, extremes=True):
    """Random per-layer ``(keys, values)`` ``[kv_heads, n_tokens, head_dim]``; with ``extremes``,
    layer 0's keys start with inf, -inf, NaN, -0.0 and the dtype's tiny and max values (what a
    lossy or sloppy path would change)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        k = torch.randn(kv_heads, n_tokens, head_dim, generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn(kv_heads, n_tokens, head_dim, generator=g, dtype=torch.float64).to(dtype)
        layers.append((k, v))
    if extremes:
        fi = torch.finfo(dtype)
        layers[0][0].view(-1)[:6] = torch.tensor(
            [float("inf"), float("-inf"), float("nan"), -0.0, fi.tiny, fi.max], dtype=dtype
        )
    return layers


def encode(
    layers, codec="zstd-shuffle:1", ids=None, key="k" * 64, created=1700000000.0, model="f" * 64, model_name="tiny"
) -> bytes:
    """The stored bytes of an entry holding ``layers`` (token ids ``0..n-1`` unless given)."""
    n = layers[0][0].shape[-2]
    ids = torch.arange(n) if ids is None else torch.as_tensor(ids, dtype=torch.int64)
    return encode_entry(Entry(key, model, model_name, ids, tuple(map(tuple, layers)), created), codec)


def small_entry(codec: str, n_layers: int = 1, n_tokens: int = 6, head_dim: int = 8) -> bytes:
    """A small float32 entry (2 KV heads) under key ``k...k``."""
    return encode(kv_layers(n_layers, 2, n_tokens, head_dim, extremes=False), codec, created=1.7e9)


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header JSON, payload) of an entry (a chunk or a derived entry)."""
    _, _, offset = read_frame(blob)
    return json.loads(blob[12:offset]), blob[offset:-8]


def golden_facts(blob: bytes) -> dict:
    """What a golden file pins about an entry: its sha256 and size, its header (for zstd, only the
    frames' decompressed sizes: compressed ones follow libzstd) and the sha256 of its payload
    decompressed."""
    import hashlib

    import zstandard

    header, payload = split(blob)
    if header["codec"]["name"] == "zstd":
        decompressed = zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=True).read()
        header = dict(header, codec=dict(header["codec"], frames=[d for _, d in header["codec"]["frames"]]))
    else:
        decompressed = payload
    return {
        "sha256": hashlib.sha256(blob).hexdigest(),
        "size": len(blob),
        "header": header,
        "decompressed_sha256": hashlib.sha256(decompressed).hexdigest(),
    }


def lossy_facts(blob: bytes) -> dict:
    """What a lossy golden file pins of an entry with one layer: its sha256, its header, and the
    bit patterns of the layer's decoded keys and values."""
    header, _ = split(blob)
    decoded = torch.cat([t.materialize().reshape(-1) for t in decode_entry(blob).layers[0]])
    return {
        "sha256": hashlib.sha256(blob).hexdigest(),
        "header": header,
        "decoded_sha256": hashlib.sha256(bits(decoded).numpy().tobytes()).hexdigest(),
    }


def golden_quant_entry(spec: str) -> bytes:
    """The lossy golden entry of formats 2 (``int8``, ``int4``, ``fp8``): one layer, 2 KV heads, 70
    tokens, head_dim 8, from position 0 (test_quant.py's golden tests, test_portable_decodes.py)."""
    g = torch.arange(2 * 70 * 8, dtype=torch.float32).reshape(2, 70, 8)
    layers = ((torch.sin(g / 7) * 3, torch.cos(g / 5) - 1),)
    return encode_entry(Entry("9" * 64, "f" * 64, "golden", torch.arange(70), layers, 1700000000.75), spec)


def golden_rotary_entry(spec: str) -> bytes:
    """The golden entry of the codecs that may need rotary parameters (``int4r``, ``ecq``, ``int4h``):
    the tensors of :func:`golden_quant_entry` as a chunk at position 600 of a model rotating 6 of 8
    channels (test_prerope.py, test_ecq.py, test_int4h.py, test_portable_decodes.py)."""
    from kvstore.store.codecs.prerope import Rotary

    g = torch.arange(2 * 70 * 8, dtype=torch.float32).reshape(2, 70, 8)
    layers = ((torch.sin(g / 7) * 3, torch.cos(g / 5) - 1),)
    rotary = Rotary((1.0, 0.1, 0.01))  # 6 of 8 channels rotated
    return encode_entry(
        Entry("9" * 64, "f" * 64, "golden", torch.arange(70), layers, 1700000000.75, parent="8" * 64, start=600,
              rotary=rotary), spec,
    )  # fmt: skip


def check_lossy_golden(facts_file: Path, kvs_file: Path, spec: str, make: Callable[[str], bytes], regen: bool,
                       what: str) -> EntryView:  # fmt: skip
    """Compare ``make(spec)`` with the facts pinned under ``spec`` in ``facts_file`` (rewriting
    them and ``kvs_file`` first when ``regen``), and check that the stored ``kvs_file`` decodes to
    the same keys as a fresh encoding; returns the stored entry's view."""
    if regen:
        facts = json.loads(facts_file.read_text()) if facts_file.exists() else {}
        facts[spec] = lossy_facts(make(spec))
        facts_file.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        kvs_file.write_bytes(make(spec))
    want = json.loads(facts_file.read_text())[spec]
    assert lossy_facts(make(spec)) == want, f"{what} changed: bump FORMAT_VERSION"
    view = decode_entry(kvs_file.read_bytes())
    assert torch.equal(view.layers[0][0].materialize(), decode_entry(make(spec)).layers[0][0].materialize())
    return view


def seal(body: bytes) -> bytes:
    """``body`` followed by its valid checksum."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def assemble(header: dict | bytes, payload: bytes) -> bytes:
    """An entry with a valid checksum around any header (a dict, or raw bytes) and payload."""
    h = header if isinstance(header, bytes) else json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return seal(MAGIC + struct.pack("<I", len(h)) + h + payload)


def rle_frame(content_size: int, byte: int = 0, declared: int | None | bool = True) -> bytes:
    """A hand-made zstd frame of ``content_size`` copies of ``byte`` in RLE blocks of 128 KiB
    (4 bytes each: a few KB expand to gigabytes, a decompression bomb). Its header declares
    ``content_size`` (``declared=True``), another size (an int), or none (``None``/``False``)."""
    if declared is True:
        declared = content_size
    head = struct.pack("<I", 0xFD2FB528)
    head += bytes([0x00, 0x38]) if declared in (None, False) else bytes([0xC0, 0x38]) + struct.pack("<Q", declared)
    out, left = bytearray(head), content_size
    while left:
        n = min(left, 1 << 17)
        left -= n
        out += ((n << 3) | (1 << 1) | (left == 0)).to_bytes(3, "little") + bytes([byte])
    return bytes(out)


def with_frame(header: dict, payload: bytes, index: int, frame: bytes, declared: int | None = None) -> bytes:
    """A zstd entry with frame ``index`` replaced by ``frame`` (the frame table follows; with
    ``declared`` the table and raw size claim that many bytes for it)."""
    frames = header["codec"]["frames"]
    parts, pos = [], 0
    for c, _ in frames:
        parts.append(payload[pos : pos + c])
        pos += c
    parts[index] = frame
    header = json.loads(json.dumps(header))
    header["codec"]["frames"][index][0] = len(frame)
    if declared is not None:
        grow = declared - header["codec"]["frames"][index][1]
        header["codec"]["frames"][index][1] = declared
        header["raw_bytes"] += grow
    return assemble(header, b"".join(parts))


def hostile_entries() -> dict[str, bytes]:
    """Entries with valid checksums built to make a decoder allocate gigabytes or crash."""
    z_header, z_payload = split(small_entry("zstd:1"))
    r_header, r_payload = split(small_entry("raw"))
    (n,) = struct.unpack_from("<Q", r_payload)
    st = json.loads(r_payload[8 : 8 + n])

    def st_edit(edit) -> bytes:
        s = json.loads(json.dumps(st))
        edit(s)
        text = json.dumps(s).encode()
        text += b" " * (-len(text) % 8)
        new = struct.pack("<Q", len(text)) + text + r_payload[8 + n :]
        return assemble(dict(r_header, raw_bytes=len(new)), new)

    gib = 1 << 30
    tensor0 = z_header["codec"]["frames"][1][1]  # bytes of layers.0.keys, as the frame table says
    big_tokens = dict(z_header, n_tokens=gib)
    big_tokens["raw_bytes"] = 2 * 2 * 8 * 4 * gib + 8 * gib
    return {
        "zstd frame declares 4 GiB": with_frame(z_header, z_payload, 1, rle_frame(4 * gib, declared=4 * gib)),
        "zstd frame and table declare 4 GiB": with_frame(
            z_header, z_payload, 1, rle_frame(4 * gib, declared=4 * gib), declared=4 * gib
        ),
        "zstd frame expands to 1 GiB, declares nothing": with_frame(
            z_header, z_payload, 1, rle_frame(gib, declared=None)
        ),
        "zstd frame declares its tensor's size, expands to 1 GiB": with_frame(
            z_header, z_payload, 1, rle_frame(gib, declared=tensor0)
        ),
        "header declares 2**30 tokens consistently": assemble(big_tokens, z_payload),
        "header declares 2**40 raw bytes": assemble(dict(z_header, raw_bytes=1 << 40), z_payload),
        "safetensors header length 2**63": assemble(r_header, struct.pack("<Q", 1 << 63) + r_payload[8:]),
        "safetensors huge shape": st_edit(lambda s: s["layers.0.keys"].update(shape=[gib, gib, gib])),
        "safetensors offsets beyond the data": st_edit(lambda s: s["layers.0.keys"].update(data_offsets=[0, 1 << 62])),
        "safetensors overlapping tensors": st_edit(
            lambda s: s["layers.0.values"].update(data_offsets=s["layers.0.keys"]["data_offsets"])
        ),
        "entry header nested 100k deep": assemble(b"[" * 100_000, r_payload),
        "entry header length 2**32-1": assemble(r_header, r_payload)[:8] + struct.pack("<I", 0xFFFFFFFF) + r_payload,
    }


def make_entry(seed: int, *, fp: str = FP_TINY, name="tiny", n_tokens=8, dtype=torch.float32, created=None) -> Entry:
    """A whole context of ``n_tokens`` tokens as a one-chunk chain of a made-up model."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (n_tokens,), generator=g)
    layers = tuple(
        (torch.randn(2, n_tokens, 4, generator=g).to(dtype), torch.randn(2, n_tokens, 4, generator=g).to(dtype))
        for _ in range(2)
    )
    [key] = chain_keys(chain_seed(fp, dtype, device="cpu", attn="sdpa"), ids.tolist(), [(0, n_tokens)])
    numerics = {"device": "cpu", "attn": "sdpa"}
    return Entry(key, fp, name, ids, layers, time.time() if created is None else created, numerics=numerics)


def put_contexts(path: str, entries: list[Entry]) -> None:
    """Store one-chunk contexts: each entry, then its context record."""
    with KVStore(path) as s:
        for e in entries:
            s.put(e)
            s.put_context(e.key, [e.key], e.n_tokens)


def encode_v1(layers, codec: str = "zstd-shuffle:1", ids=None, key: str = "k" * 64, created: float = 1.7e9,
              model: str = "f" * 64, model_name: str = "tiny") -> bytes:  # fmt: skip
    """An entry in format 1 (what phase 1 wrote: one whole context, every layer the same shape), to
    test that this kvstore still reads it. ``test_entry.py`` checks that it reproduces the golden
    format-1 files byte for byte."""
    from kvstore.store.codecs import get_codec

    k0 = layers[0][0]
    n_tokens = k0.shape[1]
    ids = torch.arange(n_tokens) if ids is None else torch.as_tensor(ids, dtype=torch.int64)
    facts = {
        "format": 1, "key": key, "model": model, "model_name": model_name,
        "dtype": str(k0.dtype).removeprefix("torch."), "n_tokens": n_tokens, "n_layers": len(layers),
        "kv_heads": k0.shape[0], "head_dim": k0.shape[2],
        "created": round(created, 6),
    }  # fmt: skip
    tensors = [
        (f"layers.{i}.{role}", t, role) for i, kv in enumerate(layers) for role, t in zip(("keys", "values"), kv)
    ]
    c = get_codec(codec)
    payload, params, raw_bytes = c.encode(
        [*tensors, ("token_ids", ids, None)], {k: str(v) for k, v in facts.items()} | {"codec": c.spec}
    )
    header = json.dumps(
        facts | {"codec": params, "raw_bytes": raw_bytes}, sort_keys=True, separators=(",", ":")
    ).encode()
    return seal(MAGIC + struct.pack("<I", len(header)) + header + payload)


def decode_host_and_staged(reader, dtype: torch.dtype):
    """Decode ``reader`` (a ``[3, 70, 16]`` tensor) into a strided slice of a NaN-filled batch
    buffer twice: on the host (``copy_into``) and through the staging bookkeeping on CPU (its
    device branch, a ``Staging(cpu, force=True)``). Returns ``(host, staged, staging,
    uploads)``, ``uploads`` the ``(shape, dtype)`` of every tensor the staging uploaded."""
    from kvstore.model.io import staging

    host = torch.full((2, 3, 90, 16), float("nan"), dtype=dtype)
    reader.copy_into(host[1, :, 7:77])  # a strided slice of a batch buffer, as loads use
    st = staging.Staging(torch.device("cpu"), force=True)
    uploads: list[tuple[tuple[int, ...], torch.dtype]] = []
    real_upload = st.upload

    def upload(source, device):
        uploads.append((tuple(source.shape), source.dtype))
        return real_upload(source, device)

    st.upload = upload  # type: ignore[method-assign]
    staged = torch.full_like(host, float("nan"))
    st.copy_into(reader, staged[1, :, 7:77])
    st.finish()
    return host, staged, st, uploads


def make_chain(token_ids: list[int], *, chunk: int = 4, fp: str = FP_TINY, name: str = "tiny",
               created: float | None = None) -> list[Entry]:  # fmt: skip
    """A context of a made-up float32 model as its chain of chunks (``chunk`` tokens each, the
    last one shorter): contexts with a common token prefix share their first chunks, as stored
    chains do. Returns the chunks in order; the context's key is the last one's."""
    spans = [(s, min(s + chunk, len(token_ids))) for s in range(0, len(token_ids), chunk)]
    keys = chain_keys(chain_seed(fp, torch.float32, device="cpu", attn="sdpa"), token_ids, spans)
    out, parent = [], ""
    for key, (start, end) in zip(keys, spans):
        g = torch.Generator().manual_seed(int(key[:8], 16))  # a chunk's values follow from its key
        layers = tuple((torch.randn(2, end - start, 4, generator=g), torch.randn(2, end - start, 4, generator=g))
                       for _ in range(2))  # fmt: skip
        ids = torch.tensor(token_ids[start:end], dtype=torch.int64)
        out.append(Entry(key, fp, name, ids, layers, time.time() if created is None else created, parent, start,
                         numerics={"device": "cpu", "attn": "sdpa"}))  # fmt: skip
        parent = key
    return out


def store_chain(store: KVStore, chunks: list[Entry], *, record: bool = True) -> None:
    """Put a chain's chunks, then (``record``) its context record."""
    for e in chunks:
        store.put(e)
    if record:
        store.put_context(chunks[-1].key, [e.key for e in chunks], sum(e.n_tokens for e in chunks))


def derived_blobs(context: str, n_tokens: int, *, fp: str = FP_TINY, name: str = "tiny", spec: str = "knorm",
                  ratio: float = 0.5, codec: str = "raw", kinds: tuple[str, ...] = ("scores", "pressed"),
                  seed: int = 0) -> dict[str, tuple[str, bytes]]:  # fmt: skip
    """A context's derived entries made by hand (2 layers of 2 KV heads, head_dim 4, float32):
    ``{"scores": (key, bytes), "pressed": (key, bytes)}`` (those of ``kinds``), the pressed cache
    keeping every other token (``ratio`` recorded in its press record only)."""
    from kvstore.store.kind_pressed import encode_pressed
    from kvstore.store.kind_scores import encode_scores
    from kvstore.store.owned import DerivedFacts

    g = torch.Generator().manual_seed(seed)
    facts = DerivedFacts(context, fp, name, "float32", n_tokens, {"device": "cpu", "attn": "sdpa"})
    out = {}
    if "scores" in kinds:
        scores = [torch.rand(2, n_tokens, generator=g) for _ in range(2)]
        out["scores"] = encode_scores(facts, spec, {"method": spec}, scores, codec)
    if "pressed" in kinds:
        kept = torch.arange(0, n_tokens, 2)
        layers = [[(torch.randn(len(kept), 4, generator=g), torch.randn(len(kept), 4, generator=g), kept)
                   for _ in range(2)] for _ in range(2)]  # fmt: skip
        out["pressed"] = encode_pressed(facts, f"{spec}:{ratio}", {"method": spec, "ratio": ratio}, layers, codec)
    return out


def put_derived(store: KVStore, context: str, n_tokens: int, **kw) -> dict[str, str]:
    """Store :func:`derived_blobs` of a context; returns ``{kind: derived key}``."""
    out = {}
    for kind, (key, blob) in derived_blobs(context, n_tokens, **kw).items():
        store.put_derived(blob)
        out[kind] = key
    return out
