"""Completion markers and the multi-rank completion protocol, on the store itself.

    <root>/<bundle>/COMPLETE      single producer: create-once; the bundle's document refs
    <root>/<bundle>/COMPLETE.<r>  several producers: rank r landed (document refs, anchor,
                                  expected ranks, attempt id)
    <root>/<bundle>/FINALIZER     several producers: create-once claim of the producer that
                                  finalizes ({"format": ..., "rank": r})
    <root>/<bundle>/COMPLETE      several producers: create-once once every expected rank
                                  has landed and all agree; identical bytes from any finalizer

Each producer writes its documents, then create-once COMPLETE.<r>, then tries to finalize:
when every expected COMPLETE.<r> exists (checked by key, never by LIST) and all agree on
bundle id, anchor and expected ranks, it create-once writes COMPLETE. The final marker's
content is a pure function of the rank markers, so racing finalizers write the same bytes
and all succeed. No collective, no waiting, no lock. A reader that finds all rank markers
but no COMPLETE (the last rank died after landing) finalizes the same way.

Claim first. A producer that has landed its marker (and finds no COMPLETE) create-once writes
FINALIZER, naming its rank, before it reads any other rank's marker. One that finds another rank's
claim there returns at once, its rank landed: it reads nothing of the cohort. Only the claimant
(its claim created now, or by an earlier attempt of the same rank: the claim's bytes are a function
of the rank, so a retry of that rank's job goes on) reads the rank markers. When N producers land at
the same moment, reading before claiming would cost each of them N marker reads to learn that every
rank landed: N^2 for one bundle (4,096 at 64 ranks, a million at 1,024); claiming first costs N
claim attempts and one claimant's N reads.

A claimant that finds every rank landed checks the markers against their documents and writes
COMPLETE. One that finds rank r missing hands the claim back, so that a later lander can finalize:
it deletes FINALIZER, then reads rank r's marker again (and, if r has landed meanwhile, the ranks
after it). If every rank has now landed it claims again (create-once: where another producer claimed
in between, that one carries on and this one returns); otherwise it returns.

Why no landing is lost: the store is linearizable (S3 and local disk are), and every rank writes its
marker before it tries the claim. If the claimant's read after its delete misses rank r, r's marker,
and so r's claim attempt, come after the delete: r (or a producer that claims before it, later than
the delete) reads every rank that landed before. More generally, take the rank that lands last. When
it tries the claim, it either gets it and then reads every marker, or another producer holds the
claim at that moment. That holder found every rank landed and finalizes, or it found a rank missing;
then its delete comes after this claim attempt, so after every marker landed, and its reads after the
delete find every rank: it claims again, or the producer that claimed after its delete (and so reads
after the last landing, or claims again only having read every rank) carries on. The claim is no
lock that anything depends on: two jobs of the same rank both holding it, or a claim deleted under
its holder, cost reads, never correctness, because COMPLETE is create-once with deterministic bytes.

A claimant that dies (or meets a store error) keeps the claim, and every later lander returns: the
bundle is then left exactly as a last rank that died after landing leaves it (every rank landed,
COMPLETE missing, once the missing ranks land), and readers, `ls` and `fsck`, which ignore the
claim, finalize it. gc removes the claim of an abandoned cohort with its markers.

COMPLETE cannot be undone, so no finalizer trusts a rank marker it has not checked against
its own documents (`rank_marker_problems`): the key's rank, the manifest's and index's bundle
id and the index's anchor must be what the marker says, and every document must be readable.
A marker that fails is reported by its key and the bundle stays unfinalized, so it can still
be completed: by restoring the object that was missing, or by removing the bad marker and
landing that rank again. A claimant that finds a bad marker (or one it cannot parse) raises and
keeps its claim: the bundle cannot be finalized before it is repaired, and handing the claim back
would have every later or retried producer read the cohort, and once every rank landed check it
against its documents, only to fail the same way. Readers, `ls` and `fsck` report the marker by its
key and finalize the repaired bundle (so does a retry of the claimant's rank).
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, field_validator, model_validator

from trajectory_replay.backends import Backend
from trajectory_replay.backends.base import DIFFERENT
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.documents import (
    check_document_size,
    compact_json,
    nesting_exceeds,
    parse_json,
    validate_document,
)
from trajectory_replay.bundle.schema import BundleIndex, Expected, Identity, Manifest, TriggerRecord
from trajectory_replay.errors import BundleError, NotFoundError, TrajectoryReplayError, ValueTooLargeError
from trajectory_replay.outcome import one_line
from trajectory_replay.store import BlobRecord, BlobRef, ObjectStore, hash_bytes, object_key
from trajectory_replay.store.inventory import fetch
from trajectory_replay.store.layout import RECORDER_DIR
from trajectory_replay.store.records import MAX_RECORD_BYTES

_M = TypeVar("_M", bound=BaseModel)

COMPLETE = "COMPLETE"
RANK_MARKER = re.compile(r"COMPLETE\.(0|[1-9][0-9]*)")
FINALIZER = "FINALIZER"
ABANDONED = "ABANDONED"
COMPLETE_FORMAT = "trajectory-replay.complete/1"
RANK_FORMAT = "trajectory-replay.rank/1"
FINALIZER_FORMAT = "trajectory-replay.finalizer/1"
ABANDONED_FORMAT = "trajectory-replay.abandoned/1"
MAX_MARKER_BYTES = 4 << 20
MARKER_WINDOW = 32
"""Rank markers `cohort_state` reads at once (concurrently, one request each)."""
MAX_RANKS = 4096
"""Most ranks a marker may list (expected_ranks, shards): a bound on the rank markers a reader checks. A
multi-rank COMPLETE holds three document references (about 0.5 KiB) per rank, so no more than about 8,000
fit in MAX_MARKER_BYTES; 4,096 producers of one step is the data-parallel degree of runs on tens of thousands
of GPUs."""
RANKS_SHOWN = 16
"""Ranks (or runs of consecutive ranks) a one-line message shows before it counts the rest (`ranks_brief`)."""
MAX_RANK = (1 << 31) - 1
"""Largest rank number: ranks name keys (`COMPLETE.<r>`), so they stay short."""
_RANK_TEXT = re.compile(r"0|[1-9][0-9]{0,9}")
_DIGEST = re.compile(r"blake3:[0-9a-f]{64}")


def _rank(value: Any, what: str) -> int:
    """`value` as a rank: an integer (numpy ones too) in [0, MAX_RANK]; never a bool, string or float."""
    if isinstance(value, (bool, str, bytes, float)):
        raise ValueError(f"{what} {value!r} is not an integer")
    try:
        rank = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} of type {type(value).__name__} is not an integer") from None
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"{what} {rank} is outside [0, {MAX_RANK}]")
    return rank


def _rank_list(value: Any) -> list[int]:
    """A non-empty list of distinct ranks, at most MAX_RANKS of them (counted before any is looked at)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of ranks, got {type(value).__name__}")
    if len(value) > MAX_RANKS:
        raise ValueError(f"lists {len(value)} ranks, more than the bound of {MAX_RANKS}")
    if not value:
        raise ValueError("lists no rank")
    ranks = [_rank(v, "rank") for v in value]
    seen: set[int] = set()
    twice: set[int] = set()
    for r in ranks:
        (twice if r in seen else seen).add(r)
    if twice:
        raise ValueError(f"lists a rank twice ({sorted(twice)[:8]})")
    return ranks


def ranks_brief(ranks: Sequence[int], limit: int = RANKS_SHOWN) -> str:
    """Ranks for a one-line message: `[0, 1, 2]` up to `limit` of them; beyond, runs of consecutive ranks, the
    first `limit` of them, and the count: `[0-63, 65-4095] (4095 ranks)`, `[0, 2, 4, ...] (2048 ranks)`."""
    ranks = sorted(ranks)
    if len(ranks) <= limit:
        return str(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    shown = [f"{a}-{b}" if b > a else str(a) for a, b in runs[:limit]]
    return f"[{', '.join(shown)}{', ...' if len(runs) > limit else ''}] ({len(ranks)} ranks)"


def check_rank_list(ranks: Any, where: str) -> list[int]:
    """`ranks` as markers accept them (see `_rank_list`); BundleError naming `where` otherwise.

    For writers, so that ranks a marker would refuse are refused before anything is written."""
    try:
        return _rank_list(ranks)
    except ValueError as exc:
        raise BundleError(f"{where}: expected_ranks: {exc}") from None


MarkerAnchor = Annotated[Anchor, PlainValidator(Anchor.from_marker), PlainSerializer(Anchor.to_marker)]
"""An anchor as markers store it (see `Anchor.to_marker`), checked field by field when read."""


class DocRef(BaseModel):
    """A document blob: digest, size, and the digest of its record."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str
    size: int = Field(ge=0)
    record: str

    @field_validator("digest", "record")
    @classmethod
    def _digest(cls, v: str) -> str:
        if not _DIGEST.fullmatch(v):
            raise ValueError(f"{v[:80]!r} is not a digest (blake3:<64 lowercase hex>)")
        return v

    @classmethod
    def of(cls, ref: BlobRef) -> DocRef:
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


class _MarkerFields(BaseModel):
    """The check both markers make of the expected ranks they share (their anchor is a `MarkerAnchor`)."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("expected_ranks", mode="before", check_fields=False)
    @classmethod
    def _expected(cls, v: Any) -> list[int]:
        return _rank_list(v)


class RankMarker(_MarkerFields):
    """COMPLETE.<r>: rank r of a multi-producer bundle has landed."""

    format: str = RANK_FORMAT
    bundle_id: str
    rank: int
    anchor: MarkerAnchor
    expected_ranks: list[int]
    documents: Documents
    attempt: str
    created: float = 0.0
    run: str | None = None
    """The launch of the training job that landed it (a capture's run identity), where one is known: ranks of two
    launches are two captures, never one bundle."""

    @field_validator("rank", mode="before")
    @classmethod
    def _check_rank(cls, v: Any) -> int:
        return _rank(v, "rank")


class CompleteMarker(_MarkerFields):
    """COMPLETE: the bundle exists. `shards` maps rank -> documents (one entry for a single producer)."""

    format: str = COMPLETE_FORMAT
    bundle_id: str
    anchor: MarkerAnchor
    expected_ranks: list[int]
    multi_rank: bool
    shards: dict[str, Documents] = Field(min_length=1)
    attempt: str | None = None

    @field_validator("shards", mode="before")
    @classmethod
    def _shard_keys(cls, v: Any) -> Any:
        # keys are rank numbers that readers turn into ints and into `rank-<r>` paths: checked before any use
        if isinstance(v, dict):
            if len(v) > MAX_RANKS:
                raise ValueError(f"lists {len(v)} shards, more than the bound of {MAX_RANKS}")
            for key in v:
                if not isinstance(key, str) or not _RANK_TEXT.fullmatch(key) or int(key) > MAX_RANK:
                    raise ValueError(f"shard key {str(key)[:80]!r} is not a rank number")
        return v

    @model_validator(mode="after")
    def _one_shard_unless_multi_rank(self) -> CompleteMarker:
        if not self.multi_rank and len(self.shards) != 1:
            raise ValueError(f"field 'shards': a single-producer bundle has one shard, this lists {len(self.shards)}")
        return self

    def documents(self, rank: int | None = None) -> Documents:
        """The documents of `rank` (or of the only shard of a single-producer bundle)."""
        if rank is None:
            if self.multi_rank:
                raise BundleError(
                    f"{self.bundle_id}: a multi-rank bundle; address one rank as "
                    f"{self.bundle_id}/rank-<r> (ranks {self.expected_ranks})"
                )
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


def trigger_key(step: str) -> str:
    """The flight recorder's create-once marker of a trigger at step bundle `step` (`.recorder/<step>`)."""
    return f"{RECORDER_DIR}/{step}"


def read_trigger(backend: Backend, key: str) -> TriggerRecord:
    """The trigger marker at `key`; BundleError naming it when it cannot be read."""
    data = _read_bounded(backend, key)
    if data is None or isinstance(data, ValueTooLargeError):
        raise BundleError(f"{backend.url}/{key}: no readable trigger marker")
    try:
        return TriggerRecord.model_validate(json.loads(data))
    except ValueError as exc:
        raise BundleError(f"{backend.url}/{key}: not a trigger marker: {one_line(str(exc), 200)}") from None


def read_triggers(backend: Backend) -> tuple[list[TriggerRecord], list[str]]:
    """Every trigger marker of the root, in step order, and '<key>: why' for each that cannot be read."""
    try:
        names = backend.list_dir(RECORDER_DIR)
    except NotFoundError:
        return [], []
    found, bad = [], []
    for name in names:
        try:
            found.append(read_trigger(backend, trigger_key(name)))
        except BundleError as exc:
            bad.append(str(exc))
    return sorted(found, key=lambda t: step_order(t.step)), bad


def step_order(name: str) -> tuple[int, ...]:
    """Sort key of a step bundle's name (`step-<R>-<S>`): by rollout, then step; other names last, by name."""
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "step" and parts[1].isdigit() and parts[2].isdigit():
        return (int(parts[1]), int(parts[2]))
    return (1 << 62, 0)


def finalizer_key(name: str) -> str:
    return f"{name}/{FINALIZER}"


def abandoned_key(name: str) -> str:
    return f"{name}/{ABANDONED}"


def abandoned_note(ranks: Sequence[int], when: float) -> bytes:
    """The ABANDONED note gc writes just before it removes the rank markers `ranks` of an abandoned cohort
    (`when`: wall-clock seconds)."""
    return compact_json({"format": ABANDONED_FORMAT, "ranks": sorted(set(ranks)), "removed": when})


def read_abandoned(backend: Backend, name: str) -> list[int]:
    """The ranks whose markers gc removed from bundle `name` as an abandoned cohort, by its ABANDONED note; []
    when there is none, or when it cannot be read (the note only ever adds an error to a landing)."""
    try:
        data = _read_bounded(backend, abandoned_key(name))
        doc = None if data is None or isinstance(data, ValueTooLargeError) else parse_json(data, abandoned_key(name))
    except BundleError:
        return []
    if not isinstance(doc, dict) or doc.get("format") != ABANDONED_FORMAT:
        return []
    try:
        return _rank_list(doc.get("ranks"))
    except ValueError:
        return []


def finalizer_claim(rank: int) -> bytes:
    """The FINALIZER a producer of rank `rank` writes: a function of the rank alone, so that a retry of the
    same rank's job finds its own claim and goes on."""
    return compact_json({"format": FINALIZER_FORMAT, "rank": _rank(rank, "rank")})


def read_marker(backend: Backend, key: str, model: type[_M]) -> _M | None:
    """The parsed marker at `key`, or None when absent; BundleError when malformed (or larger than MAX_MARKER_BYTES).
    One request: every bundle's status reads its COMPLETE, and a store may hold thousands of bundles."""
    data = _read_bounded(backend, key)
    return None if data is None else _parse_marker(backend, key, data, model)


def _parse_marker(backend: Backend, key: str, data: bytes | ValueTooLargeError, model: type[_M]) -> _M:
    if isinstance(data, ValueTooLargeError):
        raise BundleError(f"{backend.url}/{key}: marker larger than {MAX_MARKER_BYTES} bytes")
    return validate_document(model, parse_json(data, f"{backend.url}/{key}"), f"{backend.url}/{key}")


def _read_bounded(backend: Backend, key: str) -> bytes | ValueTooLargeError | None:
    """The value at `key` in one request, read no further than one byte past MAX_MARKER_BYTES, so that a larger
    value is told apart without a size request first: None when absent, the ValueTooLargeError (returned, not
    raised) when larger than that."""
    try:
        return backend.read(key, MAX_MARKER_BYTES)
    except NotFoundError:
        return None
    except ValueTooLargeError as exc:
        return exc


def read_complete(backend: Backend, name: str) -> CompleteMarker | None:
    """The final COMPLETE of bundle `name`, or None."""
    return read_marker(backend, complete_key(name), CompleteMarker)


def final_marker_bytes(markers: list[RankMarker]) -> bytes:
    """The final COMPLETE written for agreeing rank markers: deterministic, so racing finalizers agree."""
    first = markers[0]
    marker = CompleteMarker(
        bundle_id=first.bundle_id,
        anchor=first.anchor,
        expected_ranks=sorted(first.expected_ranks),
        multi_rank=True,
        shards={str(m.rank): m.documents for m in sorted(markers, key=lambda m: m.rank)},
    )
    return compact_json(marker.model_dump(mode="json", exclude={"attempt"}))


def cohort_state(backend: Backend, name: str, expected_ranks: list[int]) -> tuple[list[RankMarker], list[int]]:
    """(landed rank markers, [the first missing rank]), in rank order, read MARKER_WINDOW markers at a time,
    concurrently, one request each.

    Reading stops after the first window with a rank that has not landed: the cohort cannot be finalized then,
    and reading on would cost the claimant of every rank that lands before the last up to N marker reads to
    learn nothing more."""
    landed: list[RankMarker] = []
    for start in range(0, len(expected_ranks), MARKER_WINDOW):
        window = expected_ranks[start : start + MARKER_WINDOW]
        keys = [rank_key(name, rank) for rank in window]
        values = backend.pool.map(lambda key: _read_bounded(backend, key), keys)
        for rank, key, data in zip(window, keys, values):
            if data is None:
                return landed, [rank]
            landed.append(_parse_marker(backend, key, data, RankMarker))
    return landed, []


def claim_finalizer(backend: Backend, name: str, rank: int, *, unsafe: bool = False) -> bool:
    """Create-once the FINALIZER of bundle `name` for the producer of rank `rank`: True when the claim is
    this rank's (created now, or by an earlier attempt of the same rank), False when another rank holds it."""
    backend.require_atomic_create(unsafe=unsafe)
    return backend.create_status(finalizer_key(name), finalizer_claim(rank)) != DIFFERENT


def _claimed_cohort(
    backend: Backend, name: str, expected_ranks: list[int], rank: int, *, unsafe: bool
) -> list[RankMarker] | None:
    """The landed rank markers, in rank order, for the producer of `rank`, which holds the FINALIZER claim; None
    when it is to finalize nothing.

    Where a rank is missing, the claim is handed back (deleted; gone already is fine) before that rank's marker is
    read again, so that the missing rank, landing after the read, finds the claim free: see the module docstring
    for why nothing is lost between the reads. Should every rank have landed by the second read, the claim is
    tried again, and a producer that took it in between finalizes instead."""
    landed, missing = cohort_state(backend, name, expected_ranks)
    if not missing:
        return landed
    backend.delete(finalizer_key(name))
    gap = missing[0]
    data = _read_bounded(backend, rank_key(name, gap))
    if data is None:
        return None
    more, missing = cohort_state(backend, name, expected_ranks[expected_ranks.index(gap) + 1 :])
    if missing or not claim_finalizer(backend, name, rank, unsafe=unsafe):
        return None
    return landed + [_parse_marker(backend, rank_key(name, gap), data, RankMarker)] + more


def check_agreement(name: str, markers: list[RankMarker]) -> None:
    """BundleError unless all rank markers agree on bundle id, anchor, expected ranks and the run that landed them
    (ranks of a restarted run beside those of the run before it are two captures, not one bundle)."""
    first = markers[0]
    for m in markers[1:]:
        for field in ("bundle_id", "anchor", "expected_ranks", "run"):
            if getattr(m, field) != getattr(first, field):
                raise BundleError(
                    f"{name}: rank markers disagree on {field} (rank {first.rank}: "
                    f"{one_line(str(getattr(first, field)), 120)}, rank {m.rank}: "
                    f"{one_line(str(getattr(m, field)), 120)})"
                )
    for m in markers:
        if m.rank not in first.expected_ranks:
            raise BundleError(f"{name}: rank {m.rank} landed but is not among expected ranks {first.expected_ranks}")


def try_finalize(
    backend: Backend,
    name: str,
    expected_ranks: list[int] | None = None,
    *,
    unsafe: bool = False,
    claim: int | None = None,
) -> CompleteMarker | None:
    """Write the final COMPLETE if every expected rank landed and all agree; return it, or None if ranks are missing.

    `claim` is the rank of a producer that just landed: it claims finalizing before it reads the cohort
    (`claim_finalizer`) and gets None at once when another producer holds the claim; holding it, it reads the
    cohort and hands the claim back where a rank is missing (`_claimed_cohort`). Readers pass none and finalize
    whatever the claim says: a claimant may have died before writing COMPLETE."""
    existing = read_complete(backend, name)
    if existing is not None:
        return existing
    if expected_ranks is None:
        found = landed_ranks(backend, name)
        if not found:
            return None
        probe = read_marker(backend, rank_key(name, found[0]), RankMarker)
        expected_ranks = probe.expected_ranks  # type: ignore[union-attr]
    if claim is not None:
        if not claim_finalizer(backend, name, claim, unsafe=unsafe):
            return None
        claimed = _claimed_cohort(backend, name, expected_ranks, claim, unsafe=unsafe)
        if claimed is None:
            return None
        landed = claimed
    else:
        landed, missing = cohort_state(backend, name, expected_ranks)
        if missing:
            return None
    problems = rank_marker_problems(backend, name, dict(zip(expected_ranks, landed)))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BundleError(f"{backend.url}/{problems[0]}{more}; the bundle is not finalized")
    check_agreement(name, landed)
    if sorted(set(landed[0].expected_ranks)) != sorted(set(expected_ranks)):
        raise BundleError(
            f"{backend.url}/{name}: the rank markers expect ranks "
            f"{one_line(str(landed[0].expected_ranks), 120)}, not "
            f"{one_line(str(sorted(expected_ranks)), 120)}; the bundle is not finalized"
        )
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
        match = RANK_MARKER.fullmatch(key[len(name) + 1 :])
        if match:
            ranks.append(int(match.group(1)))
    return sorted(ranks)


# ---- checking rank markers against their documents -----------------------------------------------


@dataclass(frozen=True)
class MarkerProblem:
    """Why the rank marker at `key` cannot be finalized from. `corrupt`: the marker itself is wrong (it
    disagrees with its key or with documents that read back whole); otherwise one of its documents could
    not be read, and the missing or damaged object is what needs repair."""

    key: str
    why: str
    corrupt: bool

    def __str__(self) -> str:
        return f"{self.key}: {'corrupt rank marker' if self.corrupt else 'rank marker cannot be checked'}: {self.why}"


def rank_marker_problems(backend: Backend, name: str, markers: Mapping[int, RankMarker]) -> list[MarkerProblem]:
    """Check each landed rank marker (rank -> the marker found under COMPLETE.<rank>) against its key and its
    documents; one problem per bad marker, in rank order. All markers' documents are read in two batches."""
    problems: dict[int, MarkerProblem] = {}
    for rank, marker in markers.items():
        if marker.rank != rank:
            problems[rank] = MarkerProblem(
                rank_key(name, rank), f"holds rank {marker.rank}, not the {rank} of its key", True
            )
        elif rank not in marker.expected_ranks:
            problems[rank] = MarkerProblem(
                rank_key(name, rank),
                f"rank {rank} is not among its expected ranks {one_line(str(marker.expected_ranks), 120)}",
                True,
            )
    contents = _read_documents(
        backend, [getattr(m.documents, label) for r, m in markers.items() if r not in problems for label in _DOCUMENTS]
    )
    for rank, marker in markers.items():
        if rank not in problems:
            found = _disagreement(marker, contents)
            if found is not None:
                problems[rank] = MarkerProblem(rank_key(name, rank), *found)
    return [problems[r] for r in sorted(problems)]


INDEX_HEAD_BYTES = 16 << 10
"""Bytes of an index read first for its identity: the writer sorts keys, so `identity` comes before `samples`."""


def index_anchor(store: ObjectStore, ref: DocRef, label: str) -> Anchor:
    """The anchor of the index document `ref`, read verified: its first INDEX_HEAD_BYTES when they hold the whole
    `identity` (the stored index sorts its keys, and the samples come after it), else the whole document within
    the document bound. BundleError when it cannot be read or has no valid identity."""
    check_document_size(ref.size, label)
    try:
        head = store.read_range(ref.blob_ref(), 0, min(ref.size, INDEX_HEAD_BYTES))
        identity = _leading_field(head, "identity") if ref.size > INDEX_HEAD_BYTES else None
        if identity is None:
            identity = parse_json(head if ref.size <= INDEX_HEAD_BYTES else store.get(ref.blob_ref()), label).get(
                "identity"
            )
    except (TrajectoryReplayError, ValueError) as exc:
        raise BundleError(f"{label}: {exc}") from None
    return Anchor.of(validate_document(Identity, identity, f"{label}: identity"))


def _leading_field(head: bytes | bytearray, name: str) -> Any | None:
    """The value of top-level field `name` of the JSON object whose first bytes are `head`, when it and every field
    before it lie whole within `head`; None otherwise (the caller reads the whole document then)."""
    if nesting_exceeds(head):
        return None
    text = bytes(head).decode("utf-8", "replace")
    decoder, pos = json.JSONDecoder(), 0
    try:
        pos = _skip(text, pos, "{")
        while True:
            key, pos = decoder.raw_decode(text, _skip(text, pos))
            value, pos = decoder.raw_decode(text, _skip(text, _skip(text, pos, ":")))
            if key == name:
                return value
            pos = _skip(text, pos, ",")
    except (ValueError, RecursionError):
        return None


def _skip(text: str, pos: int, expected: str = "") -> int:
    """The position after optional whitespace from `pos` and then `expected`; ValueError when something else."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    if not text.startswith(expected, pos):
        raise ValueError(f"expected {expected!r}")
    return pos + len(expected)


def anchor_problem(store: ObjectStore, name: str, complete: CompleteMarker) -> str | None:
    """Why COMPLETE of bundle `name` is corrupt in its anchor: it differs from the identity in a shard's index
    (`ls` would show one anchor, `inspect` the other, and `--step` would select by the wrong one); None when
    every shard agrees, or when an index cannot be read (the tree walk names that)."""
    for key, docs in sorted(complete.shards.items(), key=lambda kv: int(kv[0])):
        try:
            anchor = index_anchor(store, docs.index, f"{name}: index")
        except BundleError:
            continue
        if anchor != complete.anchor:
            shard = f" of rank {key}" if complete.multi_rank else ""
            return (
                f"{name}/{COMPLETE}: corrupt marker: anchor {complete.anchor} differs from {anchor} in the index{shard}"
            )
    return None


def complete_disagreements(
    name: str, complete: CompleteMarker, markers: Mapping[int, RankMarker]
) -> list[MarkerProblem]:
    """The rank markers (rank -> the marker found under COMPLETE.<rank>) of a bundle whose COMPLETE exists that do
    not say what COMPLETE says of their rank: bundle id, anchor, expected ranks and documents. COMPLETE is what
    readers use, so such a marker harms nothing yet; but it is what a lost COMPLETE would be finalized from again
    (and what `cp` copies), so fsck names it while the damage is still latent."""
    problems = []
    for rank, marker in sorted(markers.items()):
        shard = complete.shards.get(str(rank))
        if shard is None:
            why = f"rank {rank} is not among COMPLETE's shards {one_line(str(sorted(map(int, complete.shards))), 120)}"
        elif marker.rank != rank:
            why = f"holds rank {marker.rank}, not the {rank} of its key"
        else:
            fields = [f for f in ("bundle_id", "anchor") if getattr(marker, f) != getattr(complete, f)]
            if sorted(marker.expected_ranks) != sorted(complete.expected_ranks):
                fields.append("expected_ranks")
            fields += [
                f"documents.{label}"
                for label in _DOCUMENTS
                if getattr(marker.documents, label) != getattr(shard, label)
            ]
            if not fields:
                continue
            why = f"{', '.join(fields)} differ{'s' if len(fields) == 1 else ''} from COMPLETE's rank {rank}"
        problems.append(MarkerProblem(rank_key(name, rank), why, True))
    return problems


_DOCUMENTS: dict[str, type[BaseModel]] = {"manifest": Manifest, "index": BundleIndex, "expected": Expected}


@dataclass(frozen=True)
class _Unreadable:
    why: str
    marker_at_fault: bool
    """True when the objects read back whole but are not what the marker's reference says."""


def _disagreement(marker: RankMarker, contents: Mapping[DocRef, bytes | _Unreadable]) -> tuple[str, bool] | None:
    """(why, whether the marker is at fault) when `marker` disagrees with its documents or they cannot be read."""
    docs: dict[str, Any] = {}
    for label, model in _DOCUMENTS.items():
        ref = getattr(marker.documents, label)
        got = contents[ref]
        if isinstance(got, _Unreadable):
            return f"its {label} {ref.digest}: {got.why}", got.marker_at_fault
        try:
            docs[label] = validate_document(model, parse_json(got, label), label)
        except BundleError as exc:  # whole and verified, yet not that document: the marker names the wrong blob
            return f"its {label} {ref.digest} is not a valid {label} ({exc})", True
    for label in ("manifest", "index"):
        if docs[label].bundle_id != marker.bundle_id:
            return (
                f"bundle_id {one_line(repr(marker.bundle_id), 80)} differs from {docs[label].bundle_id!r} in its "
                f"{label}",
                True,
            )
    anchor = Anchor.of(docs["index"].identity)
    if marker.anchor != anchor:
        return f"anchor {marker.anchor} differs from {anchor} in its index", True
    return None


def _read_documents(backend: Backend, refs: Sequence[DocRef]) -> dict[DocRef, bytes | _Unreadable]:
    """The verified content of each document, or why it cannot be had: records in one batch, chunks in another."""
    out: dict[DocRef, bytes | _Unreadable] = {}
    keys: dict[DocRef, str] = {}
    for ref in dict.fromkeys(refs):
        try:
            object_key(ref.digest)
            keys[ref] = object_key(ref.record)
        except TrajectoryReplayError as exc:
            out[ref] = _Unreadable(str(exc), True)
    values = fetch(backend, list(keys.values()))
    records: dict[DocRef, BlobRecord] = {}
    for ref, key in keys.items():
        data = values[key]
        if data is None:
            out[ref] = _Unreadable(f"missing record {key}", False)
            continue
        if len(data) > MAX_RECORD_BYTES or hash_bytes(data) != ref.record:
            out[ref] = _Unreadable(f"record {key} does not match its digest", False)
            continue
        try:
            record = BlobRecord.from_bytes(data, key)
        except TrajectoryReplayError as exc:
            out[ref] = _Unreadable(str(exc), False)
            continue
        if record.digest != ref.digest or record.size != ref.size:
            out[ref] = _Unreadable(
                f"record {key} describes {record.size} bytes of {record.digest}, not {ref.size} bytes of {ref.digest}",
                True,
            )
            continue
        try:
            check_document_size(record.size, key)
        except BundleError as exc:
            out[ref] = _Unreadable(str(exc), False)
            continue
        records[ref] = record
    chunks = fetch(backend, [object_key(c.digest) for r in records.values() for c in r.chunks])
    for ref, record in records.items():
        parts = []
        for chunk in record.chunks:
            data = chunks[object_key(chunk.digest)]
            if data is None or hash_bytes(data) != chunk.digest:
                out[ref] = _Unreadable(
                    f"{'missing' if data is None else 'corrupt'} chunk {object_key(chunk.digest)}", False
                )
                break
            parts.append(data)
        else:
            content = b"".join(parts)
            out[ref] = (
                content
                if hash_bytes(content) == ref.digest
                else _Unreadable(f"the chunks of record {keys[ref]} do not hash to {ref.digest}", False)
            )
    return out
