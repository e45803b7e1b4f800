"""`inspect`: what a bundle is and holds, including a bundle that is not complete (it says what is missing).

A bundle whose every rank landed but whose COMPLETE is missing is finalized first, as any reader does
(docs/format.md). A multi-rank bundle is shown as its cohort: the samples of every rank, each rank's count,
the payloads of one rank (the first) and the damage of all.

The markers, documents, blob records and blob refs are read from the backend itself, not the read
cache (which only gets filled), so one deleted or altered in the store shows as damage (per payload,
in the human report too) even where an earlier command left a sound copy in the cache. Chunks are
not read here; `validate` verifies them.
An unreadable payload's bytes are left out of the dedup figure: it describes what is stored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from trajectory_replay.backends import redact_url
from trajectory_replay.bundle.markers import RANKS_SHOWN, CompleteMarker, ranks_brief
from trajectory_replay.bundle.reader import BundleReader, native_readers
from trajectory_replay.bundle.redaction import unknown_fields
from trajectory_replay.bundle.resolve import V1, Bundle, open_bundle
from trajectory_replay.bundle.schema import STAGE_ORDER, PayloadSpec, RecomputeConfig
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    INCOMPLETE,
    BundleState,
    bundle_status,
    describe_missing,
    finalize,
)
from trajectory_replay.errors import BundleError, IncompleteBundleError, StorageUnavailableError, TrajectoryReplayError
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.store import BlobRecord, ObjectStore, blob_ref_key, object_key
from trajectory_replay.store.records import RecordError
from trajectory_replay.units import clip, fit, human_bytes, report_width


@dataclass
class Inspection(Outcome):
    """Everything `inspect` shows, as data (`--json` prints `to_dict()`)."""

    explains_incomplete = True
    """`inspect` explains an incomplete bundle: that is a healthy answer (exit 0), its status incomplete."""

    target: str
    state: str
    """complete | incomplete | finalizable (could not be finalized here) | invalid (an older-format bundle that
    does not open)"""
    bundle_id: str | None = None
    format: str = "native"
    detail: str = ""
    anchor: str | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)
    expected_ranks: list[int] = field(default_factory=list)
    stages: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    conventions: dict[str, Any] | None = None
    """The convention profile the producer built its config from (manifest `conventions`), if recorded."""
    samples: int = 0
    """Samples of the whole cohort (every rank shown)."""
    tokens: int = 0
    rank_samples: dict[str, int] = field(default_factory=dict)
    """Samples per rank of a multi-rank bundle."""
    payloads: list[dict[str, Any]] = field(default_factory=list)
    logical_bytes: int = 0
    unique_chunk_bytes: int | None = None
    unreadable_bytes: int = 0
    """Logical bytes of payloads whose record could not be read; not part of the dedup figure."""
    redaction: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """One line per damaged payload (record or blob ref missing or corrupt), of every shard."""

    @property
    def damaged(self) -> bool:
        return bool(self.problems)

    @property
    def dedup_ratio(self) -> float | None:
        """Readable logical bytes over the unique chunk bytes they are stored in (None when nothing is)."""
        if not self.unique_chunk_bytes:
            return None
        return (self.logical_bytes - self.unreadable_bytes) / self.unique_chunk_bytes

    @property
    def status(self) -> Status:
        """invalid (damaged, or an older-format bundle that does not open), incomplete (not finalized: exit 0 all
        the same, see `explains_incomplete`) or pass."""
        if self.damaged or self.state == "invalid":
            return Status.INVALID
        return Status.INCOMPLETE if self.state in (INCOMPLETE, FINALIZABLE) else Status.PASS

    def failures(self) -> list[str]:
        """The damage of an invalid bundle (else why it does not open); nothing for a healthy one."""
        return (self.problems or [self.detail]) if self.status is Status.INVALID else []

    def to_dict(self) -> dict[str, Any]:
        """Everything as data (the CLI adds the top-level `status`)."""
        return {**self.__dict__, "damaged": self.damaged, "dedup_ratio": self.dedup_ratio}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render_text(self, width: int | None = None) -> str:
        """The report; lines longer than `width` (default: the terminal's, no limit when piped) wrap under their
        value column and a payload name too long for its column ends in an ellipsis."""
        width = width or report_width()
        lines = [
            self._title(),
            *self._provenance_lines(),
            *self._config_lines(),
            *self._content_lines(),
            *self._payload_lines(width),
            *self._damage_lines(),
        ]
        return "\n".join(part for line in lines for part in fit(line, width, VALUE_COLUMN))

    def _title(self) -> str:
        """The first line: the bundle, its format and state, and how many problems it has."""
        count = len(self.problems)
        return (
            f"bundle {self.bundle_id or self.target} [{self.format}] — {self.state}"
            + (f": {self.detail}" if self.detail else "")
            + (f"; DAMAGED ({count} problem{'s' if count > 1 else ''})" if self.damaged else "")
        )

    def _provenance_lines(self) -> list[str]:
        """Where the bundle comes from: its anchor, its ranks, its producer, its weight lineage and topology."""
        lines = []
        if self.anchor:
            lines.append(f"  anchor     {self.anchor}")
        if self.expected_ranks:
            landed = "all landed" if self.ranks == self.expected_ranks else f"{ranks_text(self.ranks)} landed"
            lines.append(f"  ranks      {ranks_text(self.expected_ranks)} ({landed})")
        elif self.ranks:
            lines.append(f"  ranks      {ranks_text(self.ranks)}")
        if self.producer:
            lines.append(
                "  producer   " + ", ".join(f"{k}={v}" for k, v in self.producer.items() if v not in (None, ""))
            )
        if self.identity:
            lineage = self.identity.get("weight_lineage") or {}
            rank = self.identity.get("rank") or {}
            lines.append(
                f"  lineage    rollout_weight={value_text(lineage.get('rollout_weight'))} "
                f"actor_weight={value_text(lineage.get('actor_weight'))}; topology "
                + " ".join(f"{k}={value_text(v)}" for k, v in rank.items())
            )
        return lines

    def _config_lines(self) -> list[str]:
        """The recompute config's fields that differ from the defaults (the estimator always: the JSON has them
        all), and the convention profile it was built from."""
        lines = []
        if self.config:
            defaults = RecomputeConfig().model_dump(mode="json")
            shown = {k: v for k, v in self.config.items() if k == "advantage_estimator" or defaults.get(k, v) != v}
            lines.append("  config     " + ", ".join(f"{k}={value_text(v)}" for k, v in shown.items()))
        if self.conventions:
            c = self.conventions
            lines.append(
                f"  conventions profile {c.get('profile')} ({c.get('framework')} {c.get('framework_version')})"
            )
        return lines

    def _content_lines(self) -> list[str]:
        """What the bundle holds: its samples and tokens (per rank), its stages and its redaction policy."""
        lines = []
        if self.samples or self.rank_samples:
            per_rank = ""
            if len(self.rank_samples) > 1:
                per_rank = "; " + ", ".join(f"rank {r}: {n}" for r, n in self.rank_samples.items())
            lines.append(f"  samples    {self.samples} ({self.tokens} response tokens{per_rank})")
        lines += [f"  stage      {stage:<22} {cap}" for stage, cap in self.stages.items()]
        if self.redaction:
            unknown = set(unknown_fields(self.redaction))
            lines.append(
                "  redaction  "
                + ", ".join(
                    f"{k}={v}" + (" (not a redactable field: was not applied)" if k in unknown else "")
                    for k, v in self.redaction.items()
                )
            )
        return lines

    def _payload_lines(self, width: int | None) -> list[str]:
        """One line per payload (its name clipped to its column when the report has a `width`), then the total."""
        lines = []
        for p in self.payloads:
            chunks = f", {p['chunks']} chunks" if p.get("chunks") is not None else ""
            damage = "".join(
                f"  {label}: {p[key]}"
                for key, label in (("error", "UNREADABLE"), ("ref_error", "DAMAGED"))
                if p.get(key)
            )
            shape = "[" + ", ".join(map(str, p["shape"])) + "]"
            name = clip(p["name"], None if width is None else 16)
            lines.append(
                f"  payload    {name:<16} {p['role']:<8} {p['dtype']:<14} {shape:<12} "
                f"{human_bytes(p['size'])}{chunks}{damage}"
            )
        if self.payloads:
            lines.append(self._total())
        return lines

    def _total(self) -> str:
        """The payloads' logical bytes, the unreadable ones among them and the unique chunk bytes (the dedup)."""
        unreadable = f" ({human_bytes(self.unreadable_bytes)} unreadable)" if self.unreadable_bytes else ""
        dedup = ""
        if self.dedup_ratio is not None:
            of = (
                f" of the {human_bytes(self.logical_bytes - self.unreadable_bytes)} readable"
                if self.unreadable_bytes
                else ""
            )
            dedup = (
                f", {human_bytes(self.unique_chunk_bytes or 0)} in unique chunks (dedup {self.dedup_ratio:.2f}x{of})"
            )
        shown = f" (rank {self.ranks[0]})" if len(self.rank_samples) > 1 and self.ranks else ""
        return f"  total      {human_bytes(self.logical_bytes)} of payloads{shown}{unreadable}{dedup}"

    def _damage_lines(self) -> list[str]:
        """The problems no payload line shows (other shards' damage), and how to repair a damaged bundle."""
        shown = {f"payload {p['name']!r}" for p in self.payloads}
        lines = [f"  damage     {problem}" for problem in self.problems if problem.split(":", 1)[0] not in shown]
        if self.damaged:
            lines.append(
                "  damage     run `trajectory-replay fsck` on the store root: it re-links a missing blob ref; "
                "--repair-from URL re-fetches missing or corrupt objects from a copy"
            )
        return lines


VALUE_COLUMN = len("  payload    ")
"""Where the values of the report's `label  value` lines start: a wrapped line continues there."""


@dataclass
class _PayloadState:
    """What the store holds for one payload: its verified record, or why it cannot be read; and what is wrong
    with its blob ref (the bytes stay readable through the manifest's record, but cp refuses the bundle)."""

    record: BlobRecord | None = None
    error: str | None = None
    ref_error: str | None = None


def _record_problem(
    digest: str, record_digest: str, size: int, got: BlobRecord | RecordError | None
) -> BlobRecord | str:
    """The record `record_digest` of blob `digest` as the store read it, or a one-line reason it is not usable."""
    key = object_key(record_digest)
    if got is None:
        return f"record {key} is missing"
    if not isinstance(got, BlobRecord):
        return f"record {key} is corrupt ({got.reason})"
    if got.digest != digest:
        return f"record {key} describes blob {got.digest}, not {digest}"
    if size >= 0 and got.size != size:
        return f"record {key} says {got.size} bytes, the manifest {size}"
    return got


def _payload_states(store: ObjectStore, payloads: dict[str, PayloadSpec]) -> dict[str, _PayloadState]:
    """Read every payload's record and blob ref through the store's inventory, which reads the backend itself
    (a read cache would hide a record deleted or altered in the store)."""
    states = {name: _PayloadState() for name in payloads}
    usable: dict[str, tuple[str, str, int]] = {}  # name -> the blob's digest, its record's digest, its size
    for name, spec in payloads.items():
        if spec.digest is None or spec.record is None:
            states[name].error = "no digest in the manifest"
        else:
            usable[name] = (spec.digest, spec.record, spec.size)
    inventory = store.inventory
    records = inventory.records(record for _, record, _ in usable.values())
    refs = inventory.read_refs(digest for digest, _, _ in usable.values())
    other_records: dict[str, str] = {}
    for name, (digest, record, size) in usable.items():
        state = states[name]
        got = _record_problem(digest, record, size, records[record])
        if isinstance(got, BlobRecord):
            state.record = got
        else:
            state.error = got
        ref_key, named = blob_ref_key(digest), refs[digest]
        if named is None:
            state.ref_error = f"blob ref {ref_key} is missing"
            continue
        if not isinstance(named, str):
            state.ref_error = f"blob ref {ref_key} is corrupt ({named})"
            continue
        if named != record:
            # a writer that lost a race names the record the winner stored; the ref then names another record
            # of the same blob, which must be sound too
            other_records[name] = named
    if other_records:
        more = inventory.records(other_records.values())
        for name, record_digest in other_records.items():
            digest, _, size = usable[name]
            got = _record_problem(digest, record_digest, size, more[record_digest])
            if not isinstance(got, BlobRecord):
                states[name].ref_error = f"blob ref {blob_ref_key(digest)} names a bad record: {got}"
    return states


def _problems(states: dict[str, _PayloadState], prefix: str = "") -> list[str]:
    out = []
    for name, state in states.items():
        for what in (state.error, state.ref_error):
            if what:
                out.append(f"{prefix}payload {name!r}: {what}")
    return out


def _fill_from_source(out: Inspection, source, store: ObjectStore | None) -> None:
    out.bundle_id = source.bundle_id
    ident = source.index.identity
    out.anchor = ident.anchor()
    out.identity = ident.model_dump(mode="json")
    out.producer = source.manifest.producer.model_dump(mode="json")
    contracts = source.manifest.stage_contracts
    out.stages = {str(k): str(contracts[k].capability) for k in STAGE_ORDER if k in contracts}
    out.config = source.index.config.model_dump(mode="json")
    conventions = getattr(source.manifest, "conventions", None)
    out.conventions = conventions.model_dump(mode="json") if conventions is not None else None
    out.samples = len(source.index.samples)
    out.tokens = sum(max(s.response_length, 0) for s in source.index.samples)
    out.redaction = dict(source.manifest.redaction)
    states = _payload_states(store, source.manifest.payloads) if store is not None else {}
    seen: dict[str, int] = {}
    for name, spec in source.manifest.payloads.items():
        entry = {
            "name": name,
            "role": spec.role,
            "dtype": spec.dtype,
            "shape": spec.shape,
            "size": spec.size,
            "digest": spec.digest,
            "codec": spec.codec,
        }
        state = states.get(name)
        if state is not None:
            entry["readable"] = state.record is not None
            if state.record is not None:
                entry["chunks"] = len(state.record.chunks)
                seen.update((c.digest, c.size) for c in state.record.chunks)
            else:
                entry["error"] = state.error
                out.unreadable_bytes += spec.size
            if state.ref_error:
                entry["ref_error"] = state.ref_error
        out.payloads.append(entry)
        out.logical_bytes += spec.size
    if store is not None:
        out.unique_chunk_bytes = sum(seen.values())
        out.problems += _problems(states)


def _check_shards(out: Inspection, store: ObjectStore | None, first, open_rank, ranks) -> None:
    """Count the samples of every rank of a multi-rank bundle (`first` is the one shown) and add the damage of
    the other shards to `out.problems`; a shard whose documents cannot be read is one problem, not a failure of
    the whole report."""
    if first.rank is None:
        return
    out.rank_samples[str(first.rank)] = len(first.index.samples)
    for rank in ranks:
        try:
            reader = open_rank(rank)
        except StorageUnavailableError:
            raise
        except TrajectoryReplayError as exc:
            out.problems.append(f"rank {rank}: {exc}")
            continue
        samples = reader.index.samples
        out.rank_samples[str(rank)] = len(samples)
        out.samples += len(samples)
        out.tokens += sum(max(s.response_length, 0) for s in samples)
        if store is not None:
            out.problems += _problems(_payload_states(store, reader.manifest.payloads), f"rank {rank}: ")
    out.rank_samples = dict(sorted(out.rank_samples.items(), key=lambda kv: int(kv[0])))


def ranks_text(ranks) -> str:
    """`0, 1, 2`: ranks as a person writes them ('none' for no rank); a long list abbreviated (`ranks_brief`)."""
    ranks = [r for r in ranks if r is not None]
    if len(ranks) > RANKS_SHOWN:
        return ranks_brief(ranks)
    return ", ".join(map(str, ranks)) or "none"


def value_text(value: Any) -> str:
    """A document value for the human report: `unset` for a missing one, lists without brackets of quotes."""
    if value is None or value == "":
        return "unset"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return str(value)


def inspect_bundle(
    path_or_url: str | os.PathLike,
    *,
    step: str | None = None,
    rollout: int | None = None,
    critic: str | None = None,
    **storage_options: Any,
) -> Inspection:
    """Inspect the native or older-format bundle an address designates (`open_bundle` without choosing among a
    store root's bundles); one that is not complete is described, not refused."""
    # the server's copy of every marker, document and record (all small), never this host's read cache: a
    # cached copy is right for its digest and would hide the same object damaged in the store
    storage_options.setdefault("trust_cache", False)
    bundle = open_bundle(path_or_url, step=step, rollout=rollout, critic=critic, choose=False, **storage_options)
    if bundle.format == V1:
        return _inspect_older(bundle)
    store, name = bundle.store, bundle.name
    assert store is not None
    out = Inspection(redact_url(bundle.target), COMPLETE_STATUS, bundle_id=name)
    state = bundle_status(store.backend, name)
    if state is not None and state.status == FINALIZABLE:
        state = finalize(store.backend, state)
        if state.status == COMPLETE_STATUS:
            out.detail = "finalized now: every rank had landed and COMPLETE was missing"
    if state is None or state.complete is None:
        return _inspect_unfinished(out, store, name, state)
    marker = state.complete
    readers = native_readers(store, name, bundle.rank, marker)
    _fill_from_source(out, readers[0], store)
    if readers[0].rank is not None and len(readers) == 1:  # one rank addressed: the cohort is every rank
        others = {r.rank: r for r in readers[0].peers()}
    else:
        others = {r.rank: r for r in readers[1:]}
    _check_shards(out, store, readers[0], others.__getitem__, list(others))
    out.ranks = [int(r) for r in marker.shards] if marker.multi_rank else []
    out.expected_ranks = marker.expected_ranks if marker.multi_rank else []
    return out


def _inspect_older(bundle: Bundle) -> Inspection:
    out = Inspection(redact_url(bundle.target), COMPLETE_STATUS, format=V1)
    try:
        sources = bundle.readers()
    except BundleError as exc:
        out.state = INCOMPLETE if isinstance(exc, IncompleteBundleError) else "invalid"
        out.detail = str(exc)
        return out
    _fill_from_source(out, sources[0], None)
    out.ranks = [s.rank for s in sources if s.rank is not None]
    by_rank = {s.rank: s for s in sources[1:]}
    _check_shards(out, None, sources[0], by_rank.__getitem__, list(by_rank))
    return out


def _inspect_unfinished(out: Inspection, store: ObjectStore, name: str, state: BundleState | None) -> Inspection:
    """A native bundle without its final COMPLETE: what is missing, and the shards that landed, described as a
    reader would see them (documents are committed before a rank marker)."""
    out.detail = describe_missing(store.backend, name, state)  # NoSuchTargetError when it is no bundle at all
    if state is None or not state.rank_markers:
        out.state = INCOMPLETE
        return out
    out.ranks, out.expected_ranks = state.landed_ranks, state.expected_ranks
    if state.missing_ranks:
        out.state = INCOMPLETE
    else:  # every rank landed, yet it is not finalized (here): say why
        out.state = FINALIZABLE
        if state.status == CORRUPT:
            out.problems.append(state.detail)
            out.detail = "every rank landed and COMPLETE is missing; the rank markers cannot be finalized"
        else:
            out.detail = state.detail
    markers = [state.rank_markers[r] for r in out.ranks]
    shard = CompleteMarker(
        bundle_id=markers[0].bundle_id,
        anchor=markers[0].anchor,
        expected_ranks=out.expected_ranks,
        multi_rank=True,
        shards={str(r): m.documents for r, m in zip(out.ranks, markers)},
    )
    first = BundleReader(store, name, shard, out.ranks[0])
    _fill_from_source(out, first, store)
    _check_shards(out, store, first, lambda r: BundleReader(store, name, shard, r), out.ranks[1:])
    return out
