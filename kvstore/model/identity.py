"""Model identity: the fingerprint that keys a model's caches.

A model fingerprint is the sha256 of the config's canonical JSON (volatile fields removed) and a
digest of every weight tensor's name, dtype, shape and bytes. The same weights loaded from a hub id,
a local directory or a converted GGUF give the same fingerprint; a fine-tuned, quantized or
re-typed model gives another. Hashing weights costs ~0.4 s per GB of weights, so the result is
remembered in ``<home>/fingerprints.json`` under the identity (path, size, mtime) of the files
the weights came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from kvstore import dtypes

# Config fields that do not change the tensors a model computes, or that depend on how it was loaded.
_VOLATILE = {
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "quantization_config",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "id2label",
    "label2id",
    "problem_type",
    "task_specific_params",
    "tokenizer_class",
    "prefix",
    "finetuning_task",
    "chunk_size_feed_forward",
    "tie_word_embeddings",
}


def _canonical(obj):
    if isinstance(obj, dict):
        return {
            str(k): _canonical(v)
            for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))
            if not str(k).startswith("_") and k not in _VOLATILE
        }
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, float) and obj.is_integer():
        return obj  # JSON keeps 1.0 as 1.0; stays stable across loads
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def config_digest(config) -> str:
    """sha256 of the model config's canonical JSON, volatile fields removed."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = json.dumps(_canonical(d), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every state-dict tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{dtypes.label(t.dtype)}|{list(t.shape)}\n".encode())
        t = t.to("cpu").contiguous()
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _memo_path() -> Path:
    from kvstore.paths import home

    return home() / "fingerprints.json"


def _file_identity(files: Iterable[str | os.PathLike], dtype: torch.dtype) -> str:
    parts = [str(dtype)]
    for f in sorted(Path(p).resolve() for p in files):
        st = f.stat()
        parts.append(f"{f}|{st.st_size}|{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def model_fingerprint(model: torch.nn.Module, *, weight_files: Sequence[str | os.PathLike] = ()) -> str:
    """The model's fingerprint (64 hex chars). See the module docstring.

    ``weight_files``: the files the weights were loaded from; when given, the result is memoized
    by their identity so later runs skip hashing the weights.
    """
    dtype = next(model.parameters()).dtype
    memo_key = None
    if weight_files:
        try:
            memo_key = _file_identity(weight_files, dtype)
            memo = json.loads(_memo_path().read_text())
            if isinstance(memo.get(memo_key), str):
                return memo[memo_key]
        except (OSError, ValueError):
            pass
    fp = hashlib.sha256(f"{config_digest(model.config)}:{weights_digest(model)}".encode()).hexdigest()
    if memo_key is not None:
        _remember(memo_key, fp)
    return fp


def _remember(memo_key: str, fp: str) -> None:
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            memo = json.loads(path.read_text())
        except (OSError, ValueError):
            memo = {}
        memo[memo_key] = fp
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fingerprints.")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs re-hashing next time


__all__ = ["config_digest", "model_fingerprint", "weights_digest"]
