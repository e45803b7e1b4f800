"""What a store root holds, as the store operations see it: its bundles, their markers, and each
bundle's reachable objects.

One walk serves ls, cp, gc, fsck and stats. A bundle's tree is the Merkle DAG its markers pin:

    COMPLETE / COMPLETE.<r> -> documents (manifest, index, expected) -> payload blobs
    blob -> its closure in the store (ref -> record -> chunks: `Inventory.closure`)

Trees are walked level by level across all bundles at once, each level one batch of concurrent
reads, so a store with many bundles costs a few round trips per level, not one per object.
Manifests are verified against their digests before they are parsed; payload chunks are named,
not read (fsck reads them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trajectory_replay.backends import Backend, open_backend, redact_url
from trajectory_replay.bundle.documents import document_size_problem, parse_json, validate_document
from trajectory_replay.bundle.schema import Manifest, PayloadSpec, TriggerRecord
from trajectory_replay.bundle.status import BundleState
from trajectory_replay.errors import BundleError, NoSuchTargetError
from trajectory_replay.store.inventory import BlobNode, Inventory


def open_root(path_or_url: str | os.PathLike, *, must_exist: bool = True, **storage_options: Any) -> Backend:
    """The backend of a store root; NotFoundError when `must_exist` and nothing is there."""
    backend = open_backend(path_or_url, **storage_options)
    if must_exist and not backend.list_dir():
        raise NoSuchTargetError(f"{redact_url(str(path_or_url))}: no such store root (nothing stored there)")
    return backend


# ---- trees ---------------------------------------------------------------------------------------


@dataclass
class BundleTree:
    """Everything one bundle's markers reach."""

    name: str
    documents: list[BlobNode] = field(default_factory=list)
    payloads: list[tuple[int | None, PayloadSpec, BlobNode]] = field(default_factory=list)
    trigger: TriggerRecord | None = None
    """The flight recorder's trigger that kept the bundle (its first shard's manifest says), if any."""
    keys: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    """Keys the walk needed to read and did not find (payload chunks are not read: see fsck)."""
    corrupt: set[str] = field(default_factory=set)
    """Keys the walk read whose bytes are not what their name or their parent says."""
    problems: list[str] = field(default_factory=list)

    @property
    def resolved(self) -> bool:
        """True when every record and manifest was read: `keys` is the whole tree."""
        return not self.problems

    @property
    def logical_bytes(self) -> int:
        return sum(spec.size for _, spec, _ in self.payloads)

    def payload_chunks(self) -> dict[str, int]:
        """Unique chunks of the payload blobs, digest -> size."""
        return {c: s for _, _, node in self.payloads for c, s in node.chunks}

    def all_chunks(self) -> dict[str, int]:
        """Unique chunks of payload and document blobs, digest -> size."""
        out = self.payload_chunks()
        out.update({c: s for node in self.documents for c, s in node.chunks})
        return out

    @property
    def stored_bytes(self) -> int:
        return sum(self.all_chunks().values())

    def add(self, node: BlobNode, label: str) -> None:
        self.keys |= node.keys
        self.missing |= node.missing
        self.corrupt |= node.corrupt
        self.problems += [f"{self.name}: {label}: {p}" for p in node.problems]


class Walker:
    """Walks bundle trees on one backend; the blobs' closures come from the store's inventory (shared with
    a caller that passes its own, so that records read once are not read again)."""

    def __init__(self, backend: Backend, inventory: Inventory | None = None) -> None:
        self.backend = backend
        self.inventory = inventory or Inventory(backend)

    def trees(self, bundles: Sequence[BundleState]) -> dict[str, BundleTree]:
        """The tree of every bundle (complete ones from COMPLETE, others from their landed rank markers)."""
        shards = {b.name: b.documents() for b in bundles}
        doc_nodes = self.inventory.closure(
            {
                ref.digest: (ref.record, ref.size)
                for docs in shards.values()
                for _, d in docs
                for ref in (d.manifest, d.index, d.expected)
            }
        )
        manifest_digests = {d.manifest.digest for docs in shards.values() for _, d in docs}
        manifests, bad_chunks = self._manifests({m: doc_nodes[m] for m in manifest_digests})
        payload_nodes = self.inventory.closure(
            {
                spec.digest: (spec.record, spec.size)
                for m in manifests.values()
                if isinstance(m, Manifest)
                for spec in m.payloads.values()
                if spec.digest and spec.record
            }
        )
        trees = {}
        for name, docs in shards.items():
            tree = trees[name] = BundleTree(name)
            for rank, d in docs:
                for label, ref in (("manifest", d.manifest), ("index", d.index), ("expected", d.expected)):
                    tree.documents.append(doc_nodes[ref.digest])
                    tree.add(doc_nodes[ref.digest], label)
                missing, corrupt = bad_chunks.get(d.manifest.digest, (set(), set()))
                tree.missing |= missing
                tree.corrupt |= corrupt
                manifest = manifests[d.manifest.digest]
                if not isinstance(manifest, Manifest):
                    if not doc_nodes[d.manifest.digest].problems:
                        tree.problems.append(f"{name}: manifest {d.manifest.digest}: {manifest}")
                    continue
                if tree.trigger is None:
                    tree.trigger = manifest.trigger
                for spec in manifest.payloads.values():
                    if not (spec.digest and spec.record):
                        tree.problems.append(f"{name}: payload {spec.name!r} has no digest in the manifest")
                        continue
                    node = payload_nodes[spec.digest]
                    tree.payloads.append((rank, spec, node))
                    tree.add(node, f"payload {spec.name!r}")
        return trees

    def _manifests(self, nodes: dict[str, BlobNode]) -> tuple[dict[str, Manifest | str], dict]:
        """Fetch, verify and parse manifests (all their chunks in one batch).

        Returns digest -> Manifest (or why it failed), and digest -> (missing, corrupt) chunk keys."""
        out: dict[str, Manifest | str] = {}
        bad: dict[str, tuple[set[str], set[str]]] = {}
        for digest, node in nodes.items():
            # the record's chunk sizes add up to the manifest's size: an oversized one is never fetched
            problem = document_size_problem(sum(size for _, size in node.chunks))
            if problem:
                out[digest] = problem
        nodes = {d: node for d, node in nodes.items() if d not in out}
        contents = self.inventory.read_blobs({d: [c for c, _ in node.chunks] for d, node in nodes.items()})
        for digest, node in nodes.items():
            if not node.chunks:
                out[digest] = "; ".join(node.problems) or "its record lists no chunks"
                continue
            got = contents[digest]
            if got.missing or got.corrupt:
                bad[digest] = (got.missing, got.corrupt)
                out[digest] = f"{len(got.missing)} missing and {len(got.corrupt)} corrupt chunks"
                continue
            if got.data is None:
                out[digest] = f"content does not hash to {digest}"
                continue
            try:
                out[digest] = validate_document(Manifest, parse_json(got.data, "manifest"), "manifest")
            except BundleError as exc:
                out[digest] = str(exc)
        return out, bad


__all__ = [
    "BundleTree",
    "Walker",
    "open_root",
]
