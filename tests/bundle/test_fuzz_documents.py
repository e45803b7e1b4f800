"""Fuzzing the three bundle documents: the reader either accepts a document or refuses it cleanly.

Valid manifest / index / expected documents of the canonical bundle are mutated (keys deleted,
values replaced by garbage of another type, garbage keys inserted, bytes truncated, spliced or
replaced), stored with `store.put` on a fresh memory:// store next to the canonical payloads, and
pointed at by a hand-written COMPLETE. Opening the bundle and loading every payload (whole, and
sample by sample through the ranged-read path) must either succeed or raise a
TrajectoryReplayError whose message is one line and names the offending document. A payload-level
error raised because of a manifest mutation names the payload (`payload 'kl'`): a payload entry is
part of the manifest. Nothing else (KeyError, TypeError, ValueError, ...) may escape the library.
"""

from __future__ import annotations

import functools
import json
import uuid
import warnings
from typing import Any

import fsspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trajectory_replay.bundle import BundleWriter, open_native
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import CompleteMarker, DocRef, Documents, complete_key
from trajectory_replay.errors import TrajectoryReplayError
from trajectory_replay.replay.fixtures import canonical_case
from trajectory_replay.store import ObjectStore

DOCS = ("manifest", "index", "expected")
NAME = "b-00001"


def _write_canonical(root: str) -> tuple[ObjectStore, CompleteMarker]:
    case = canonical_case(buggy=False)
    writer = BundleWriter(f"{root}/{NAME}", case.manifest, case.index, case.expected)
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    return writer.store, writer.finalize()


@functools.lru_cache(maxsize=1)
def base_documents() -> dict[str, dict]:
    """The canonical bundle's documents as JSON dicts (identical in every store: content addressing)."""
    root = f"memory://fuzz-base-{uuid.uuid4().hex}"
    store, marker = _write_canonical(root)
    docs = marker.documents()
    out = {label: json.loads(store.get(getattr(docs, label).blob_ref())) for label in DOCS}
    fsspec.filesystem("memory").rm("/" + root.removeprefix("memory://"), recursive=True)
    return out


def all_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (the root itself included as ())."""
    out = [prefix]
    if isinstance(value, dict):
        for key in sorted(value):
            out += all_paths(value[key], prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += all_paths(item, prefix + (i,))
    return out


SPECIAL_STRINGS = [
    "../x",
    "a/b",
    "..",
    "a\nb",
    "",
    " ",
    "\x00",
    "💥",
    "objects",
    "loss_mask",
    "kl",
    "name",
    "dtype",
    "shape",
    "size",
    "digest",
    "record",
    "bundle_id",
    "samples",
    "reward.raw",
    "torch.float32",
    "torch.complex64",
    "float32",
    "blake3:" + "0" * 64,
    "blake3:xyz",
    "recompute",
    "inspect_only",
    "2.0.0",
    "1.x",
    "x" * 300,
    "NaN",
    "truncate:abc",
]

garbage_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 1, 7, 8, 9, 2**31, 2**63, 2**64, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
    st.sampled_from(SPECIAL_STRINGS),
    st.lists(st.one_of(st.none(), st.integers(-3, 10), st.text(max_size=4), st.floats()), max_size=5),
    st.dictionaries(st.sampled_from(SPECIAL_STRINGS) | st.text(max_size=6), st.integers(-2, 9) | st.none(), max_size=3),
)
garbage_keys = st.one_of(st.sampled_from(SPECIAL_STRINGS), st.text(max_size=12))
selectors = st.integers(min_value=0, max_value=10_000)

tree_mutations = st.one_of(
    st.tuples(st.just("delete"), selectors),
    st.tuples(st.just("set"), selectors, garbage_values),
    st.tuples(st.just("insert"), selectors, garbage_keys, garbage_values),
)
byte_mutations = st.one_of(
    st.tuples(st.just("truncate"), st.floats(min_value=0.0, max_value=1.0)),
    st.tuples(
        st.just("splice"),
        st.floats(min_value=0.0, max_value=1.0),
        st.binary(max_size=12)
        | st.sampled_from([b"}", b"]", b'"', b"\\", b",", b"\xff", b"9" * 5000, b"[" * 5000, b"NaN", b"-Infinity"]),
    ),
    st.tuples(st.just("bytes"), st.binary(max_size=64)),
    st.tuples(
        st.just("field"),
        st.sampled_from(
            [
                b"9" * 5000,
                b"-" + b"1" * 4301,
                b"1e999",
                b"NaN",
                b"-Infinity",
                b"[" * 5000 + b"]" * 5000,
                b'"\\ud800"',
                b"true",
            ]
        ),
    ),
)


def _select(doc: Any, selector: Any) -> tuple:
    if isinstance(selector, tuple):  # explicit examples name their path
        return selector
    paths = all_paths(doc)
    return paths[selector % len(paths)]


def _parent(doc: Any, path: tuple) -> Any:
    for part in path[:-1]:
        doc = doc[part]
    return doc


def apply_tree(doc: Any, mutation: tuple) -> Any:
    kind, selector = mutation[0], mutation[1]
    path = _select(doc, selector)
    if kind == "delete":
        if not path:
            return doc
        parent = _parent(doc, path)
        del parent[path[-1]]
    elif kind == "set":
        if not path:
            return mutation[2]
        _parent(doc, path)[path[-1]] = mutation[2]
    elif kind == "insert":
        target = _parent(doc, path + (None,))  # the value at `path` itself
        if isinstance(target, dict):
            target[mutation[2]] = mutation[3]
        elif isinstance(target, list):
            target.insert(len(mutation[2]) % (len(target) + 1), mutation[3])
        elif path:
            _parent(doc, path)[path[-1]] = [target, mutation[3]]
    return doc


def apply_bytes(data: bytes, mutation: tuple) -> bytes:
    kind = mutation[0]
    if kind == "truncate":
        return data[: int(len(data) * mutation[1])]
    if kind == "field":  # a raw field appended to the top-level object
        return data[:-1] + b',"zz":' + mutation[1] + b"}" if data.endswith(b"}") else data
    if kind == "splice":
        at = int(len(data) * mutation[1])
        return data[:at] + mutation[2] + data[at:]
    return mutation[1]


def _names_document(message: str, label: str) -> bool:
    return label in message or (label == "manifest" and "payload '" in message)


def check(label: str, mutations: list[tuple]) -> tuple[str | None, list[tuple[str, str]]]:
    """Store the mutated document, open the bundle and load everything. Returns the one-line refusal (None
    when the bundle was accepted) and the (read path, payload) pairs loaded before it; any other outcome
    fails the test."""
    base = base_documents()
    doc = json.loads(json.dumps(base[label]))
    tree = [m for m in mutations if m[0] in ("delete", "set", "insert")]
    raw = [m for m in mutations if m[0] not in ("delete", "set", "insert")]
    for mutation in tree:
        doc = apply_tree(doc, mutation)
    data = compact_json(doc)
    for mutation in raw:
        data = apply_bytes(data, mutation)

    root = f"memory://fuzz-{uuid.uuid4().hex}"
    try:
        store, marker = _write_canonical(root)
        docs = marker.documents()
        refs = {name: getattr(docs, name) for name in DOCS}
        refs[label] = DocRef.of(store.put(data))
        crafted = CompleteMarker(
            bundle_id=NAME, anchor=marker.anchor, expected_ranks=[0], multi_rank=False, shards={"0": Documents(**refs)}
        )
        store.backend.write(complete_key(NAME), compact_json(crafted.model_dump(mode="json")))
        url = f"{root}/{NAME}"
        loaded: list[tuple[str, str]] = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for reader in open_native(url):
                    for payload in reader.manifest.payloads:
                        reader.load_payload(payload)
                        loaded.append(("whole", payload))
                    reader.full_index()
                for reader in open_native(url):  # fresh readers: the ranged-read (header + rows) path
                    positions = list(range(len(reader.index.samples)))
                    for payload in reader.manifest.payloads:
                        reader.load_payload(payload, samples=positions)
                        loaded.append(("rows", payload))
        except TrajectoryReplayError as exc:
            message = str(exc)
            assert "\n" not in message, f"multi-line message for a bad {label}: {message!r}"
            assert _names_document(message, label), f"message does not name the {label}: {message!r}"
            return message, loaded
        return None, loaded
    finally:
        fsspec.filesystem("memory").rm("/" + root.removeprefix("memory://"), recursive=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    label=st.sampled_from(DOCS),
    mutations=st.lists(
        st.one_of(tree_mutations, tree_mutations, tree_mutations, tree_mutations, byte_mutations),
        min_size=1,
        max_size=3,
    ),
)
# found while writing these tests; kept so every run covers them
@example(label="manifest", mutations=[("insert", ("payloads",), "a\nb", {"name": "x"})])
@example(label="manifest", mutations=[("set", ("payloads", "kl", "dtype"), "torch.complex64")])
@example(label="index", mutations=[("splice", 1.0, b"")])  # changes no byte (test_unmutated_documents_open: opens)
@example(label="expected", mutations=[("field", b"9" * 5000)])
@example(label="index", mutations=[("set", ("samples", 0, "response_length"), 3)])
@example(label="manifest", mutations=[("set", ("payloads", "kl", "size"), 105)])
def test_mutated_documents_are_accepted_or_refused_cleanly(label, mutations):
    check(label, mutations)


@pytest.mark.parametrize("label", DOCS)
def test_unmutated_documents_open(label):
    """The harness itself: each canonical document, re-stored through the mutation path, opens and loads
    every payload (a harness that refused everything would pass every fuzzed case)."""
    payloads = sorted(base_documents()["manifest"]["payloads"])
    assert {"kl", "advantages"} <= set(payloads), payloads
    # every payload read whole and by rows; the second case is a byte mutation that changes no byte
    for mutations in ([], [("splice", 1.0, b"")]):
        refusal, loaded = check(label, mutations)
        assert refusal is None, f"the unmutated {label} was refused: {refusal}"
        assert sorted(loaded) == sorted((how, p) for how in ("whole", "rows") for p in payloads), loaded
