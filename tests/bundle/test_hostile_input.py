"""Hostile bytes under their real digests: every refusal is one line naming the object and the field, exit 1.

Content addressing verifies that bytes are what their digest names, not that they are sane. Each case
here stores crafted content the honest way (`store.put`, or an object written under the BLAKE3 of its
own bytes) in a real store root on disk, points a bundle at it, and runs the command line in-process:
exit code 1, a single `trajectory-replay: error:` line naming what is wrong and where, no traceback,
and no unbounded work (oversized documents are refused before a byte of them is fetched).
"""

from __future__ import annotations

import json
import struct
import time

import pytest
from typer.testing import CliRunner

from tests.bundle.test_bad_input import NAME, Crafted
from trajectory_replay.bundle import BundleReader
from trajectory_replay.bundle.codec import MAX_DIMS
from trajectory_replay.bundle.documents import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_BYTES_ENV,
    MAX_JSON_DEPTH,
    compact_json,
    max_document_bytes,
    nesting_exceeds,
)
from trajectory_replay.bundle.legacy import write_v1_bundle
from trajectory_replay.bundle.markers import MAX_RANKS, complete_key, rank_key
from trajectory_replay.bundle.schema import BundleIndex, SchemaWarning
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError
from trajectory_replay.replay import canonical_case
from trajectory_replay.store.digest import hash_bytes, object_key

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def error_line(result, *needles: str) -> str:
    """Exit 1, nothing escaped, and exactly one error line on stderr holding every needle."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 1, result.output
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith(("trajectory-replay: warning:", "trajectory-replay: WARNING:"))
    ]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trajectory-replay: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def crafted(tmp_path) -> Crafted:
    return Crafted(str(tmp_path / "store"))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# ---- safetensors headers ---------------------------------------------------------------------------


def _with_payload(crafted: Crafted, header: dict | bytes, data: bytes = b"\0" * 32) -> str:
    """Store a safetensors blob with `header` (a dict, or raw JSON text) as payload 'kl' of a new COMPLETE."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    ref = crafted.store.put(struct.pack("<Q", len(text)) + text + data)
    manifest = crafted.doc("manifest")
    manifest["payloads"]["kl"].update(digest=ref.digest, record=ref.record, size=ref.size)
    return crafted.commit(manifest=manifest)


def _entry(shape, offsets) -> bytes:
    """A header whose numbers are written as given (json.dumps cannot write 1e400 or keep 8.0 a float)."""
    return b'{"data":{"dtype":"F32","shape":' + shape + b',"data_offsets":' + offsets + b"}}"


HOSTILE_HEADERS = {
    # dimensions whose product overflows int64 (Python does not wrap; torch would)
    "product-overflows": (_entry(b"[4611686018427387904,4611686018427387904]", b"[0,32]"), "too large"),
    "empty-product-overflows": (_entry(b"[4611686018427387904,4611686018427387904,0]", b"[0,0]"), "too large"),
    "empty-bytes-overflow": (_entry(b"[0,4611686018427387904]", b"[0,0]"), "too large"),
    "dim-past-int64": (_entry(b"[18446744073709551616,0]", b"[0,0]"), "shape[0]"),
    "dim-infinite": (_entry(b"[1e400]", b"[0,32]"), "shape[0]"),
    "dim-fractional": (_entry(b"[8.5]", b"[0,32]"), "shape[0]"),
    "dim-float": (_entry(b"[8.0]", b"[0,32]"), "shape[0]"),
    "dim-bool": (_entry(b"[true]", b"[0,4]"), "shape[0]"),
    "dim-string": (_entry(b'["8"]', b"[0,32]"), "shape[0]"),
    "too-many-dims": (_entry(b"[" + b",".join([b"1"] * 100_000) + b"]", b"[0,4]"), f"more than {MAX_DIMS}"),
    "shape-not-list": (_entry(b'{"a":8}', b"[0,32]"), "shape is not a list"),
    "offset-past-end": (_entry(b"[8]", b"[0,64]"), "past the end"),
    "offset-past-int64": (_entry(b"[8]", b"[0,18446744073709551616]"), "data_offsets[1]"),
    "offset-infinite": (_entry(b"[8]", b"[0,1e400]"), "data_offsets[1]"),
    "offset-negative": (_entry(b"[8]", b"[-32,0]"), "data_offsets[0]"),
    "offsets-inverted": (_entry(b"[8]", b"[32,0]"), "inverted"),
    "offsets-not-a-pair": (_entry(b"[8]", b"[0,32,64]"), "data_offsets"),
    "entry-not-object": (b'{"data":[1,2]}', "malformed tensor entry"),
    "dtype-not-string": (b'{"data":{"dtype":["F32"],"shape":[8],"data_offsets":[0,32]}}', "dtype"),
    "metadata-nested-past-the-recursion-limit": (
        b'{"__metadata__":' + nested(200_000) + b',"data":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}',
        f"nests more than {MAX_JSON_DEPTH} levels",
    ),
    "metadata-nested-under-the-recursion-limit": (
        b'{"__metadata__":' + nested(900) + b',"data":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}',
        f"nests more than {MAX_JSON_DEPTH} levels",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_safetensors_header_through_the_cli(crafted, case):
    header, needle = HOSTILE_HEADERS[case]
    data = (
        b""
        if case in ("empty-product-overflows", "empty-bytes-overflow", "dim-past-int64")
        else b"\0" * 4
        if case in ("dim-bool", "too-many-dims")
        else b"\0" * 32
    )
    url = _with_payload(crafted, header, data)
    line = error_line(cli("replay", url), NAME, "payload 'kl'", "safetensors", needle)
    assert len(line) < 600, line  # a 100,000-dimension shape is not echoed back


@pytest.mark.parametrize(
    "case", ["dim-infinite", "empty-product-overflows", "metadata-nested-past-the-recursion-limit", "offset-infinite"]
)
def test_hostile_safetensors_header_on_the_ranged_read_path(crafted, case):
    """Reading some rows parses the header from a ranged read: the same checks, the same errors."""
    header, needle = HOSTILE_HEADERS[case]
    url = _with_payload(crafted, header, b"" if case == "empty-product-overflows" else b"\0" * 32)
    reader = BundleReader.open(url)
    with pytest.raises(BundleError) as info:
        reader.load_payload("kl", samples=[0])
    assert "\n" not in str(info.value) and "payload 'kl'" in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("shape", [[0, 1 << 62], [0, 1 << 61], [1 << 61, 0, 2]])
def test_empty_tensor_whose_bytes_pass_the_bound_is_invalid_in_validate(crafted, shape):
    """An empty float32 tensor of 2^61 or more columns has no byte to read, yet numpy cannot describe it: validate
    (which decodes with numpy) reports the payload invalid in one line instead of failing with a ValueError."""
    header = json.dumps({"data": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    url = _with_payload(crafted, header, b"")
    result = cli("validate", url)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and "INVALID" in result.stdout, result.output
    (line,) = [line for line in result.stdout.splitlines() if "problem:" in line]
    assert "payload 'kl'" in line and "too large" in line, line


# ---- documents ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["manifest", "index", "expected"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 900, 100_000])
def test_deeply_nested_document_is_refused(crafted, label, depth):
    """`depth` levels under the document's own: one past the bound, under Python's recursion limit, far past it."""
    data = compact_json(crafted.original[label])[:-1] + b',"deep":' + nested(depth) + b"}"
    url = crafted.commit(raw={label: data})
    error_line(cli("replay", url), f"{NAME}: {label}:", f"nested more than {MAX_JSON_DEPTH} levels deep")
    error_line(cli("inspect", url), f"{NAME}: {label}:", "nested")


def test_nesting_up_to_the_bound_is_accepted(crafted):
    expected = crafted.doc("expected")
    value: object = 1
    for _ in range(MAX_JSON_DEPTH - 1):  # the document itself is the first level
        value = [value]
    expected["deep"] = value
    url = crafted.commit(expected=expected)
    assert not nesting_exceeds(compact_json(expected))
    with pytest.warns(SchemaWarning, match="unknown field 'deep'"):
        assert BundleReader.open(url).expected["deep"] == value


@pytest.mark.parametrize(
    "text, deep",
    [
        (b'{"a":"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', False),
        (b'{"a":"\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\\"}', False),
        (b'{"a\\\\":' + nested(70) + b"}", True),
        (b'{"a":"\\\\\\"","b":' + nested(70) + b"}", True),
        (b"[" + b"[]," * 10_000 + b"[]]", False),
    ],
)
def test_nesting_scan_skips_strings_and_escapes(text, deep):
    assert nesting_exceeds(text, 64) is deep
    json.loads(text)  # every case is valid JSON


def test_unknown_fields_of_documents_read_from_bytes_warn_and_are_dropped(crafted):
    """The manifest and index are validated straight from their bytes: an unknown field of a record, of a nested
    model and of the document itself each warns once, naming the model, and is not kept."""
    index = crafted.doc("index")
    index["samples"][1]["sampling_seed"] = 7
    index["identity"]["actor_step_id"]["attempt"] = 2  # a frozen model
    index["written_by"] = "newer"
    manifest = crafted.doc("manifest")
    manifest["producer"]["host"] = "node-3"
    url = crafted.commit(index=index, manifest=manifest)
    with pytest.warns(SchemaWarning) as seen:
        reader = BundleReader.open(url)
    assert sorted(str(w.message) for w in seen) == [
        "ActorStepId: unknown field 'attempt' ignored",
        "BundleIndex: unknown field 'written_by' ignored",
        "ProducerInfo: unknown field 'host' ignored",
        "SampleRecord: unknown field 'sampling_seed' ignored",
    ]
    assert "sampling_seed" not in reader.index.samples[1].model_dump()
    assert "written_by" not in reader.index.model_dump()
    step = crafted.original["index"]["identity"]["actor_step_id"]
    assert reader.index.identity.actor_step_id.model_dump() == step
    assert [s.sample_id for s in reader.index.samples] == [s["sample_id"] for s in crafted.original["index"]["samples"]]


def test_documents_read_from_bytes_equal_those_read_the_python_way(crafted):
    """Validating from bytes gives the same models as parsing the JSON first, NaN and all."""
    index = crafted.doc("index")
    index["samples"][0]["raw_reward"] = float("nan")
    url = crafted.commit(index=index)
    reader = BundleReader.open(url)
    text = crafted.store.get(reader.documents.index.blob_ref())
    slow = BundleIndex.model_validate(json.loads(bytes(text)))
    assert reader.index.model_dump_json() == slow.model_dump_json()
    assert reader.index.samples[0].raw_reward != reader.index.samples[0].raw_reward  # NaN survives


def test_document_over_the_size_bound_is_refused_before_it_is_read(crafted, monkeypatch):
    expected = crafted.doc("expected")
    expected["padding"] = "x" * 5000
    url = crafted.commit(expected=expected)
    with pytest.warns(SchemaWarning, match="unknown field 'padding'"):
        ref = BundleReader.open(url).documents.expected
    for chunk in crafted.store.record(ref.digest).chunks:  # reading it now would fail with a missing chunk
        crafted.store.backend.delete(object_key(chunk.digest))
    monkeypatch.setenv(MAX_DOCUMENT_BYTES_ENV, "4096")
    assert max_document_bytes() == 4096
    error_line(
        cli("replay", url),
        f"{NAME}: expected:",
        f"document of {ref.size} bytes",
        "over the 4096-byte bound",
        MAX_DOCUMENT_BYTES_ENV,
    )
    error_line(cli("inspect", url), f"{NAME}: expected:", "over the 4096-byte bound")


def test_size_bound_default_and_bad_setting(crafted, monkeypatch):
    monkeypatch.delenv(MAX_DOCUMENT_BYTES_ENV, raising=False)
    assert max_document_bytes() == DEFAULT_MAX_DOCUMENT_BYTES == 256 << 20
    for bad in ("lots", "0", "-5"):
        monkeypatch.setenv(MAX_DOCUMENT_BYTES_ENV, bad)
        result = cli("replay", crafted.url)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert result.stderr.strip().count("\n") == 0 and MAX_DOCUMENT_BYTES_ENV in result.stderr


def test_v1_document_over_the_size_bound_is_refused(tmp_path, monkeypatch):
    case = canonical_case(buggy=False)
    bundle = tmp_path / "b-1"
    write_v1_bundle(bundle, case.manifest, case.index, case.expected, case.payloads)
    bound = (bundle / "COMPLETE").stat().st_size  # COMPLETE is read first and passes
    first = next(
        name for name in ("manifest.json", "index.json", "expected.json") if (bundle / name).stat().st_size > bound
    )
    monkeypatch.setenv(MAX_DOCUMENT_BYTES_ENV, str(bound))
    error_line(
        cli("replay", str(bundle)),
        f"b-1/{first}",
        f"document of {(bundle / first).stat().st_size} bytes",
        f"{bound}-byte bound",
    )


def test_large_document_under_the_bound_costs_little(crafted):
    """The nesting scan runs on every document: on a few MB of ordinary JSON it costs less than parsing it, which
    every document is anyway (each the best of three, taken in turns, so the host's load weighs on both alike)."""
    expected = crafted.doc("expected")
    expected["bulk"] = [{"id": f"s-{i}", "v": [i * 0.5] * 20, "t": 'a "quoted" [text]'} for i in range(40_000)]
    data = compact_json(expected)
    scan, parse = [], []
    for _ in range(3):
        start = time.perf_counter()
        assert not nesting_exceeds(data)
        scan.append(time.perf_counter() - start)
        start = time.perf_counter()
        json.loads(data)
        parse.append(time.perf_counter() - start)
    assert min(scan) < min(parse), (len(data), scan, parse)


# ---- markers ------------------------------------------------------------------------------------------


def _complete(crafted: Crafted) -> dict:
    return json.loads(crafted.store.backend.read(complete_key(NAME)))


def _write_marker(crafted: Crafted, key: str, marker: dict) -> None:
    crafted.store.backend.write(key, compact_json(marker))


def _multi_rank(crafted: Crafted, shards: dict | None = None) -> dict:
    marker = _complete(crafted)
    docs = marker["shards"]["0"]
    marker.update(multi_rank=True, expected_ranks=[0, 1], shards=shards or {"0": docs, "1": docs})
    return marker


@pytest.mark.parametrize("key", ["../../x", "rank-0", "-1", "01", "1.0", " 1", "99999999999"])
def test_non_integer_shard_key_makes_the_marker_corrupt(crafted, key):
    marker = _multi_rank(crafted)
    marker["shards"] = {"0": marker["shards"]["0"], key: marker["shards"]["0"]}
    _write_marker(crafted, complete_key(NAME), marker)
    rank0 = f"{crafted.url}/rank-0"
    for command in (("replay", rank0), ("inspect", crafted.url), ("validate", rank0)):
        result = cli(*command)
        text = (
            error_line(result, complete_key(NAME), "shards", "not a rank number")
            if result.stderr.strip()
            else result.stdout
        )
        assert "Traceback" not in result.output and result.exit_code == 1, result.output
        assert "shards" in text and "not a rank number" in text


@pytest.mark.parametrize(
    "anchor, needle",
    [
        (5, "anchor"),
        ("step 1:2", "anchor"),
        ({"actor_step_id": "x"}, "actor_step_id"),
        ({"actor_step_id": {"rollout_id": "x", "step_id": 0}}, "actor_step_id.rollout_id"),
        ({"actor_step_id": {"rollout_id": 1}}, "actor_step_id.step_id"),
        ({"actor_step_id": {"rollout_id": 1, "step_id": 2.5}}, "actor_step_id.step_id"),
        ({"rollout_id": "7"}, "rollout_id"),
        ({"rollout_id": [7]}, "rollout_id"),
        ({"rollout_id": True}, "rollout_id"),
        ({"rollout_id": 2**70}, "rollout_id"),
        ({}, "exactly one"),
        ({"rollout_id": 7, "actor_step_id": {"rollout_id": 7, "step_id": 0}}, "exactly one"),
    ],
    ids=lambda v: json.dumps(v)[:40] if not isinstance(v, str) else v,
)
def test_anchor_of_the_wrong_type_makes_the_marker_corrupt(crafted, anchor, needle):
    marker = _complete(crafted)
    marker["anchor"] = anchor
    _write_marker(crafted, complete_key(NAME), marker)
    root = crafted.url.rsplit("/", 1)[0]
    error_line(cli("replay", crafted.url), complete_key(NAME), "field 'anchor'", needle)
    error_line(cli("replay", root, "--rollout", "7"), NAME, "field 'anchor'", needle)
    listing = cli("ls", root, "--json")
    assert listing.exit_code == 0 and listing.exception is None, listing.output
    (row,) = json.loads(listing.stdout)["bundles"]
    assert row["status"] == "corrupt" and "field 'anchor'" in row["detail"] and needle in row["detail"]


def test_marker_listing_too_many_ranks_is_corrupt(crafted):
    marker = _complete(crafted)
    marker["expected_ranks"] = list(range(MAX_RANKS + 1))
    _write_marker(crafted, complete_key(NAME), marker)
    error_line(cli("replay", crafted.url), complete_key(NAME), "expected_ranks", f"bound of {MAX_RANKS}")


def test_rank_marker_listing_too_many_ranks_is_corrupt(crafted):
    """Without the bound a reader would look for 100,001 rank markers, one request each."""
    complete = _complete(crafted)
    crafted.store.backend.delete(complete_key(NAME))
    rank = {
        "format": "trajectory-replay.rank/1",
        "bundle_id": complete["bundle_id"],
        "rank": 0,
        "anchor": complete["anchor"],
        "expected_ranks": list(range(100_001)),
        "documents": complete["shards"]["0"],
        "attempt": "a",
    }
    # the same marker with its anchor wrong as well: read and refused without a look for any other marker
    _write_marker(crafted, rank_key(NAME, 0), dict(rank, anchor=5))
    start = time.perf_counter()
    error_line(cli("replay", f"{crafted.url}/rank-0"), rank_key(NAME, 0), "field 'anchor'")
    baseline = time.perf_counter() - start
    _write_marker(crafted, rank_key(NAME, 0), rank)
    start = time.perf_counter()
    error_line(cli("replay", f"{crafted.url}/rank-0"), rank_key(NAME, 0), "expected_ranks", f"bound of {MAX_RANKS}")
    elapsed = time.perf_counter() - start
    assert elapsed < 3 * baseline, (elapsed, baseline)  # not 100,001 more lookups


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("digest", "blake3:zz", "shards.0.index.digest"),
        ("record", "../../etc/passwd", "shards.0.index.record"),
        ("size", -1, "shards.0.index.size"),
    ],
)
def test_unparsable_document_reference_makes_the_marker_corrupt(crafted, field, value, needle):
    marker = _complete(crafted)
    marker["shards"]["0"]["index"][field] = value
    _write_marker(crafted, complete_key(NAME), marker)
    error_line(cli("replay", crafted.url), complete_key(NAME), needle)


def test_deeply_nested_marker_is_corrupt(crafted):
    crafted.store.backend.write(complete_key(NAME), b'{"anchor":' + nested(MAX_JSON_DEPTH + 1) + b"}")
    error_line(cli("replay", crafted.url), complete_key(NAME), "nested more than")


# ---- blob records ---------------------------------------------------------------------------------------


def test_deeply_nested_record_under_its_digest_is_corrupt_in_ls(crafted):
    """A record is JSON too; the walk bounds it before parsing (objects under their real digest)."""
    record = nested(100_000)
    digest = hash_bytes(record)
    crafted.store.backend.write(object_key(digest), record)
    marker = _complete(crafted)
    marker["shards"]["0"]["index"]["record"] = digest
    _write_marker(crafted, complete_key(NAME), marker)
    listing = cli("ls", crafted.url.rsplit("/", 1)[0], "--json")
    assert listing.exit_code == 0 and listing.exception is None, listing.output
    (row,) = json.loads(listing.stdout)["bundles"]
    assert row["status"] == "corrupt" and digest in row["detail"] and "nested more than" in row["detail"]


def _record_object(crafted: Crafted, kind: str) -> str:
    """The digest of a stored object that is not a blob record: a document, a payload chunk, other JSON."""
    if kind == "document":
        return crafted.docs.index.digest
    if kind == "chunk":
        return crafted.chunk_digests("advantages")[0]
    return crafted.store.put_object({"json-list": b"[1,2]", "json-number": b"7"}[kind])


@pytest.mark.parametrize("kind", ["document", "chunk", "json-list", "json-number"])
@pytest.mark.parametrize("command", ["validate", "inspect", "replay", "export"])
def test_manifest_record_naming_an_object_that_is_not_a_record(crafted, tmp_path, kind, command):
    """A payload's `record` names a stored object of another kind: every command names the payload and the
    object in one line (validate and inspect in their reports), exit 1, no traceback."""
    digest = _record_object(crafted, kind)
    manifest = crafted.doc("manifest")
    manifest["payloads"]["kl"]["record"] = digest
    url = crafted.commit(manifest=manifest)
    args = [command, url] + ([str(tmp_path / "exported")] if command == "export" else [])
    result = cli(*args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    if command == "inspect":
        (line,) = [line for line in result.stdout.splitlines() if line.strip().startswith("payload    kl ")]
        assert "UNREADABLE" in line and digest.split(":")[1] in line and "not a blob record" in line, line
    elif command == "validate":
        (line,) = [line for line in result.stdout.splitlines() if "problem:" in line]
        assert "payload 'kl'" in line and digest in line and "not a blob record" in line, result.stdout
    else:
        error_line(result, NAME, "payload 'kl'", digest, "not a blob record")
