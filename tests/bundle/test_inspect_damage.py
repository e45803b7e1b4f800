"""`inspect` on a damaged store: each damaged payload is named in the human report, the dedup figure
counts only what can be read, and the exit code is 1 (0 stays for a healthy bundle, complete or not)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from trajectory_replay.bundle import BundleReader, BundleWriter
from trajectory_replay.cli import app
from trajectory_replay.replay import canonical_case
from trajectory_replay.store import ObjectStore, blob_ref_key, object_key
from trajectory_replay.units import human_bytes

runner = CliRunner()


def inspect(*args: str):
    return runner.invoke(app, ["inspect", *args])


def payload_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"  payload    {name} "))


def specs(url: str, **options) -> dict:
    return dict(BundleReader.open(url, **options).manifest.payloads)


@pytest.fixture
def bundle(tmp_path) -> tuple[Path, str, dict]:
    root = tmp_path / "store"
    url = write_canonical(str(root))
    return root, url, specs(url)


def healthy_figures(url: str) -> dict:
    info = json.loads(inspect(url, "--json").stdout)
    return {k: info[k] for k in ("logical_bytes", "unique_chunk_bytes", "unreadable_bytes", "dedup_ratio")}


def test_healthy_bundle(bundle):
    _, url, _ = bundle
    result = inspect(url)
    assert result.exit_code == 0, result.output
    assert "DAMAGED" not in result.stdout and "UNREADABLE" not in result.stdout and "damage " not in result.stdout
    info = json.loads(inspect(url, "--json").stdout)
    assert info["damaged"] is False and info["problems"] == [] and info["unreadable_bytes"] == 0
    assert all(p["readable"] for p in info["payloads"])


def test_deleted_record(bundle):
    root, url, spec = bundle
    before = healthy_figures(url)
    kl = spec["kl"]
    os.remove(root / object_key(kl.record))
    result = inspect(url)
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert "DAMAGED (1 problem)" in lines[0] and lines[0].startswith("bundle b-00001 [native] — complete")
    assert payload_line(result.stdout, "kl").endswith(f"UNREADABLE: record {object_key(kl.record)} is missing")
    assert "chunks" not in payload_line(result.stdout, "kl")
    assert "UNREADABLE" not in payload_line(result.stdout, "entropy")
    assert any(line.startswith("  damage     run `trajectory-replay fsck`") for line in lines)

    info = json.loads(inspect(url, "--json").stdout)
    assert info["damaged"] is True and len(info["problems"]) == 1 and "payload 'kl'" in info["problems"][0]
    entry = next(p for p in info["payloads"] if p["name"] == "kl")
    assert entry["readable"] is False and "is missing" in entry["error"]
    # the unreadable payload's bytes leave the dedup figure; its chunks were not counted as stored before either
    assert info["unreadable_bytes"] == kl.size
    assert info["logical_bytes"] == before["logical_bytes"]
    assert info["unique_chunk_bytes"] == before["unique_chunk_bytes"] - kl.size  # kl shares no chunk
    assert info["dedup_ratio"] == pytest.approx((info["logical_bytes"] - kl.size) / info["unique_chunk_bytes"])
    total = next(line for line in lines if line.startswith("  total"))
    assert f"({human_bytes(kl.size)} unreadable)" in total
    assert f"dedup {info['dedup_ratio']:.2f}x of the {human_bytes(info['logical_bytes'] - kl.size)} readable" in total


def test_altered_record_shared_by_two_payloads(bundle):
    """old_log_probs and log_probs hold the same bytes: one record, both payloads unreadable when it is altered."""
    root, url, spec = bundle
    assert spec["old_log_probs"].record == spec["log_probs"].record
    path = root / object_key(spec["log_probs"].record)
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    result = inspect(url)
    assert result.exit_code == 1, result.output
    for name in ("old_log_probs", "log_probs"):
        line = payload_line(result.stdout, name)
        assert f"UNREADABLE: record {object_key(spec[name].record)} is corrupt (content hashes to blake3:" in line
    info = json.loads(inspect(url, "--json").stdout)
    assert info["unreadable_bytes"] == spec["old_log_probs"].size + spec["log_probs"].size
    # the shared chunk is not stored readably: only the other payloads' chunks are counted
    readable = [p for p in info["payloads"] if p["readable"]]
    assert info["logical_bytes"] - info["unreadable_bytes"] == sum(p["size"] for p in readable)
    assert info["unique_chunk_bytes"] == sum(p["size"] for p in readable)  # canonical payloads: one chunk each


def test_missing_blob_ref(bundle):
    """The bytes stay readable through the manifest's record (replay and validate pass), but the store is damaged
    (cp refuses the bundle until fsck re-links the ref): shown per payload, exit 1, dedup unchanged."""
    root, url, spec = bundle
    before = healthy_figures(url)
    os.remove(root / blob_ref_key(spec["kl"].digest))
    result = inspect(url)
    assert result.exit_code == 1, result.output
    line = payload_line(result.stdout, "kl")
    assert "1 chunks" in line and line.endswith(f"DAMAGED: blob ref {blob_ref_key(spec['kl'].digest)} is missing")
    assert healthy_figures(url) == before
    assert runner.invoke(app, ["fsck", str(root)]).exit_code == 0  # re-links it
    assert inspect(url).exit_code == 0


def test_blob_ref_not_a_digest(bundle):
    root, url, spec = bundle
    (root / blob_ref_key(spec["entropy"].digest)).write_bytes(b"garbage")
    result = inspect(url)
    assert result.exit_code == 1
    assert payload_line(result.stdout, "entropy").endswith("is corrupt (does not hold a digest)")


def test_damaged_incomplete_bundle_exits_1(tmp_path):
    """Incomplete alone is 0 (inspect explains it); a damaged landed shard is 1 all the same."""
    root = tmp_path / "store"
    url = write_canonical(str(root), rank=0, expected_ranks=[0, 1])
    result = inspect(url)
    assert result.exit_code == 0 and "incomplete" in result.stdout.splitlines()[0]
    record = BundleReader(ObjectStore.open(root), "b-00001", _shard_marker(root), 0).manifest.payloads["kl"].record
    os.remove(root / object_key(record))
    result = inspect(url)
    assert result.exit_code == 1, result.output
    assert "incomplete" in result.stdout.splitlines()[0] and "UNREADABLE" in payload_line(result.stdout, "kl")


def _shard_marker(root: Path):
    from trajectory_replay.bundle.markers import CompleteMarker, RankMarker, rank_key, read_marker

    m = read_marker(ObjectStore.open(root).backend, rank_key("b-00001", 0), RankMarker)
    return CompleteMarker(
        bundle_id=m.bundle_id,
        anchor=m.anchor,
        expected_ranks=m.expected_ranks,
        multi_rank=True,
        shards={"0": m.documents},
    )


def test_damage_in_a_rank_not_shown(tmp_path):
    """A multi-rank bundle shows rank 0's payloads; damage of rank 1's is listed by rank and payload."""
    root = tmp_path / "store"
    case = canonical_case(buggy=False)
    for rank in (0, 1):
        writer = BundleWriter(
            f"{root}/mr",
            case.manifest.model_copy(update={"bundle_id": "mr"}),
            case.index.model_copy(update={"bundle_id": "mr"}),
            case.expected,
            rank=rank,
            expected_ranks=[0, 1],
        )
        writer.finalize(payloads={name: t + rank for name, t in case.payloads.items()})
    rank1 = BundleReader.open(f"{root}/mr/rank-1").manifest.payloads["kl"]
    assert rank1.record != BundleReader.open(f"{root}/mr/rank-0").manifest.payloads["kl"].record
    assert inspect(f"{root}/mr").exit_code == 0
    os.remove(root / object_key(rank1.record))
    result = inspect(f"{root}/mr")
    assert result.exit_code == 1, result.output
    assert "UNREADABLE" not in result.stdout
    assert (
        f"  damage     rank 1: payload 'kl': record {object_key(rank1.record)} is missing" in result.stdout.splitlines()
    )


def test_s3_record_deleted_behind_a_warm_cache(s3_root, s3_env, tmp_path, monkeypatch):
    """A remote store reads records through the local cache; inspect must ask the store itself, or a record
    deleted there after a replay warmed the cache would look intact."""
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    url, options = s3_root
    bundle_url = write_canonical(url, storage_options=options)
    assert runner.invoke(app, ["validate", bundle_url]).exit_code == 0  # reads every record through the cache
    assert any((tmp_path / "cache").rglob("*"))
    kl = specs(bundle_url)["kl"]
    ObjectStore.open(url, **options).backend.delete(object_key(kl.record))
    result = inspect(bundle_url)
    assert result.exit_code == 1, result.output
    assert payload_line(result.stdout, "kl").endswith(f"UNREADABLE: record {object_key(kl.record)} is missing")


def test_unreadable_document_of_another_landed_rank(tmp_path):
    """An incomplete bundle whose second landed rank lost its manifest: reported as that rank's problem, exit 1,
    the first rank still described (before, only the first landed rank was looked at)."""
    from trajectory_replay.bundle.markers import RankMarker, rank_key, read_marker

    root = tmp_path / "store"
    case = canonical_case(buggy=False)
    for rank in (0, 1):
        writer = BundleWriter(
            f"{root}/mr",
            case.manifest.model_copy(update={"bundle_id": "mr"}),
            case.index.model_copy(update={"bundle_id": "mr"}),
            case.expected,
            rank=rank,
            expected_ranks=[0, 1, 2],
        )
        writer.finalize(payloads={name: t + rank for name, t in case.payloads.items()})
    marker = read_marker(ObjectStore.open(root).backend, rank_key("mr", 1), RankMarker)
    os.remove(root / object_key(marker.documents.manifest.record))
    result = inspect(f"{root}/mr")
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert "incomplete" in lines[0] and "DAMAGED (1 problem)" in lines[0]
    assert "UNREADABLE" not in result.stdout and payload_line(result.stdout, "kl").endswith("1 chunks")
    damage = [line for line in lines if line.startswith("  damage     rank 1: ")]
    assert len(damage) == 1 and "manifest" in damage[0], result.stdout
