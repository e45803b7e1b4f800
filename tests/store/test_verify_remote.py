"""Verification reads the remote store, not the local read cache (real SeaweedFS).

A warm cache holds verified copies of a bundle's objects. When the server's copy of one is
damaged afterwards, `validate` and `fsck` must say so and name the object: they exist to check
what is stored. Replay may keep serving the cached copy (its bytes are exactly the ones the
digest names) and fails, naming the object, only where it has to fetch the damaged one.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from trajectory_replay.bundle import open_native
from trajectory_replay.cli import app
from trajectory_replay.errors import IntegrityError
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.cache import ENV_DIR
from trajectory_replay.store.digest import object_key

pytestmark = pytest.mark.s3

runner = CliRunner()


def _damage_chunk(url: str, options: dict, payload: str) -> str:
    """Overwrite the first chunk of `payload` on the server with other bytes of the same size; its key."""
    [source] = open_native(url, **options)
    store = source.store
    record = store.record(source.payload_ref(payload))
    key = object_key(record.chunks[0].digest)
    good = store.backend.read(key)
    store.backend.write(key, bytes(b ^ 0xFF for b in good))
    return key


def _cli(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_validate_and_fsck_see_a_server_object_damaged_after_the_cache_was_warmed(
    s3_root, s3_env, tmp_path, monkeypatch
):
    url, options = s3_root
    bundle = write_canonical(url, storage_options=options)
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cache"))
    warm = _cli("validate", bundle, "--json")
    assert warm.exit_code == 0, warm.output
    assert any((tmp_path / "cache").rglob("*")), "validate did not populate the read cache"

    key = _damage_chunk(bundle, options, "old_log_probs")

    checked = _cli("validate", bundle, "--json")
    report = json.loads(checked.stdout)
    assert checked.exit_code == 1 and not report["valid"], checked.stdout
    assert any(key in p for p in report["problems"]), report["problems"]

    fsck = _cli("fsck", url, "--json")
    assert fsck.exit_code == 1, fsck.output
    assert json.loads(fsck.stdout)["corrupt"] == [key]

    # replay reads through the cache: the verified copy there still serves it
    cached = _cli("replay", bundle)
    assert cached.exit_code == 0, cached.output
    # without that copy it must fetch the damaged object: one line naming it
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cold"))
    cold = _cli("replay", bundle)
    lines = cold.stderr.strip().splitlines()
    assert cold.exit_code == 1 and len(lines) == 1 and key in lines[0], cold.stderr


@pytest.mark.parametrize("how", ["get", "get_objects", "read_range"])
def test_a_store_that_does_not_trust_its_cache_reads_every_byte_from_the_server(s3_root, tmp_path, how):
    url, options = s3_root
    bundle = write_canonical(url, storage_options=options)
    [source] = open_native(bundle, **options)
    ref = source.payload_ref("old_log_probs")
    writer = ObjectStore.open(url, cache=False, **options)
    record = writer.record(ref)
    chunk = record.chunks[0]

    def read(store: ObjectStore):
        if how == "get":
            return bytes(store.get(ref))
        if how == "get_objects":
            return store.get_objects([chunk.digest])[0]
        return store.read_range(ref, 0, min(chunk.size, 100), record=record)

    cache_dir = tmp_path / "cache"
    trusting = ObjectStore.open(url, cache_dir=cache_dir, **options)
    expected = read(trusting)  # warms the cache
    verifying = ObjectStore.open(url, cache_dir=cache_dir, trust_cache=False, **options)
    assert read(verifying) == expected
    writer.backend.write(
        object_key(chunk.digest), bytes(b ^ 0xFF for b in writer.backend.read(object_key(chunk.digest)))
    )

    assert read(trusting) == expected  # content addressing: the cached copy is still right
    with pytest.raises(IntegrityError, match=object_key(chunk.digest)):
        read(verifying)


def test_a_verifying_read_fills_a_cold_cache(s3_root, tmp_path):
    url, options = s3_root
    bundle = write_canonical(url, storage_options=options)
    [source] = open_native(bundle, **options)
    ref = source.payload_ref("old_log_probs")
    cache_dir = tmp_path / "cache"
    verifying = ObjectStore.open(url, cache_dir=cache_dir, trust_cache=False, **options)
    data = bytes(verifying.get(ref))
    assert any(p.is_file() for p in cache_dir.rglob("*"))
    cached = ObjectStore.open(url, cache_dir=cache_dir, **options)
    cached.backend.stats.reset()
    assert bytes(cached.get(ref)) == data
    # the record and every chunk come from the cache: nothing crosses the network
    assert cached.backend.stats.reads == 0
