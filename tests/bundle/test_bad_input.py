"""Bad input to the native bundle reader and writer: every refusal is a project error with a one-line message.

Content addressing means a damaged document cannot be produced by flipping bytes of a stored object
(the reader would report an integrity error first). A "truncated document" is therefore a COMPLETE
marker pointing at a *stored, correctly addressed* blob whose content is truncated, not JSON, not an
object or missing a field. Such bundles are crafted here with `store.put` and a hand-written COMPLETE.

Each test checks the error type and that the message is one line naming what is wrong and where; a
representative subset also runs the CLI (exit 1, one-line error or the validate report, nothing escaping).
Three scenarios also run against the S3 test server.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from trajectory_replay.bundle import BundleReader, BundleWriter, open_native
from trajectory_replay.bundle.codec import encode
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import CompleteMarker, DocRef, Documents, complete_key
from trajectory_replay.cli import app
from trajectory_replay.errors import (
    BundleError,
    IntegrityError,
    NotFoundError,
)
from trajectory_replay.replay.fixtures import canonical_case
from trajectory_replay.replay.validate import validate_sources
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.digest import object_key

NAME = "b-00001"
DOCS = ("manifest", "index", "expected")
runner = CliRunner()


# ---- helpers ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """A read cache per test: content addressing gives every canonical bundle the same digests, so a
    shared cache could serve an intact chunk that a test deliberately damaged or deleted on S3."""
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "read-cache"))


def write_bundle(
    root: str,
    storage_options: dict | None = None,
    *,
    current_logprob: float = 0.0,
    expected: dict | None = None,
    rank: int | None = None,
    expected_ranks: list[int] | None = None,
    finalize: bool = True,
):
    """Write the canonical bundle at `<root>/b-00001`; returns (url, writer, final marker or None)."""
    case = canonical_case(buggy=False, current_logprob=current_logprob)
    kwargs: dict[str, Any] = dict(storage_options or {})
    if rank is not None:
        kwargs.update(rank=rank, expected_ranks=expected_ranks)
    writer = BundleWriter(
        f"{root}/{NAME}", case.manifest, case.index, case.expected if expected is None else expected, **kwargs
    )
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    marker = writer.finalize() if finalize else None
    return f"{root}/{NAME}", writer, marker


class Crafted:
    """A stored canonical bundle whose COMPLETE can be replaced by one pointing at crafted documents."""

    def __init__(self, root: str, storage_options: dict | None = None) -> None:
        self.url, writer, marker = write_bundle(root, storage_options)
        self.store: ObjectStore = writer.store
        self.marker: CompleteMarker = marker
        self.docs = marker.documents()
        self.original = {label: json.loads(self.store.get(getattr(self.docs, label).blob_ref())) for label in DOCS}

    def doc(self, label: str) -> dict:
        """A deep copy of one of the bundle's documents, to mutate."""
        return json.loads(json.dumps(self.original[label]))

    def commit(
        self, *, name: str = NAME, bundle_id: str | None = None, raw: dict[str, bytes] | None = None, **documents: Any
    ) -> str:
        """Store the given documents (dicts, or raw bytes through `raw`) and point `<name>/COMPLETE` at them."""
        raw = raw or {}
        refs = {}
        for label in DOCS:
            if label in raw:
                refs[label] = DocRef.of(self.store.put(raw[label]))
            elif label in documents:
                refs[label] = DocRef.of(self.store.put(compact_json(documents[label])))
            else:
                refs[label] = getattr(self.docs, label)
        marker = CompleteMarker(
            bundle_id=bundle_id or self.marker.bundle_id,
            anchor=self.marker.anchor,
            expected_ranks=[0],
            multi_rank=False,
            shards={"0": Documents(**refs)},
        )
        self.store.backend.write(complete_key(name), compact_json(marker.model_dump(mode="json")))
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def payload(self, name: str) -> dict:
        return self.original["manifest"]["payloads"][name]

    def chunk_digests(self, payload: str) -> list[str]:
        spec = self.payload(payload)
        record = self.store.record(spec["digest"])
        return [c.digest for c in record.chunks]


def assert_one_line(exc: BaseException, *needles: str) -> str:
    text = str(exc)
    assert "\n" not in text, f"multi-line message: {text!r}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    return text


def load_all(url: str, storage_options: dict | None = None, *, rows: bool = False) -> None:
    """Open the bundle and load every payload, whole or (with `rows`) sample by sample."""
    for reader in open_native(url, **(storage_options or {})):
        for payload in reader.manifest.payloads:
            if rows:
                reader.load_payload(payload, samples=list(range(len(reader.index.samples))))
            else:
                reader.load_payload(payload)


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> CliRun:
    """The command line in this process (a process per call would cost a torch import each; the real process
    boundary is tested in tests/cli): its exit code and streams, with nothing escaping but the exit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return CliRun(result.exit_code, result.stdout, result.stderr)


def assert_cli_error(proc: CliRun, *needles: str) -> None:
    """Exit 1, no traceback, and either a one-line `trajectory-replay: error:` or a validate report naming it."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both
    assert proc.returncode == 1, both
    if proc.stderr.strip():
        lines = [
            line
            for line in proc.stderr.splitlines()
            if line.strip()
            and not line.startswith("trajectory-replay: warning:")
            and not line.startswith("trajectory-replay: WARNING:")
        ]
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("trajectory-replay: error:"), proc.stderr
        shown = lines[0]
    else:
        assert "INVALID" in proc.stdout, proc.stdout
        problems = [line for line in proc.stdout.splitlines() if line.strip().startswith("problem:")]
        assert problems, proc.stdout
        shown = "\n".join(problems)
    for needle in needles:
        assert needle in shown, f"{needle!r} not in {shown!r}"


@pytest.fixture
def crafted(tmp_path) -> Crafted:
    return Crafted(str(tmp_path / "store"))


# ---- documents that are not what they claim ---------------------------------------------------------


@pytest.mark.parametrize("label", DOCS)
def test_truncated_document(crafted, label):
    data = compact_json(crafted.original[label])
    url = crafted.commit(raw={label: data[: len(data) // 2]})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: {label}:", "not valid JSON")


@pytest.mark.parametrize("label", DOCS)
@pytest.mark.parametrize(
    "data, needle",
    [(b"this is not json", "not valid JSON"), (b"\xff\xfe\x00garbage", "not UTF-8"), (b"", "not valid JSON")],
    ids=["text", "binary", "empty"],
)
def test_non_json_document(crafted, label, data, needle):
    url = crafted.commit(raw={label: data})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: {label}:", needle)


@pytest.mark.parametrize("label", DOCS)
@pytest.mark.parametrize(
    "data, kind", [(b"[1,2,3]", "list"), (b"42", "int"), (b'"manifest"', "str"), (b"null", "NoneType")]
)
def test_document_is_json_but_not_an_object(crafted, label, data, kind):
    url = crafted.commit(raw={label: data})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: {label}:", "expected a JSON object", kind)


@pytest.mark.parametrize("label", DOCS)
def test_document_with_an_integer_literal_too_long_to_convert(crafted, label):
    """Python refuses int literals over 4300 digits with a plain ValueError: still a bad document."""
    data = compact_json(crafted.original[label])[:-1] + b',"x":' + b"7" * 5000 + b"}"
    url = crafted.commit(raw={label: data})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: {label}:")


def _delete(doc: dict, path: tuple) -> None:
    for part in path[:-1]:
        doc = doc[part]
    del doc[path[-1]]


@pytest.mark.parametrize(
    "label, path",
    [
        ("manifest", ("bundle_id",)),
        ("manifest", ("payloads", "kl", "dtype")),
        ("index", ("bundle_id",)),
        ("index", ("identity",)),
        ("index", ("samples",)),
        ("index", ("samples", 0, "response_length")),
        ("index", ("samples", 3, "sample_id")),
        ("expected", ("reward.raw", "raw_rewards")),
    ],
    ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_missing_required_field(crafted, label, path):
    doc = crafted.doc(label)
    _delete(doc, path)
    url = crafted.commit(**{label: doc})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: {label}:", f"missing required field '{'.'.join(map(str, path))}'")


@pytest.mark.parametrize(
    "label, path, value, needle",
    [
        ("manifest", ["payloads", "kl", "shape"], "eight", "payloads.kl.shape"),
        ("manifest", ["format_version"], "2.0.0", "format_version"),
        ("index", ["samples", 1, "raw_reward"], "high", "samples.1.raw_reward"),
        ("index", ["identity", "actor_step_id"], None, "identity"),
        ("expected", ["loss.policy", "loss"], [1, 2], "loss.policy.loss"),
    ],
)
def test_field_of_the_wrong_type(crafted, label, path, value, needle):
    doc = crafted.doc(label)
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    url = crafted.commit(**{label: doc})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: {label}:", needle)


def test_missing_field_under_a_key_with_a_newline_is_reported_on_one_line(crafted):
    """Dict keys are data: a key holding a newline must not split the message."""
    manifest = crafted.doc("manifest")
    manifest["payloads"]["evil\nkey"] = {"name": "evil"}
    url = crafted.commit(manifest=manifest)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: manifest:", "missing required field")


def test_bad_documents_through_the_cli(crafted):
    index = crafted.doc("index")
    del index["samples"][0]["response_length"]
    url = crafted.commit(index=index)
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, url), "index", "samples.0.response_length")
    url = crafted.commit(raw={"manifest": compact_json(crafted.original["manifest"])[:100]})
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, url), "manifest", "not valid JSON")


def test_overlong_integer_through_the_cli(crafted):
    data = compact_json(crafted.original["expected"])[:-1] + b',"x":' + b"7" * 5000 + b"}"
    url = crafted.commit(raw={"expected": data})
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, url), "expected")


# ---- bundle ids -------------------------------------------------------------------------------------


def test_writer_refuses_bundle_id_differing_between_manifest_and_index(tmp_path):
    case = canonical_case(buggy=False)
    index = case.index.model_copy(update={"bundle_id": "b-99999"})
    with pytest.raises(BundleError) as info:
        BundleWriter(f"{tmp_path}/{NAME}", case.manifest, index, case.expected)
    assert_one_line(info.value, "bundle_id differs", "'b-00001'", "'b-99999'")
    with pytest.raises(BundleError) as info:
        BundleWriter(
            f"{tmp_path}/{NAME}", case.manifest.model_dump(mode="json"), index.model_dump(mode="json"), case.expected
        )
    assert_one_line(info.value, "bundle_id differs", "'b-99999'")


@pytest.mark.parametrize("label", ["manifest", "index"])
def test_reader_refuses_bundle_id_differing_between_documents(crafted, label):
    doc = crafted.doc(label)
    doc["bundle_id"] = "b-99999"
    url = crafted.commit(**{label: doc})
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, NAME, "'b-99999'", f"in the {label}", "differs")


def test_reader_refuses_bundle_id_mismatch_through_the_cli(crafted):
    index = crafted.doc("index")
    index["bundle_id"] = "b-99999"
    url = crafted.commit(index=index)
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, url), "b-99999", "index")


# ---- payloads that do not match the manifest ------------------------------------------------------

PAYLOAD_MISMATCHES = {
    "dtype": (lambda c, p: p.update(dtype="torch.int32"), BundleError, ["dtype", "torch.int32"]),
    "dtype-float64": (lambda c, p: p.update(dtype="torch.float64"), BundleError, ["dtype", "torch.float64"]),
    "shape": (lambda c, p: p.update(shape=[9]), BundleError, ["shape", "[9]"]),
    "shape-2d": (lambda c, p: p.update(shape=[2, 4]), BundleError, ["shape", "[2, 4]"]),
    "size": (lambda c, p: p.update(size=p["size"] + 1), IntegrityError, [str(105)]),
    "size-zero": (lambda c, p: p.update(size=0), IntegrityError, ["0"]),
    "digest-of-another-blob": (lambda c, p: p.update(digest=c.payload("entropy")["digest"]), IntegrityError, [""]),
    "another-blob-whole-ref": (
        lambda c, p: p.update({k: c.payload("loss_mask")[k] for k in ("digest", "record", "size")}),
        BundleError,
        ["dtype", "torch.uint8"],
    ),
    "digest-never-stored": (lambda c, p: p.update(digest="blake3:" + "ab" * 32), IntegrityError, [""]),
    "no-digest": (lambda c, p: p.update(digest=None), BundleError, ["no digest"]),
}


@pytest.mark.parametrize("rows", [False, True], ids=["whole", "rows"])
@pytest.mark.parametrize("case", sorted(PAYLOAD_MISMATCHES))
def test_payload_not_matching_the_manifest(crafted, case, rows):
    mutate, error, needles = PAYLOAD_MISMATCHES[case]
    manifest = crafted.doc("manifest")
    mutate(crafted, manifest["payloads"]["kl"])
    url = crafted.commit(manifest=manifest)
    reader = BundleReader.open(url)  # the manifest itself is well-formed
    with pytest.raises(error) as info:
        if rows:
            reader.load_payload("kl", samples=[0, 2])
        else:
            reader.load_payload("kl")
    assert_one_line(info.value, NAME, "payload 'kl'", *needles)
    # the other payloads are unaffected
    assert reader.load_payload("entropy").tolist() == [0.5] * 8


def test_unknown_payload_dtype_refused_when_the_manifest_is_read(crafted):
    manifest = crafted.doc("manifest")
    manifest["payloads"]["kl"]["dtype"] = "torch.complex64"
    url = crafted.commit(manifest=manifest)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, NAME, "manifest", "payloads.kl.dtype", "torch.complex64")


def test_payload_mismatch_through_validate(crafted):
    manifest = crafted.doc("manifest")
    manifest["payloads"]["kl"]["shape"] = [9]
    manifest["payloads"]["entropy"]["size"] += 1
    url = crafted.commit(manifest=manifest)
    report = validate_sources(url, open_native(url))
    assert not report.valid
    assert len(report.problems) == 3, report.problems
    assert all("\n" not in p for p in report.problems)
    assert any("payload 'kl'" in p and "shape" in p for p in report.problems)
    assert any("payload 'kl' has 9 elements, the responses have 8 tokens" in p for p in report.problems)
    assert any("payload 'entropy'" in p for p in report.problems)
    assert_cli_error(cli("validate", url), "payload 'kl'", "shape")
    assert_cli_error(cli("replay", url))


def _seven_rows_of_kl(crafted: Crafted) -> dict:
    """A manifest whose per-token payload 'kl' is a well-formed blob of 7 rows, for 8 response tokens."""
    ref = crafted.store.put(encode(torch.zeros(7))[0])
    manifest = crafted.doc("manifest")
    manifest["payloads"]["kl"].update(digest=ref.digest, record=ref.record, size=ref.size, shape=[7])
    return manifest


def _sample_field(crafted: Crafted, field: str, value: Any) -> dict:
    index = crafted.doc("index")
    index["samples"][0][field] = value
    return index


STRUCTURE_FAULTS = {
    "payload-rows": (
        lambda c: {"manifest": _seven_rows_of_kl(c)},
        "payload 'kl' has 7 elements, the responses have 8 tokens",
    ),
    "negative-response-length": (
        lambda c: {"index": _sample_field(c, "response_length", -5)},
        "sample s-0: response_length -5",
    ),
    "total-below-response": (
        lambda c: {"index": _sample_field(c, "total_length", 1)},
        "sample s-0: response_length 2, total_length 1",
    ),
    "duplicate-ids": (lambda c: {"index": _sample_field(c, "sample_id", "s-1")}, "duplicate sample ids: s-1"),
}


@pytest.mark.parametrize("case", sorted(STRUCTURE_FAULTS))
def test_validate_reports_what_the_sample_stage_fails(crafted, case):
    """A bundle validate passes must not diverge at `sample` when replayed: validate reports the same fault,
    naming the sample or payload, and replay's sample stage fails on it."""
    documents, needle = STRUCTURE_FAULTS[case]
    url = crafted.commit(**documents(crafted))
    report = validate_sources(url, open_native(url))
    assert not report.valid and any(needle in p for p in report.problems), report.problems
    assert all("\n" not in p for p in report.problems)
    assert_cli_error(cli("validate", url), needle)
    replayed = cli("replay", url, "--json")
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    (sample,) = [s for s in json.loads(replayed.stdout)["stages"] if s["stage"] == "sample"]
    assert sample["status"] == "fail" and needle in sample["message"], sample


def test_payload_name_key_differing_from_its_spec_name_is_refused(crafted):
    manifest = crafted.doc("manifest")
    manifest["payloads"]["other"] = dict(manifest["payloads"]["kl"])  # spec says name "kl"
    url = crafted.commit(manifest=manifest)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: manifest:", "other")


# ---- storage damage ------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [False, True], ids=["whole", "rows"])
def test_missing_payload_chunk(crafted, rows):
    chunk = crafted.chunk_digests("kl")[0]
    crafted.store.backend.delete(object_key(chunk))
    reader = BundleReader.open(crafted.url)
    with pytest.raises(NotFoundError) as info:
        reader.load_payload("kl", samples=[1] if rows else None)
    assert_one_line(info.value, NAME, "payload 'kl'", "missing", chunk.removeprefix("blake3:"))


def test_missing_payload_record(crafted):
    record = crafted.payload("kl")["record"]
    crafted.store.backend.delete(object_key(record))
    report = validate_sources(crafted.url, [BundleReader.open(crafted.url)])
    assert len(report.problems) == 1 and "payload 'kl'" in report.problems[0], report.problems
    for samples in (None, [1]):  # whole, then the ranged-read path
        with pytest.raises(NotFoundError) as info:
            BundleReader.open(crafted.url).load_payload("kl", samples=samples)
        assert_one_line(info.value, NAME, "payload 'kl'", "missing", record.removeprefix("blake3:"))


@pytest.mark.parametrize("label", DOCS)
@pytest.mark.parametrize("what", ["chunk", "record"])
def test_missing_document_object(crafted, label, what):
    ref = getattr(crafted.docs, label)
    digest = ref.record if what == "record" else crafted.store.record(ref.digest).chunks[0].digest
    crafted.store.backend.delete(object_key(digest))
    with pytest.raises(NotFoundError) as info:
        BundleReader.open(crafted.url)
    assert_one_line(info.value, f"{NAME}: {label}:", "missing", digest.removeprefix("blake3:"))


def test_missing_chunk_through_the_cli(crafted):
    chunk = crafted.chunk_digests("advantages")[0]
    crafted.store.backend.delete(object_key(chunk))
    assert_cli_error(cli("validate", crafted.url), "payload 'advantages'", "missing")
    assert_cli_error(cli("replay", crafted.url), "missing")


def _flip_byte(store: ObjectStore, digest: str, position: int = -3) -> None:
    key = object_key(digest)
    data = bytearray(store.backend.read(key))
    data[position] ^= 0x01
    store.backend.write(key, bytes(data))


def _check_flipped(url: str, storage_options: dict | None = None) -> None:
    options = storage_options or {}
    report = validate_sources(url, open_native(url, **options))
    assert not report.valid
    assert len(report.problems) == 1 and "payload 'kl'" in report.problems[0], report.problems
    assert "\n" not in report.problems[0]
    with pytest.raises(IntegrityError) as info:
        BundleReader.open(url, **options).load_payload("kl")
    assert_one_line(info.value, NAME, "payload 'kl'")
    with pytest.raises(IntegrityError) as info:  # the ranged-read path
        BundleReader.open(url, **options).load_payload("kl", samples=[3])
    assert_one_line(info.value, NAME, "payload 'kl'")


def test_flipped_byte_in_a_payload_chunk(crafted):
    _flip_byte(crafted.store, crafted.chunk_digests("kl")[-1])
    assert_cli_error(cli("validate", crafted.url), "payload 'kl'")
    assert_cli_error(cli("replay", crafted.url), "kl")
    _check_flipped(crafted.url)


# ---- safetensors headers -------------------------------------------------------------------------


def _with_blob(crafted: Crafted, blob: bytes, *, dtype: str = "torch.float32", shape=(8,)) -> str:
    ref = crafted.store.put(blob)
    manifest = crafted.doc("manifest")
    manifest["payloads"]["kl"].update(
        digest=ref.digest, record=ref.record, size=ref.size, dtype=dtype, shape=list(shape)
    )
    return crafted.commit(manifest=manifest)


def _safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("rows", [False, True], ids=["whole", "rows"])
@pytest.mark.parametrize("length", [(1 << 20) + 1, 1 << 40, (1 << 64) - 1])
def test_safetensors_header_over_the_size_bound(crafted, length, rows):
    blob = struct.pack("<Q", length) + b'{"data":{}}' + b"\0" * 64
    url = _with_blob(crafted, blob)
    reader = BundleReader.open(url)
    with pytest.raises(BundleError) as info:
        reader.load_payload("kl", samples=[0] if rows else None)
    assert_one_line(info.value, NAME, "payload 'kl'", f"header of {length} bytes", "bound")


@pytest.mark.parametrize("rows", [False, True], ids=["whole", "rows"])
@pytest.mark.parametrize(
    "header, data, needle",
    [
        ({"data": {"dtype": "F32", "shape": [8], "data_offsets": [4, 36]}}, 36, "offsets [4, 36)"),
        ({"data": {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}}, 32, "offsets [0, 16)"),
        ({"data": {"dtype": "F32", "shape": [8], "data_offsets": [0, 64]}}, 32, "offsets [0, 64)"),
        ({"data": {"dtype": "F32", "shape": [8], "data_offsets": [16, 0]}}, 32, "offsets [16, 0)"),
        (
            {
                "data": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                "more": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
            },
            32,
            "exactly one tensor",
        ),
        ({"data": {"dtype": "F32", "shape": [8]}}, 32, "malformed tensor entry"),
        ({"data": {"dtype": "X99", "shape": [8], "data_offsets": [0, 32]}}, 32, "malformed tensor entry"),
        ({"data": {"dtype": "F32", "shape": [-8], "data_offsets": [0, 32]}}, 32, "negative dimension"),
    ],
    ids=["shifted", "short", "past-end", "reversed", "two-overlapping", "no-offsets", "bad-dtype", "negative"],
)
def test_safetensors_header_with_inconsistent_offsets(crafted, header, data, needle, rows):
    url = _with_blob(crafted, _safetensors(header, b"\0" * data))
    reader = BundleReader.open(url)
    with pytest.raises(BundleError) as info:
        reader.load_payload("kl", samples=[0] if rows else None)
    assert_one_line(info.value, NAME, "payload 'kl'", needle)


@pytest.mark.parametrize(
    "blob, needle",
    [
        (b"\x05\x00", "only 2 bytes"),
        (struct.pack("<Q", 100) + b'{"data"', "truncated"),
        (struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc" + b"\0" * 32, "not JSON"),
        (struct.pack("<Q", 2) + b"[]" + b"\0" * 32, "not an object"),
    ],
    ids=["tiny", "truncated", "binary", "list"],
)
def test_safetensors_blob_that_is_not_one(crafted, blob, needle):
    url = _with_blob(crafted, blob)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url).load_payload("kl")
    assert_one_line(info.value, NAME, "payload 'kl'", needle)


def test_bad_safetensors_header_through_the_cli(crafted):
    url = _with_blob(crafted, struct.pack("<Q", 1 << 30) + b"\0" * 64)
    assert_cli_error(cli("validate", url), "payload 'kl'", "bound")
    assert_cli_error(cli("replay", url), "payload 'kl'", "bound")


# ---- path traversal ------------------------------------------------------------------------------

TRAVERSALS = ["../x", "a/b", "..", "objects", ".hidden", "x/../../y"]


@pytest.mark.parametrize("bad", TRAVERSALS)
def test_writer_refuses_bad_bundle_id_in_documents(tmp_path, bad):
    case = canonical_case(buggy=False)
    manifest = case.manifest.model_dump(mode="json") | {"bundle_id": bad}
    index = case.index.model_dump(mode="json") | {"bundle_id": bad}
    with pytest.raises(BundleError) as info:
        BundleWriter(f"{tmp_path}/{NAME}", manifest, index, case.expected)
    assert_one_line(info.value, "bundle_id", repr(bad))


@pytest.mark.parametrize("bad", TRAVERSALS)
def test_writer_refuses_bad_bundle_id_in_unvalidated_models(tmp_path, bad):
    """A Manifest built with model_copy/model_construct skips validation; the writer still checks the name."""
    case = canonical_case(buggy=False)
    with pytest.raises(BundleError) as info:
        writer = BundleWriter(
            f"{tmp_path}/{NAME}",
            case.manifest.model_copy(update={"bundle_id": bad}),
            case.index.model_copy(update={"bundle_id": bad}),
            case.expected,
        )
        writer.finalize()
    assert_one_line(info.value, repr(bad))
    assert not (tmp_path / complete_key(NAME)).exists()


@pytest.mark.parametrize(
    "url",
    [
        "memory://tr-trav/..",
        "memory://tr-trav/.",
        "memory://tr-trav/objects",
        "memory://tr-trav/.inflight",
        "memory://tr-trav/a b",
    ],
)
def test_writer_refuses_bad_bundle_path(url):
    case = canonical_case(buggy=False)
    with pytest.raises(BundleError) as info:
        BundleWriter(url, case.manifest, case.index, case.expected)
    assert_one_line(info.value, "bundle id")


@pytest.mark.parametrize("bad", TRAVERSALS + ["", "loss_mask"])
def test_writer_refuses_bad_payload_name(tmp_path, bad):
    case = canonical_case(buggy=False)
    writer = BundleWriter(f"{tmp_path}/{NAME}", case.manifest, case.index, case.expected)
    with pytest.raises(BundleError) as info:
        writer.write_payload(bad, case.payloads["kl"])
    assert_one_line(info.value, repr(bad))


@pytest.mark.parametrize("bad", ["../x", "a/b", ".."])
def test_reader_refuses_bad_payload_name(crafted, bad):
    manifest = crafted.doc("manifest")
    spec = manifest["payloads"].pop("kl")
    manifest["payloads"][bad] = dict(spec, name=bad)
    url = crafted.commit(manifest=manifest)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: manifest:", repr(bad))


@pytest.mark.parametrize("bad", ["../x", "a/b", ".."])
def test_reader_refuses_bad_payload_key(crafted, bad):
    """The manifest key is the name load_payload uses: it must be checked even when the spec's name is fine."""
    manifest = crafted.doc("manifest")
    manifest["payloads"][bad] = manifest["payloads"].pop("kl")
    url = crafted.commit(manifest=manifest)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, f"{NAME}: manifest:", repr(bad))


def test_reader_refuses_bad_bundle_id_in_stored_documents(crafted):
    manifest, index = crafted.doc("manifest"), crafted.doc("index")
    manifest["bundle_id"] = index["bundle_id"] = "../x"
    url = crafted.commit(name="evil", bundle_id="../x", manifest=manifest, index=index)
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, "evil: manifest:", "'../x'")


def test_bad_payload_name_through_the_cli(crafted):
    manifest = crafted.doc("manifest")
    spec = manifest["payloads"].pop("kl")
    manifest["payloads"]["../x"] = dict(spec, name="../x")
    url = crafted.commit(manifest=manifest)
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, url), "manifest", "'../x'")


# ---- completion ------------------------------------------------------------------------------------


def test_complete_missing(tmp_path):
    """The writer stored every payload and document, then died before COMPLETE."""
    url, writer, _ = write_bundle(str(tmp_path / "store"), finalize=False)
    writer._write_documents()  # what finalize does before the marker
    assert not writer.store.backend.exists(complete_key(NAME))
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, NAME, "incomplete", "COMPLETE")
    proc = cli("inspect", url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "incomplete" in proc.stdout and "COMPLETE is missing" in proc.stdout
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, url), "incomplete")


def test_rank_refused_until_every_rank_landed(tmp_path):
    root = str(tmp_path / "store")
    url, _, final = write_bundle(root, rank=0, expected_ranks=[0, 1])
    assert final is None
    with pytest.raises(BundleError) as info:
        BundleReader.open(f"{url}/rank-0")
    assert_one_line(info.value, f"{NAME}/rank-0", "missing ranks [1]")
    with pytest.raises(BundleError) as info:
        open_native(url)
    assert_one_line(info.value, NAME, "missing ranks [1]")
    proc = cli("inspect", url)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr
    assert "incomplete" in proc.stdout and "[1]" in proc.stdout
    for command in ("validate", "replay"):
        assert_cli_error(cli(command, f"{url}/rank-0"), "rank-0", "missing ranks [1]")

    _, _, final = write_bundle(root, rank=1, expected_ranks=[0, 1])
    assert final is not None and final.multi_rank
    reader = BundleReader.open(f"{url}/rank-0")
    assert reader.rank == 0 and reader.load_payload("kl").tolist() == [-0.25] * 8
    readers = open_native(url)
    assert [r.rank for r in readers] == [0, 1]
    with pytest.raises(BundleError) as info:
        BundleReader.open(url)
    assert_one_line(info.value, "rank-<r>")
    with pytest.raises(BundleError) as info:
        BundleReader.open(f"{url}/rank-2")
    assert_one_line(info.value, "no rank 2")


def test_second_writer_of_the_same_bundle(tmp_path):
    root = str(tmp_path / "store")
    url, _, first = write_bundle(root)
    _, _, again = write_bundle(root)  # identical content: a retry, accepted
    assert again.all_digests() == first.all_digests()
    with pytest.raises(BundleError) as info:
        write_bundle(root, current_logprob=0.5)
    assert_one_line(info.value, NAME, "already exists with different content")
    reader = BundleReader.open(url)
    assert reader.load_payload("log_probs").tolist() == [0.0] * 8  # the first bundle is untouched


def test_nan_and_wrong_length_expected_are_written_as_given(tmp_path):
    case = canonical_case(buggy=False)
    expected = json.loads(json.dumps(case.expected))
    expected["reward.raw"]["raw_rewards"] = [float("nan"), 3.0]  # NaN, and 2 values for 4 samples
    expected["reward.post_process"]["rewards"] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    expected["loss.policy"]["loss"] = float("nan")
    url, _, marker = write_bundle(str(tmp_path / "store"), expected=expected)
    assert marker is not None
    reader = BundleReader.open(url)
    raw = reader.expected["reward.raw"]["raw_rewards"]
    assert len(raw) == 2 and math.isnan(raw[0]) and raw[1] == 3.0
    assert len(reader.expected["reward.post_process"]["rewards"]) == 6
    assert math.isnan(reader.expected["loss.policy"]["loss"])
    load_all(url)
    proc = cli("validate", url)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "non-finite" in proc.stdout


def test_nan_payload_is_written_as_given(tmp_path):
    case = canonical_case(buggy=False)
    writer = BundleWriter(f"{tmp_path}/{NAME}", case.manifest, case.index, case.expected)
    for name, tensor in case.payloads.items():
        writer.write_payload(name, torch.full_like(tensor, float("nan")) if name == "kl" else tensor)
    writer.finalize()
    assert torch.isnan(BundleReader.open(f"{tmp_path}/{NAME}").load_payload("kl")).all()


# ---- S3 ------------------------------------------------------------------------------------------


@pytest.mark.s3
def test_s3_truncated_document(s3_root):
    url, options = s3_root
    crafted = Crafted(url, options)
    data = compact_json(crafted.original["index"])
    bundle = crafted.commit(raw={"index": data[:37]})
    with pytest.raises(BundleError) as info:
        BundleReader.open(bundle, **options)
    assert_one_line(info.value, f"{NAME}: index:", "not valid JSON")
    assert options["secret"] not in str(info.value)


@pytest.mark.s3
def test_s3_flipped_byte(s3_root):
    url, options = s3_root
    crafted = Crafted(url, options)
    _flip_byte(crafted.store, crafted.chunk_digests("kl")[-1])
    _check_flipped(crafted.url, options)


@pytest.mark.s3
def test_s3_missing_chunk(s3_root):
    url, options = s3_root
    crafted = Crafted(url, options)
    chunk = crafted.chunk_digests("entropy")[0]
    crafted.store.backend.delete(object_key(chunk))
    with pytest.raises(NotFoundError) as info:
        BundleReader.open(crafted.url, **options).load_payload("entropy")
    assert_one_line(info.value, NAME, "payload 'entropy'", "missing")


@pytest.mark.s3
def test_s3_rank_refused_until_every_rank_landed(s3_root):
    url, options = s3_root
    bundle, _, final = write_bundle(url, options, rank=0, expected_ranks=[0, 1])
    assert final is None
    with pytest.raises(BundleError) as info:
        BundleReader.open(f"{bundle}/rank-0", **options)
    assert_one_line(info.value, f"{NAME}/rank-0", "missing ranks [1]")
    write_bundle(url, options, rank=1, expected_ranks=[0, 1])
    assert [r.rank for r in open_native(bundle, **options)] == [0, 1]
    assert BundleReader.open(f"{bundle}/rank-1", **options).load_payload("kl", samples=[2]).tolist() == [-0.25] * 2


@pytest.mark.s3
def test_s3_second_writer_with_different_content(s3_root):
    url, options = s3_root
    write_bundle(url, options)
    write_bundle(url, options)
    with pytest.raises(BundleError) as info:
        write_bundle(url, options, current_logprob=0.5)
    assert_one_line(info.value, NAME, "already exists with different content")
    assert options["secret"] not in str(info.value)
