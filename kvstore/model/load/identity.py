"""Model identity: the fingerprint that keys a model's caches.

A model fingerprint is the sha256 of the config's canonical JSON (volatile fields removed) and a
digest of every weight tensor's name, dtype, shape and bytes. The same weights loaded from a hub id,
a local directory or a converted GGUF give the same fingerprint; a fine-tuned, quantized, re-typed
or re-configured model gives another.

The config digest is computed on every load (it is cheap), so an edited ``config.json`` always
changes the fingerprint. Hashing the weights costs ~0.4 s per GB, so only the weights digest is
remembered, in ``<home>/weights-digests.json``, under everything that identifies the files they were
loaded from (resolved path, device, inode, size, mtime_ns and ctime_ns: a file rewritten in place
and its mtime set back still has a new ctime), the dtype, and the loaded config in full (a config
change can change which tensors the same files load into, e.g. tied embeddings).
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

    return home() / "weights-digests.json"


def _weights_memo_key(model: torch.nn.Module, files: Iterable[str | os.PathLike]) -> str:
    """What must be unchanged for a remembered weights digest to still be right."""
    config = getattr(model, "config", None)
    config_text = json.dumps(config.to_dict() if config is not None else {}, sort_keys=True, default=str)
    parts = [
        "kvstore-weights-memo-2",
        dtypes.label(next(model.parameters()).dtype),
        hashlib.sha256(config_text.encode()).hexdigest(),
    ]
    for f in sorted(Path(p).resolve() for p in files):
        st = f.stat()
        parts.append(f"{f}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def model_fingerprint(model: torch.nn.Module, *, weight_files: Sequence[str | os.PathLike] = ()) -> str:
    """The model's fingerprint (64 hex chars). See the module docstring.

    ``weight_files``: the files the weights were loaded from; when given, the weights digest is
    memoized by their identity so later runs skip hashing the weights.
    """
    weights = None
    memo_key = None
    if weight_files:
        try:
            memo_key = _weights_memo_key(model, weight_files)
            found = json.loads(_memo_path().read_text()).get(memo_key)
            weights = found if isinstance(found, str) else None
        except (OSError, ValueError, AttributeError):
            pass
    if weights is None:
        weights = weights_digest(model)
        if memo_key is not None:
            _remember(memo_key, weights)
    return hashlib.sha256(f"{config_digest(model.config)}:{weights}".encode()).hexdigest()


def _remember(memo_key: str, digest: str) -> None:
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            memo = json.loads(path.read_text())
        except (OSError, ValueError):
            memo = {}
        memo[memo_key] = digest
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".weights-digests.")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs re-hashing next time


__all__ = ["config_digest", "model_fingerprint", "weights_digest"]
