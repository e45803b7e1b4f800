"""BundleWriter and BundleReader on memory, local disk and S3: layout, lazy verified reads, markers, redaction."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.bundle.helpers import write_canonical
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleReader, BundleWriter, open_native
from trajectory_replay.bundle.markers import COMPLETE, complete_key, rank_key
from trajectory_replay.bundle.schema import SampleRecord
from trajectory_replay.errors import BundleError
from trajectory_replay.replay import canonical_case, replay
from trajectory_replay.store.layout import OBJECTS_DIR, REFS_DIR
from trajectory_replay.store.liveness import INFLIGHT_PREFIX


@pytest.fixture(params=["memory", "local", "s3"])
def root(request, tmp_path):
    """(root url, storage options)"""
    if request.param == "memory":
        return request.getfixturevalue("memory_root"), {}
    if request.param == "local":
        return str(tmp_path / "store"), {}
    url, options = request.getfixturevalue("s3_root")
    return url, {**options, "cache_dir": str(tmp_path / "cache")}


def _opts(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != "cache_dir"}


def test_roundtrip_and_layout(root):
    url, options = root
    path = write_canonical(url, storage_options=options)
    reader = BundleReader.open(path, **options)
    case = canonical_case(buggy=False)
    assert reader.bundle_id == "b-00001" and reader.rank is None
    for name, tensor in case.payloads.items():
        assert torch.equal(reader.load_payload(name), tensor), name
    assert reader.manifest.payloads["loss_mask"].dtype == "torch.uint8"
    assert torch.equal(reader.load_payload("loss_mask"), torch.ones(8, dtype=torch.uint8))
    assert all(s.loss_mask == [] for s in reader.index.samples)  # masks moved to the payload
    assert [s.loss_mask for s in reader.full_index().samples] == [[1, 1]] * 4
    assert reader.expected == case.expected
    backend = open_backend(url, **_opts(options))
    assert backend.list_dir("b-00001") == [COMPLETE]  # the bundle directory holds markers only
    assert {k.split("/")[0] for k in backend.list()} == {"b-00001", "objects", "blobs"}  # in-flight record removed
    assert replay([reader]).passed


def test_sibling_bundles_share_objects(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    objects_before = set(open_backend(root).list(f"{OBJECTS_DIR}/"))
    write_canonical(root, name="b-copy")
    new = set(open_backend(root).list(f"{OBJECTS_DIR}/")) - objects_before
    # identical payloads are stored once: only the index/manifest documents (they name the bundle) are new
    assert 0 < len(new) <= 4


def test_rows_of_selected_samples_are_read_lazily(tmp_path):
    n, tokens = 64, 4096
    index = canonical_case(False).index
    samples = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=i // 8,
            response_length=tokens,
            total_length=tokens + 4,
            loss_mask=[1] * tokens,
            raw_reward=float(i),
            reward=0.0,
        )
        for i in range(n)
    ]
    index = index.model_copy(update={"samples": samples, "bundle_id": "big"})
    manifest = canonical_case(False).manifest.model_copy(update={"bundle_id": "big"})
    data = torch.randn(n * tokens)
    w = BundleWriter(str(tmp_path / "store" / "big"), manifest, index, {})
    w.write_payload("old_log_probs", data)
    w.finalize()
    reader = BundleReader.open(str(tmp_path / "store" / "big"))
    stats = reader.store.backend.stats
    stats.reset()
    rows = reader.load_payload("old_log_probs", samples=[3, 40])
    assert torch.equal(rows, torch.cat([data[3 * tokens : 4 * tokens], data[40 * tokens : 41 * tokens]]))
    payload_bytes = reader.manifest.payloads["old_log_probs"].size
    # the record, the header block and the blocks holding two rows: a few percent of the payload
    assert stats.bytes_read < payload_bytes * 0.1, (stats.bytes_read, payload_bytes)


def test_same_content_rewrite_is_idempotent_different_refused(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root)  # a retry with identical content succeeds
    with pytest.raises(BundleError, match="already exists with different content"):
        write_canonical(root, buggy=True, name="b-00001")


def test_inflight_record_lists_objects_before_they_are_written(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    w = BundleWriter(f"{root}/b-00001", case.manifest, case.index, case.expected)
    w.write_payload("old_log_probs", case.payloads["old_log_probs"])
    backend = open_backend(root)
    records = backend.list(INFLIGHT_PREFIX)
    assert records == [w.inflight.key]
    import json

    listed = set(json.loads(backend.read(records[0]))["digests"])
    stored = {"blake3:" + k.rsplit("/", 1)[1] for k in backend.list(f"{OBJECTS_DIR}/")}
    assert stored <= listed  # every object written so far was listed first
    w.abort()
    assert backend.list(INFLIGHT_PREFIX) == []


def test_multi_rank_completion(root):
    url, options = root
    case = canonical_case(False)
    path = f"{url}/mr"
    manifest = case.manifest.model_copy(update={"bundle_id": "mr"})
    index = case.index.model_copy(update={"bundle_id": "mr"})

    def write(rank):
        w = BundleWriter(path, manifest, index, case.expected, rank=rank, expected_ranks=[0, 1], **options)
        for name, t in case.payloads.items():
            w.write_payload(name, t)
        return w.finalize()

    assert write(0) is None  # rank 1 has not landed: no final COMPLETE yet
    backend = open_backend(url, **_opts(options))
    assert backend.exists(rank_key("mr", 0)) and not backend.exists(complete_key("mr"))
    with pytest.raises(BundleError, match=r"refused until the bundle's final COMPLETE exists.*missing ranks \[1\]"):
        BundleReader.open(f"{path}/rank-0", **options)
    final = write(1)
    assert final is not None and sorted(final.shards) == ["0", "1"]
    readers = open_native(path, **options)
    assert [r.rank for r in readers] == [0, 1]
    assert BundleReader.open(f"{path}/rank-1", **options).rank == 1
    with pytest.raises(BundleError, match="multi-rank"):
        BundleReader.open(path, **options)
    assert replay(readers).passed
    # identical payloads of the two replica ranks are stored once
    digests = {r.manifest.payloads["old_log_probs"].digest for r in readers}
    assert len(digests) == 1


def test_reader_finalizes_when_last_rank_died_after_landing(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    manifest = case.manifest.model_copy(update={"bundle_id": "mr"})
    index = case.index.model_copy(update={"bundle_id": "mr"})
    for rank in (0, 1):
        w = BundleWriter(f"{root}/mr", manifest, index, case.expected, rank=rank, expected_ranks=[0, 1])
        for name, t in case.payloads.items():
            w.write_payload(name, t)
        w.finalize()
    backend = open_backend(root)
    backend.delete(complete_key("mr"))  # as if the last rank died between its marker and COMPLETE
    readers = open_native(f"{root}/mr")
    assert len(readers) == 2
    assert backend.exists(complete_key("mr"))


def test_concurrent_finalizers_agree(s3_root):
    url, options = s3_root
    case = canonical_case(False)
    manifest = case.manifest.model_copy(update={"bundle_id": "race"})
    index = case.index.model_copy(update={"bundle_id": "race"})
    results, errors = [], []

    def land(rank):
        try:
            w = BundleWriter(
                f"{url}/race", manifest, index, case.expected, rank=rank, expected_ranks=[0, 1, 2, 3], **options
            )
            for name, t in case.payloads.items():
                w.write_payload(name, t)
            results.append(w.finalize())
        except Exception as exc:  # pragma: no cover - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=land, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(open_native(f"{url}/race", **options)) == 4
    finals = [r for r in results if r is not None]
    assert finals and all(f.shards == finals[0].shards for f in finals)


def test_rank_writer_retry_stops_at_landed_marker(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    manifest = case.manifest.model_copy(update={"bundle_id": "mr"})
    index = case.index.model_copy(update={"bundle_id": "mr"})
    for _attempt in range(2):
        w = BundleWriter(f"{root}/mr", manifest, index, case.expected, rank=0, expected_ranks=[0, 1])
        for name, t in case.payloads.items():
            w.write_payload(name, t)
        assert w.finalize() is None
    assert open_backend(root).list_dir("mr") == ["COMPLETE.0"]


def test_redaction_applied_before_storage(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    secret = "the-secret-prompt-text-42"
    samples = [
        s.model_copy(
            update={
                "prompt": secret,
                "response": "answer-" + secret,
                "label": "LBL-" + secret,
                "tool_output": "TOOL-" + secret,
            }
        )
        for s in case.index.samples
    ]
    index = case.index.model_copy(update={"samples": samples})
    manifest = case.manifest.model_copy(
        update={"redaction": {"prompt": "hash", "response": "truncate:3", "label": "drop", "tool_output": "drop"}}
    )
    w = BundleWriter(f"{root}/b-00001", manifest, index, case.expected)
    for name, t in case.payloads.items():
        w.write_payload(name, t)
    w.finalize()
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    sample = BundleReader.open(f"{root}/b-00001").index.samples[0]
    assert sample.prompt.startswith("blake3:") and sample.response == "ans"
    assert sample.label is None and sample.tool_output is None


def test_no_credentials_written(s3_root, tmp_path):
    url, options = s3_root
    path = write_canonical(url, storage_options=options)
    backend = open_backend(url, **options)
    for key in backend.list():
        data = backend.read(key)
        assert options["secret"].encode() not in data and options["key"].encode() not in data, key
    assert BundleReader.open(path, **options).label.startswith("s3://")


def test_structure_checked_semantics_written_as_given(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    index = case.index.model_copy(
        update={"config": case.index.config.model_copy(update={"advantage_estimator": "my-estimator"})}
    )
    expected = {**case.expected, "reward.raw": {"raw_rewards": [float("nan"), 1.0]}}
    w = BundleWriter(f"{root}/b-00001", case.manifest, index, expected)
    w.write_payload("kl", torch.tensor([float("nan")] * 3))  # wrong length and NaN: data, not structure
    with pytest.raises(BundleError, match="expected a torch.Tensor"):
        w.write_payload("entropy", [0.5] * 8)
    with pytest.raises(BundleError, match="already written"):
        w.write_payload("kl", torch.zeros(8))
    with pytest.raises(BundleError, match="reserved"):
        w.write_payload("loss_mask", torch.ones(8))
    w.finalize()
    reader = BundleReader.open(f"{root}/b-00001")
    assert reader.index.config.advantage_estimator == "my-estimator"
    assert reader.load_payload("kl").isnan().all()


@pytest.mark.parametrize(
    "mask, ok",
    [
        ([1, 0, 1], True),
        ([True, False, True], True),
        ([1.0, 0.0, 1.0], True),
        ([1, 2, 1], False),
        ([1, -1, 0], False),
        ([0.5, 1, 1], False),
    ],
)
def test_loss_mask_values(tmp_path, mask, ok):
    case = canonical_case(False)
    samples = list(case.index.samples)
    # records built with model_copy are not validated: the writer sees the values exactly as given
    samples[1] = samples[1].model_copy(update={"response_length": 3, "loss_mask": mask})
    index = case.index.model_copy(update={"samples": samples})
    w = BundleWriter(
        str(tmp_path / "store" / "b"),
        case.manifest.model_copy(update={"bundle_id": "b"}),
        index.model_copy(update={"bundle_id": "b"}),
        case.expected,
    )
    if not ok:
        with pytest.raises(BundleError, match=f"sample {samples[1].sample_id}: loss_mask values must be 0 or 1"):
            w.finalize()
        return
    w.finalize()
    reader = BundleReader.open(str(tmp_path / "store" / "b"))
    masks = reader.full_index().samples
    assert masks[1].loss_mask == [int(v) for v in mask]
    assert [m.loss_mask for m in masks] == [[int(v) for v in s.loss_mask] for s in samples]


def test_write_payloads_lists_in_flight_once(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    w = BundleWriter(f"{root}/b-00001", case.manifest, case.index, case.expected)
    writes = []
    original = w.store.backend.write
    w.store.backend.write = lambda key, data, **kw: (writes.append(key), original(key, data, **kw))[1]
    w.write_payloads(case.payloads)
    assert writes == [w.inflight.key]  # one listing for every payload
    w.finalize()
    assert writes.count(w.inflight.key) == 2  # and one for the documents and the mask
    assert replay(open_native(f"{root}/b-00001")).passed


def test_finalize_with_payloads_writes_the_bundle_in_one_batch(tmp_path):
    """Payloads given to finalize go up with the documents: one in-flight listing, one round of lookups, and
    the same bundle as write_payloads followed by finalize."""
    case = canonical_case(False)
    w = BundleWriter(str(tmp_path / "one" / "b-00001"), case.manifest, case.index, case.expected)
    writes, lookups = [], []
    backend = w.store.backend
    write, read = backend.write, backend.read
    backend.write = lambda key, data, **kw: (writes.append(key), write(key, data, **kw))[1]
    backend.read = lambda key, *args, **kw: (lookups.append(key), read(key, *args, **kw))[1]
    w.finalize(payloads=case.payloads)
    assert writes == [w.inflight.key]
    # every distinct payload blob and the mask looked up once, then the three documents
    blobs = [k for k in lookups if k.startswith(f"{REFS_DIR}/")]
    distinct = len({t.numpy().tobytes() for t in case.payloads.values()})
    assert len(blobs) == len(set(blobs)) == distinct + 1 + 3
    two = write_canonical(str(tmp_path / "two"))
    one = BundleReader.open(str(tmp_path / "one" / "b-00001"))
    assert one.manifest == BundleReader.open(two).manifest
    assert replay(open_native(str(tmp_path / "one" / "b-00001"))).passed


def test_payload_stored_first_with_other_chunks_is_named_by_its_record(tmp_path):
    """A concurrent writer stored the same payload first, chunked differently: the create-once ref keeps that
    writer's record, and the manifest names this writer's own record (whose chunks it wrote and listed itself,
    so it knows them whole); the bundle reads and replays."""
    from trajectory_replay.store import ObjectStore

    case = canonical_case(False)
    root = str(tmp_path / "store")
    w = BundleWriter(f"{root}/b-00001", case.manifest, case.index, case.expected)
    name = "old_log_probs"
    encoded = w._encode(name, case.payloads[name], role="input")
    other = ObjectStore.open(root)
    plan_holder = {}
    real = w.store.plan_many

    def plan_then_race(items):
        plans = real(items)
        if not plan_holder:  # after this writer planned, another stores the same bytes cut at other rows
            plan_holder["ref"] = other.put(encoded.blob, boundaries=[8])
        return plans

    w.store.plan_many = plan_then_race
    w.finalize(payloads=case.payloads)
    reader = BundleReader.open(f"{root}/b-00001")
    spec = reader.manifest.payloads[name]
    assert other._read_ref(spec.digest) == plan_holder["ref"].record != spec.record
    assert len(other.record(plan_holder["ref"]).chunks) == 2  # not how this writer cut it (one chunk)
    assert len(other.record(reader.payload_ref(name)).chunks) == 1
    assert replay(open_native(f"{root}/b-00001")).passed


def test_micro_batch_rows_are_shared_between_bundles(tmp_path):
    """A step-level payload holding some micro-batches of a rollout-level one stores only its header chunk."""
    tokens = 300  # 1,200-byte float32 rows: a micro-batch of two samples is chunked on its own
    base = canonical_case(False)

    def write(name: str, mbs: list[int], data: torch.Tensor):
        samples = [
            SampleRecord(
                sample_id=f"s-{m}-{j}",
                group_index=m,
                response_length=tokens,
                total_length=tokens + 4,
                loss_mask=[1] * tokens,
                raw_reward=0.0,
                reward=0.0,
                micro_batch_id=f"mb-{m:04d}",
            )
            for m in mbs
            for j in range(2)
        ]
        index = base.index.model_copy(update={"samples": samples, "bundle_id": name})
        w = BundleWriter(
            str(tmp_path / "store" / name), base.manifest.model_copy(update={"bundle_id": name}), index, {}
        )
        w.write_payload("old_log_probs", data)
        w.finalize()
        return w.store

    rows = torch.randn(8, tokens)  # four micro-batches of two samples
    write("rollout-0", [0, 1, 2, 3], rows.reshape(-1))
    store = write("step-0-1", [1, 2], rows[2:6].reshape(-1))
    reader = BundleReader.open(str(tmp_path / "store" / "step-0-1"))
    assert torch.equal(reader.load_payload("old_log_probs"), rows[2:6].reshape(-1))
    rollout = BundleReader.open(str(tmp_path / "store" / "rollout-0"))
    chunks = {
        name: {c.digest for c in store.record(src.payload_ref("old_log_probs")).chunks}
        for name, src in (("step", reader), ("rollout", rollout))
    }
    assert len(chunks["step"]) == 3 and len(chunks["step"] - chunks["rollout"]) == 1  # only its header
