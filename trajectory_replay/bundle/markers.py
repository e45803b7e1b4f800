"""Completion markers and the multi-rank completion protocol, on the store itself.

    <root>/<bundle>/COMPLETE      single producer: create-once; the bundle's document refs
    <root>/<bundle>/COMPLETE.<r>  several producers: rank r landed (document refs, anchor,
                                  expected ranks, attempt id)
    <root>/<bundle>/COMPLETE      several producers: create-once once every expected rank
                                  has landed and all agree; identical bytes from any finalizer

Each producer writes its documents, then create-once COMPLETE.<r>, then tries to finalize:
when every expected COMPLETE.<r> exists (checked by key, never by LIST) and all agree on
bundle id, anchor and expected ranks, it create-once writes COMPLETE. The final marker's
content is a pure function of the rank markers, so racing finalizers write the same bytes
and all succeed. No collective, no waiting, no lock. A reader that finds all rank markers
but no COMPLETE (the last rank died after landing) finalizes the same way.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from trajectory_replay.backends import Backend
from trajectory_replay.bundle.documents import compact_json, parse_json, validate_document
from trajectory_replay.errors import BundleError, NotFoundError
from trajectory_replay.store import BlobRef

COMPLETE = "COMPLETE"
RANK_MARKER = re.compile(r"COMPLETE\.(0|[1-9][0-9]*)")
COMPLETE_FORMAT = "trajectory-replay.complete/1"
RANK_FORMAT = "trajectory-replay.rank/1"
MAX_MARKER_BYTES = 4 << 20


class DocRef(BaseModel):
    """A document blob: digest, size, and the digest of its record."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str
    size: int
    record: str

    @classmethod
    def of(cls, ref: BlobRef) -> "DocRef":
        return cls(digest=ref.digest, size=ref.size, record=ref.record)

    def blob_ref(self) -> BlobRef:
        return BlobRef(self.digest, self.size, self.record)


class Documents(BaseModel):
    """The three documents of one bundle (or one rank of it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest: DocRef
    index: DocRef
    expected: DocRef

    def digests(self) -> list[str]:
        return [self.manifest.digest, self.index.digest, self.expected.digest]


class RankMarker(BaseModel):
    """COMPLETE.<r>: rank r of a multi-producer bundle has landed."""

    model_config = ConfigDict(extra="ignore")

    format: str = RANK_FORMAT
    bundle_id: str
    rank: int
    anchor: dict[str, Any]
    expected_ranks: list[int]
    documents: Documents
    attempt: str
    created: float = 0.0


class CompleteMarker(BaseModel):
    """COMPLETE: the bundle exists. `shards` maps rank -> documents (one entry for a single producer)."""

    model_config = ConfigDict(extra="ignore")

    format: str = COMPLETE_FORMAT
    bundle_id: str
    anchor: dict[str, Any]
    expected_ranks: list[int]
    multi_rank: bool
    shards: dict[str, Documents] = Field(min_length=1)
    attempt: Optional[str] = None

    def documents(self, rank: Optional[int] = None) -> Documents:
        """The documents of `rank` (or of the only shard of a single-producer bundle)."""
        if rank is None:
            if self.multi_rank:
                raise BundleError(f"{self.bundle_id}: a multi-rank bundle; address one rank as "
                                  f"{self.bundle_id}/rank-<r> (ranks {self.expected_ranks})")
            return next(iter(self.shards.values()))
        try:
            return self.shards[str(rank)]
        except KeyError:
            raise BundleError(f"{self.bundle_id}: no rank {rank} (ranks {self.expected_ranks})") from None

    def all_digests(self) -> list[str]:
        return [d for docs in self.shards.values() for d in docs.digests()]


def rank_key(name: str, rank: int) -> str:
    return f"{name}/{COMPLETE}.{rank}"


def complete_key(name: str) -> str:
    return f"{name}/{COMPLETE}"


def read_marker(backend: Backend, key: str, model: type[BaseModel]) -> Optional[BaseModel]:
    """The parsed marker at `key`, or None when absent; BundleError when malformed."""
    try:
        if backend.size(key) > MAX_MARKER_BYTES:
            raise BundleError(f"{backend.url}/{key}: marker larger than {MAX_MARKER_BYTES} bytes")
        data = backend.read(key)
    except NotFoundError:
        return None
    return validate_document(model, parse_json(data, f"{backend.url}/{key}"), f"{backend.url}/{key}")


def read_complete(backend: Backend, name: str) -> Optional[CompleteMarker]:
    """The final COMPLETE of bundle `name`, or None."""
    return read_marker(backend, complete_key(name), CompleteMarker)  # type: ignore[return-value]


def final_marker_bytes(markers: list[RankMarker]) -> bytes:
    """The final COMPLETE written for agreeing rank markers: deterministic, so racing finalizers agree."""
    first = markers[0]
    marker = CompleteMarker(
        bundle_id=first.bundle_id, anchor=first.anchor, expected_ranks=sorted(first.expected_ranks),
        multi_rank=True, shards={str(m.rank): m.documents for m in sorted(markers, key=lambda m: m.rank)},
    )
    return compact_json(marker.model_dump(mode="json", exclude={"attempt"}))


def cohort_state(backend: Backend, name: str, expected_ranks: list[int]) -> tuple[list[RankMarker], list[int]]:
    """(landed rank markers, missing ranks) checked key by key."""
    landed, missing = [], []
    for rank in expected_ranks:
        marker = read_marker(backend, rank_key(name, rank), RankMarker)
        if marker is None:
            missing.append(rank)
        else:
            landed.append(marker)  # type: ignore[arg-type]
    return landed, missing


def check_agreement(name: str, markers: list[RankMarker]) -> None:
    """BundleError unless all rank markers agree on bundle id, anchor and expected ranks."""
    first = markers[0]
    for m in markers[1:]:
        for field in ("bundle_id", "anchor", "expected_ranks"):
            if getattr(m, field) != getattr(first, field):
                raise BundleError(f"{name}: rank markers disagree on {field} (rank {first.rank}: "
                                  f"{getattr(first, field)}, rank {m.rank}: {getattr(m, field)})")
    for m in markers:
        if m.rank not in first.expected_ranks:
            raise BundleError(f"{name}: rank {m.rank} landed but is not among expected ranks {first.expected_ranks}")


def try_finalize(backend: Backend, name: str, expected_ranks: Optional[list[int]] = None,
                 *, unsafe: bool = False) -> Optional[CompleteMarker]:
    """Write the final COMPLETE if every expected rank landed and all agree; return it, or None if ranks are missing."""
    existing = read_complete(backend, name)
    if existing is not None:
        return existing
    if expected_ranks is None:
        found = landed_ranks(backend, name)
        if not found:
            return None
        probe = read_marker(backend, rank_key(name, found[0]), RankMarker)
        expected_ranks = probe.expected_ranks  # type: ignore[union-attr]
    landed, missing = cohort_state(backend, name, expected_ranks)
    if missing:
        return None
    check_agreement(name, landed)
    data = final_marker_bytes(landed)
    backend.require_atomic_create(unsafe=unsafe)
    if not backend.create_if_absent(complete_key(name), data):
        other = read_complete(backend, name)
        if other is None or other.shards != parse_complete(data).shards:
            raise BundleError(f"{backend.url}/{name}: a different COMPLETE was written concurrently")
        return other
    return parse_complete(data)


def parse_complete(data: bytes) -> CompleteMarker:
    return validate_document(CompleteMarker, parse_json(data, COMPLETE), COMPLETE)


def landed_ranks(backend: Backend, name: str) -> list[int]:
    """Ranks with a COMPLETE.<r> marker, found by listing the bundle's directory (inspect, ls, gc)."""
    ranks = []
    for key in backend.list(f"{name}/"):
        match = RANK_MARKER.fullmatch(key[len(name) + 1:])
        if match:
            ranks.append(int(match.group(1)))
    return sorted(ranks)
