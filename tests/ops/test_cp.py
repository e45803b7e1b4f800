"""cp: between local disk and S3 both ways, byte-identical and valid; resumable after SIGKILL; idempotent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import reachable, validates, write_big
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import open_sources
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.cli import app
from trajectory_replay.errors import IntegrityError, SelectionError, TrajectoryReplayError, UsageError
from trajectory_replay.ops.cp import copy_bundles
from trajectory_replay.replay import replay
from trajectory_replay.store.layout import OBJECTS_DIR

NAMES = ("b-00001", "b-00065")


def test_round_trip_local_s3_local_is_byte_identical_and_valid(tmp_path, s3_root):
    url, options = s3_root
    src, back = str(tmp_path / "src"), str(tmp_path / "back")
    write_canonical(src)
    write_canonical(src, buggy=True)
    up = copy_bundles(src, url, all_bundles=True, dest_options=options)
    assert up.bundles == list(NAMES) and up.objects_copied > 0 and up.markers_written == 2
    down = copy_bundles(url, back, all_bundles=True, source_options=options)
    assert down.objects_copied == up.objects_copied and down.bytes_copied == up.bytes_copied
    local, s3, copy = open_backend(src), open_backend(url, **options), open_backend(back)
    for name in NAMES:
        keys = reachable(src, name)
        assert keys == reachable(back, name) == reachable(url, name, **options)
        for key in keys:
            assert local.read(key) == s3.read(key) == copy.read(key), key
        assert validates(f"{back}/{name}")
        assert validates(f"{url}/{name}", **options, cache_dir=str(tmp_path / "cache"))
        assert replay(open_sources(f"{back}/{name}")).to_dict() == replay(open_sources(f"{src}/{name}")).to_dict()
    again = copy_bundles(src, url, all_bundles=True, dest_options=options)
    assert again.objects_copied == 0 and again.bytes_copied == 0 and again.markers_written == 0
    assert again.objects_skipped == up.objects_copied


def test_selection(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    write_canonical(src)
    write_canonical(src, name="other")
    with pytest.raises(SelectionError, match="choose with --step"):
        copy_bundles(src, dest)
    with pytest.raises(SelectionError, match="no complete bundle matches --rollout 7"):
        copy_bundles(src, dest, rollout=7)
    with pytest.raises(UsageError):
        copy_bundles(src, dest, step="120:0", all_bundles=True)
    with pytest.raises(UsageError):
        copy_bundles(f"{src}/other/rank-0", dest)
    one = copy_bundles(f"{src}/other", dest)
    assert one.bundles == ["other"] and validates(f"{dest}/other")
    assert copy_bundles(src, dest, step="120:0").bundles == ["b-00001", "other"]


def test_corrupt_source_object_is_not_copied(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    path = write_canonical(src)
    backend = open_backend(src)
    chunk = next(
        k for k in sorted(reachable(src, "b-00001")) if k.startswith(f"{OBJECTS_DIR}/") and backend.size(k) > 100
    )
    data = bytearray(backend.read(chunk))
    data[50] ^= 0xFF
    backend.write(chunk, bytes(data))
    with pytest.raises(IntegrityError):
        copy_bundles(path, dest)
    assert not open_backend(dest).exists(complete_key("b-00001"))


def test_killed_copy_resumes_and_then_transfers_nothing(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    for i, name in enumerate(("big-a", "big-b")):
        write_big(src, name, seed=i, chunks=1500, chunk_size=4 << 10)
    cmd = [sys.executable, "-m", "trajectory_replay", "cp", src, dest, "--all", "--quiet", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    objects = Path(dest) / OBJECTS_DIR
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        # count committed objects only: temporary files of writes in flight are not objects yet
        if (
            objects.is_dir()
            and sum(1 for _, _, files in os.walk(objects) for f in files if not f.startswith(".tmp-")) >= 100
        ):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "cp finished before it could be killed: make the store bigger"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    backend = open_backend(dest)
    assert not backend.exists(complete_key("big-a")) and not backend.exists(complete_key("big-b"))
    with pytest.raises(TrajectoryReplayError):
        open_sources(f"{dest}/big-a")  # not visible: no COMPLETE
    partial = len(backend.list(f"{OBJECTS_DIR}/"))
    assert partial >= 100

    second = copy_bundles(src, dest, all_bundles=True)
    assert second.objects_skipped >= partial - 10 and second.objects_copied > 0 and second.markers_written == 2
    for name in ("big-a", "big-b"):
        for key in reachable(src, name):
            assert open_backend(src).read(key) == backend.read(key)
        assert validates(f"{dest}/{name}")

    third = CliRunner().invoke(app, cmd[3:])  # the same command line, in this process
    assert third.exit_code == 0 and third.exception is None, third.output
    import json

    report = json.loads(third.stdout)
    assert report["objects_copied"] == 0 and report["bytes_copied"] == 0 and report["markers_written"] == 0
    assert third.stderr == ""  # not a terminal: no progress bar
