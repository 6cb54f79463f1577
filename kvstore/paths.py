"""Where kvstore keeps things on disk.

``$KVSTORE_HOME`` wins. Otherwise, when kvstore runs from a source checkout that has the
``cache/`` directory (marked by ``CACHEDIR.TAG``), that directory is used; an installed copy
falls back to ``~/.cache/kvstore``. The default store is ``<home>/store`` unless
``$KVSTORE_STORE`` names another; converted models live under ``<home>/models`` unless
``$KVSTORE_MODELS`` names another directory (tests use it to share one converted model while
everything else goes to a temporary home).
"""

from __future__ import annotations

import os
from pathlib import Path

_CHECKOUT_CACHE = Path(__file__).resolve().parent.parent / "cache"


def home() -> Path:
    """The kvstore home directory (not created here)."""
    env = os.environ.get("KVSTORE_HOME")
    if env:
        return Path(env).expanduser()
    if (_CHECKOUT_CACHE / "CACHEDIR.TAG").is_file():
        return _CHECKOUT_CACHE
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "kvstore"


def default_store() -> str:
    """The store used when none is given: ``$KVSTORE_STORE`` or ``<home>/store``."""
    return os.environ.get("KVSTORE_STORE") or str(home() / "store")


def models_dir() -> Path:
    """Directory for models converted to safetensors (e.g. the bundled GGUF): ``$KVSTORE_MODELS``
    or ``<home>/models``."""
    env = os.environ.get("KVSTORE_MODELS")
    if env:
        return Path(env).expanduser()
    return home() / "models"
