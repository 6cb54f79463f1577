"""The codec a new store gets when none is named, chosen by where its caches are computed and by
what was measured there.

On a CPU the lossless default, ``zstd-split:1:16`` (``docs/codecs.md``: 0.69 of raw's size on
disk, loads within the CPU budget). On a CUDA device, ``raw``: the only GPU measurement (an H100,
before the staging ring) had the default at 0.38-0.51x the speed of recomputing where ``raw`` was
1.0-1.6x, and no GPU run yet shows ``zstd-split`` decoded on the device (nvCOMP, the ``gpu``
extra) faster than ``raw`` over the copy engine (``docs/gpu.md``, "Which codec on a GPU"). When
one does, :data:`DEVICE_DECODED_FASTER` records it and the choice follows.

The choice and its reason are written in the store's description (``StoreMeta.codec_reason``),
printed once by ``build`` and shown by ``kvstore stats``; a named codec (``--codec``) is always
used as given, and an existing store keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.store.codecs.base import DEFAULT_CODEC

# measured: whether zstd-split decoded on the device (nvCOMP) loads faster than raw on CUDA. None:
# not measured on a GPU yet (experiments/bench_gpu_realsize.py is the measurement).
DEVICE_DECODED_FASTER: bool | None = None


@dataclass(frozen=True)
class CodecChoice:
    """``spec``: the codec a new store records; ``reason``: why, in one line (empty: the default)."""

    spec: str
    reason: str = ""


def choose_codec(device_type: str, *, device_decoder: bool = False) -> CodecChoice:
    """The codec for a new store whose caches are computed on a ``device_type`` device (``"cpu"``,
    ``"cuda"``, ...); ``device_decoder``: nvCOMP imports there (the ``gpu`` extra)."""
    if device_type != "cuda":
        return CodecChoice(DEFAULT_CODEC)
    if device_decoder and DEVICE_DECODED_FASTER:
        return CodecChoice(DEFAULT_CODEC, "built on CUDA with nvCOMP: zstd decoded on the GPU loads faster than raw")
    why = "no GPU measurement yet shows zstd-split decoded on the device faster" if device_decoder else (
        "the lossless default decodes on the CPU (no nvCOMP: pip install kvstore[gpu])")  # fmt: skip
    return CodecChoice("raw", f"built on CUDA: raw loads fastest there ({why}; docs/gpu.md)")


__all__ = ["DEVICE_DECODED_FASTER", "CodecChoice", "choose_codec"]
