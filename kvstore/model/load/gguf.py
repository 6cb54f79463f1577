"""GGUF files: their key/value metadata read directly, and a one-time conversion to safetensors.

**Metadata.** ``gguf.GGUFReader`` parses every tensor and tokenizer array and takes ~10 s on the
bundled 98 MB file; :func:`read_gguf_metadata` reads the header alone in milliseconds (no tensors,
no ``gguf`` package, no torch). Used for size estimates from a ``.gguf`` file.

**Conversion.** Loading a GGUF file through transformers de-quantizes every tensor (12-40 s for the
bundled file). The first time one is used, :func:`convert_gguf` converts it once into a plain
safetensors model directory under :func:`kvstore.paths.models_dir`, named ``<stem>-<hash of the
file's path, size and mtime>``; later loads read that directory. Conversion writes into a temporary
sibling directory and renames it into place, so concurrent processes never see a half-written
model, and it checks that the converted model gives bit-identical logits before publishing it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstore.errors import ModelError, ModelNotFoundError
from kvstore.model.load.console import NoBar, one_line, quiet_progress, stderr_line
from kvstore.paths import models_dir

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_ARRAY = 1 << 16  # read per-layer arrays; skip vocabularies and merges without decoding them


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3, either byte order), tensors not read.

    Arrays longer than 65,536 elements (vocabularies) are skipped and reported as ``None``.
    Raises ModelError when the file is not a readable GGUF file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse_gguf(mm, path)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise ModelError(f"{path} is not a readable GGUF file ({exc}); re-download or re-convert it") from None


def _parse_gguf(mm: mmap.mmap, path: Path) -> dict[str, Any]:
    if mm[:4] != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf model file")
    end = "<"
    (version,) = struct.unpack_from("<I", mm, 4)
    if version & 0xFFFF == 0:  # written big-endian
        end = ">"
        (version,) = struct.unpack_from(">I", mm, 4)
    if version < 2:
        raise ModelError(f"{path} is GGUF version {version}; convert it with a current llama.cpp (version 2 or later)")
    _, n_kv = struct.unpack_from(end + "QQ", mm, 8)
    off = 24

    def string(off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(end + "Q", mm, off)
        off += 8
        if off + n > len(mm):
            raise ValueError("string runs past the end of the file")
        return bytes(mm[off : off + n]).decode("utf-8"), off + n

    def value(vtype: int, off: int, keep: bool = True) -> tuple[Any, int]:
        if vtype in _GGUF_SCALARS:
            fmt = end + _GGUF_SCALARS[vtype]
            return (struct.unpack_from(fmt, mm, off)[0] if keep else None), off + struct.calcsize(fmt)
        if vtype == _GGUF_STRING:
            if keep:
                return string(off)
            (n,) = struct.unpack_from(end + "Q", mm, off)
            return None, off + 8 + n
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from(end + "IQ", mm, off)
            off += 12
            keep = keep and count <= _GGUF_MAX_ARRAY
            if etype in _GGUF_SCALARS:
                fmt = end + _GGUF_SCALARS[etype]
                size = struct.calcsize(fmt) * count
                if off + size > len(mm):
                    raise ValueError("array runs past the end of the file")
                items = list(struct.unpack_from(f"{end}{count}{_GGUF_SCALARS[etype]}", mm, off)) if keep else None
                return items, off + size
            found: list[Any] = []
            for _ in range(count):
                item, off = value(etype, off, keep)
                if keep:
                    found.append(item)
            return (found if keep else None), off
        raise ValueError(f"unknown value type {vtype}")

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = string(off)
        (vtype,) = struct.unpack_from(end + "I", mm, off)
        meta[key], off = value(vtype, off + 4)
    return meta


# Written last into a converted directory; its presence marks the conversion complete.
CONVERSION_MARKER = "kvstore-conversion.json"


# Bump when the conversion changes: directories written with another format are converted again.
CONVERSION_FORMAT = 1


# Text whose logits the conversion compares between the GGUF-loaded and the converted model.
PROBE_TEXT = "The capital of France is"


def converted_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Where :func:`convert_gguf` puts the safetensors copy of a GGUF file (which may not exist yet).

    The name carries a short hash of the file's resolved path, size and mtime, so a replaced or
    edited file gets a fresh conversion rather than a stale one.
    """
    path = Path(gguf_path).expanduser().resolve()
    st = path.stat()
    identity = f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return models_dir() / f"{path.stem}-{hashlib.sha256(identity).hexdigest()[:12]}"


def convert_gguf(gguf_path: str | os.PathLike[str], *, log: Callable[[str], None] | None = None) -> Path:
    """Convert a GGUF file once into a safetensors model directory and return that directory.

    Returns at once when the conversion exists. Otherwise loads the GGUF (de-quantized to
    float32), rebuilds a plain model from its config without ``quantization_config`` (a GGUF-loaded
    model refuses ``save_pretrained``), saves model and tokenizer into a temporary directory,
    checks that the saved model reproduces the GGUF model's logits bit for bit, and renames it into
    place. Another process finishing first is fine: its directory is kept and ours dropped.

    Raises :class:`ModelError` when ``gguf``/``accelerate`` are missing or transformers cannot read
    the file.
    """
    gguf = Path(gguf_path).expanduser().resolve()
    if not gguf.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {gguf}")
    final = converted_dir(gguf)
    if _is_converted(final):
        return final
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"loading a .gguf file needs the {' and '.join(missing)} package(s): pip install {' '.join(missing)}"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(final):
        if _is_converted(final):  # another process converted it while we waited
            return final
        # ~30 s for the bundled 98 MB file on 2 busy cores; de-quantization scales with size
        seconds = round(gguf.stat().st_size / 1e6 * 0.3, -1)
        (log or stderr_line)(
            f"kvstore: converting {gguf.name} to safetensors under {final.parent} "
            f"(once{f', ~{seconds:.0f} s' if seconds else ''})"
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the converted model is as shareable as the GGUF
            _convert_into(gguf, tmp)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_converted(directory: Path) -> bool:
    """A complete conversion in the current format (an older or broken one is converted again)."""
    try:
        marker = json.loads((directory / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERSION_FORMAT


def _convert_into(gguf: Path, out: Path) -> None:
    """Load ``gguf`` through transformers, save a plain float32 copy into ``out``, verify it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    with quiet_progress(), _quiet_gguf_progress():
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (OSError, ValueError, ImportError, KeyError, RuntimeError) as exc:
            raise ModelError(f"transformers cannot load {gguf.name}: {one_line(exc)}") from exc
        config = copy.deepcopy(quantized.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), strict=True)
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)

        probe = tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
        reloaded_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    with torch.inference_mode():
        expected = quantized.eval()(probe).logits[0, -1]
        got = reloaded.eval()(probe).logits[0, -1]
    if not torch.equal(expected, got):
        raise ModelError(
            f"converting {gguf.name} did not reproduce its logits (max difference "
            f"{(expected - got).abs().max().item():.3g}); load it with transformers directly"
        )
    if reloaded_tokenizer(PROBE_TEXT).input_ids != probe[0].tolist():
        raise ModelError(f"converting {gguf.name} changed its tokenizer; load it with transformers directly")
    st = gguf.stat()
    top = expected.topk(10)
    marker = {
        "format": CONVERSION_FORMAT,
        "gguf": str(gguf),
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
        "probe_text": PROBE_TEXT,
        "probe_ids": probe[0].tolist(),
        # the GGUF model's ten largest float32 logits after the probe: [token id, logit], exact
        "probe_top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)],
        "seconds": round(time.monotonic() - started, 1),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (out / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; if a complete ``final`` appeared meanwhile, keep it instead."""
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if _is_converted(final):
            return  # someone else won the race; the caller removes tmp
    # ``final`` exists but is incomplete (an interrupted copy): move it aside and take its place.
    trash = Path(tempfile.mkdtemp(prefix=f".trash-{final.name}-", dir=final.parent))
    try:
        os.rename(final, trash / "old")
    except FileNotFoundError:
        pass
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_converted(final):
            raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def _conversion_lock(final: Path) -> Iterator[None]:
    """Serialize conversions of one file across processes (an optimization: the rename is atomic)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: concurrent conversions just duplicate work
        yield
        return
    with open(final.parent / f".{final.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """The GGUF de-quantization bar uses ``tqdm`` directly, bypassing transformers' switch."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = NoBar
    try:
        yield
    finally:
        gguf_utils.tqdm = original


__all__ = ["CONVERSION_FORMAT", "CONVERSION_MARKER", "convert_gguf", "converted_dir", "read_gguf_metadata"]
