"""A writer killed with SIGKILL mid-put never leaves a partial object at a final key."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from trajectory_replay.store import ObjectStore, hash_bytes, object_key

WRITER = r"""
import sys
from trajectory_replay.store import ObjectStore
store = ObjectStore.open(sys.argv[1])
base = bytes(range(256)) * (1 << 18)  # 64 MiB
print("start", flush=True)
i = 0
while True:  # new content every round, so every put writes new chunks until the kill
    store.put(i.to_bytes(8, "little") + base)
    i += 1
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
    data = (0).to_bytes(8, "little") + bytes(range(256)) * (1 << 18)
    ref = store.put(data)  # the put that may have been interrupted completes now
    assert store.get(ref) == data
    del leftovers
