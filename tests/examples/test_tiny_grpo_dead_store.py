"""The tiny GRPO example capturing to an S3 endpoint that accepts connections and never answers.

Training completes, slowed by about one bounded timeout (not one per bundle: each rank captures 6 records), every
rank reports `capture_flushed` false since nothing landed, and stderr holds one warning line per rank about the
store, without a traceback. Its numbers are those of the capture-off run of the same configuration (the
`baseline` fixture); its waits on capture are the ones the example measures in each rank.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.examples.helpers import EXAMPLE, SMALL, STEPS_PER_ROLLOUT, ExampleRun, clean_env

READ_TIMEOUT = 3.0
CONNECT_TIMEOUT = 1.0
ROLLOUTS = 2
RECORDS = ROLLOUTS * (1 + STEPS_PER_ROLLOUT)  # per rank: each rollout, and each of its actor steps


def test_capture_to_a_silent_store_costs_one_timeout_and_reports_nothing_flushed(
    baseline: ExampleRun, tmp_path
) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(512)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    out = tmp_path / "dead.json"
    env = clean_env(
        {
            "AWS_ACCESS_KEY_ID": "key",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
            "TRAJECTORY_REPLAY_CACHE_DIR": str(tmp_path / "cache"),
            "TRAJECTORY_REPLAY_S3_READ_TIMEOUT": str(READ_TIMEOUT),
            "TRAJECTORY_REPLAY_S3_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
            "TRAJECTORY_REPLAY_S3_MAX_ATTEMPTS": "1",
        }
    )
    try:
        proc = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                "--steps",
                str(ROLLOUTS),
                "--world-size",
                "2",
                "--seed",
                "3",
                *SMALL,
                "--capture-dir",
                "s3://capture-bucket/run",
                "--out-json",
                str(out),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    finally:
        silent.close()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text(encoding="utf-8"))

    # training is the same run, and nothing was captured
    assert result["param_checksum"] == baseline.result["param_checksum"]
    ranks = result["capture"]["ranks"]
    assert [r["flushed"] for r in ranks] == [False, False], ranks
    assert "capture_flushed=False" in proc.stdout
    for rank in ranks:
        stats = rank["stats"]
        assert stats["written"] == 0 and 1 <= stats["errors"] <= 2, stats
        assert stats["enqueued"] + stats["dropped"] >= RECORDS, stats
    # all the hooks together took less than one connect timeout: not one of them waited on the store
    assert sum(t["capture_seconds"] for t in result["timing"]) < 0.9 * CONNECT_TIMEOUT, result["timing"]

    # one timeout, once: a timeout per bundle would add at least RECORDS x READ_TIMEOUT. Measured where training
    # waits on capture outside the hooks (starting it, its imports included, and flushing it at exit), not as the
    # difference of this run's wall time and the baseline's, which were taken at different moments of a loaded host.
    bound = 3 * (READ_TIMEOUT + CONNECT_TIMEOUT) + 5
    assert bound < RECORDS * READ_TIMEOUT
    for rank in ranks:
        assert rank["start_seconds"] + rank["shutdown_seconds"] < bound, rank

    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    store_lines = [line for line in lines if line.startswith("capture:")]
    assert len(store_lines) == 2 and len(lines) == 2, proc.stderr  # one per rank, and nothing else
    for line in store_lines:
        assert "s3://capture-bucket/run" in line and endpoint in line and "AWS_ENDPOINT_URL" in line, line
        assert f"no answer within the {READ_TIMEOUT:g}s read timeout" in line, line
