"""A writer killed with SIGKILL mid-put never leaves a partial object at a final key."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from trajectory_replay.store import ObjectStore, hash_bytes, object_key

WRITER = r"""
import os, sys
from trajectory_replay.store import ObjectStore
store = ObjectStore.open(sys.argv[1])
data = bytes(range(256)) * (1 << 20)  # 256 MiB, deterministic
print("start", flush=True)
while True:
    store.put(data)
    store.backend.delete("blobs/" + store.put(data).digest[7:9] + "/" + store.put(data).digest[7:])
"""


def test_sigkill_mid_put_leaves_no_partial_object(tmp_path):
    root = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"start"
    time.sleep(1.5)  # well inside the first put's chunk writes
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = ObjectStore.open(str(root))
    keys = store.backend.list("objects/")
    for key in keys:  # every visible object is whole: its bytes hash to its name
        data = store.backend.read(key)
        assert key == object_key(hash_bytes(data)), key
    leftovers = [p for p in root.rglob("*") if p.is_file() and p.name.startswith(".tmp-")]
    # temporary files may remain (garbage for gc) but are never listed as keys
    assert all(not k.split("/")[-1].startswith(".tmp-") for k in keys)
    data = bytes(range(256)) * (1 << 20)
    ref = store.put(data)
    assert store.get(ref) == data
    del leftovers
