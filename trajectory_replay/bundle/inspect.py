"""`inspect`: what a bundle is and holds, including a bundle that is not complete (it says what is missing).

A bundle whose every rank landed but whose COMPLETE is missing is finalized first, as any reader does
(docs/format.md). A multi-rank bundle is shown as its cohort: the samples of every rank, each rank's count,
the payloads of one rank (the first) and the damage of all.

Each payload's blob record and blob ref are read from the backend itself, not the read cache, so a
record deleted or altered in the store shows as damage (per payload, in the human report too)
rather than as a payload without chunks. Chunks are not read here; `validate` verifies them.
An unreadable payload's bytes are left out of the dedup figure: it describes what is stored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trajectory_replay.backends import redact_url
from trajectory_replay.bundle.markers import (
    RankMarker, landed_ranks, rank_key, read_complete, read_marker, try_finalize,
)
from trajectory_replay.bundle.paths import split_bundle_path
from trajectory_replay.bundle.redaction import unknown_fields
from trajectory_replay.bundle.schema import STAGE_ORDER, PayloadSpec
from trajectory_replay.errors import (
    BackendError, BundleError, IncompleteBundleError, NotFoundError, StorageUnavailableError, TrajectoryReplayError,
)
from trajectory_replay.store import BlobRecord, ObjectStore, blob_ref_key, hash_bytes, object_key, parse_digest
from trajectory_replay.store.objectstore import MAX_RECORD_BYTES
from trajectory_replay.units import human_bytes


@dataclass
class Inspection:
    """Everything `inspect` shows, as data (`--json` prints `to_dict()`)."""

    target: str
    state: str
    """complete | incomplete | finalizable (could not be finalized here) | invalid (an older-format bundle that
    does not open)"""
    bundle_id: Optional[str] = None
    format: str = "native"
    detail: str = ""
    anchor: Optional[str] = None
    identity: dict[str, Any] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)
    expected_ranks: list[int] = field(default_factory=list)
    stages: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    samples: int = 0
    """Samples of the whole cohort (every rank shown)."""
    tokens: int = 0
    rank_samples: dict[str, int] = field(default_factory=dict)
    """Samples per rank of a multi-rank bundle."""
    payloads: list[dict[str, Any]] = field(default_factory=list)
    logical_bytes: int = 0
    unique_chunk_bytes: Optional[int] = None
    unreadable_bytes: int = 0
    """Logical bytes of payloads whose record could not be read; not part of the dedup figure."""
    redaction: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """One line per damaged payload (record or blob ref missing or corrupt), of every shard."""

    @property
    def damaged(self) -> bool:
        return bool(self.problems)

    @property
    def dedup_ratio(self) -> Optional[float]:
        """Readable logical bytes over the unique chunk bytes they are stored in (None when nothing is)."""
        if not self.unique_chunk_bytes:
            return None
        return (self.logical_bytes - self.unreadable_bytes) / self.unique_chunk_bytes

    @property
    def exit_code(self) -> int:
        """0 for a healthy bundle, complete or not (inspect explains an incomplete one); 1 when damaged or
        invalid."""
        return 1 if self.damaged or self.state == "invalid" else 0

    @property
    def outcome(self) -> str:
        """The `--json` status: pass, incomplete or invalid."""
        if self.damaged or self.state == "invalid":
            return "invalid"
        return "incomplete" if self.state in ("incomplete", "finalizable") else "pass"

    def to_dict(self) -> dict[str, Any]:
        """Everything as data (the CLI adds the top-level `status`: see `outcome`)."""
        return {**self.__dict__, "damaged": self.damaged, "dedup_ratio": self.dedup_ratio}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render_text(self) -> str:
        lines = [f"bundle {self.bundle_id or self.target} [{self.format}] — {self.state}"
                 + (f": {self.detail}" if self.detail else "")
                 + (f"; DAMAGED ({len(self.problems)} problem{'s' if len(self.problems) > 1 else ''})"
                    if self.damaged else "")]
        if self.anchor:
            lines.append(f"  anchor     {self.anchor}")
        if self.expected_ranks:
            landed = "all landed" if self.ranks == self.expected_ranks else f"{ranks_text(self.ranks)} landed"
            lines.append(f"  ranks      {ranks_text(self.expected_ranks)} ({landed})")
        elif self.ranks:
            lines.append(f"  ranks      {ranks_text(self.ranks)}")
        if self.producer:
            lines.append("  producer   " + ", ".join(f"{k}={v}" for k, v in self.producer.items()
                                                      if v not in (None, "")))
        if self.identity:
            lineage = self.identity.get("weight_lineage") or {}
            rank = self.identity.get("rank") or {}
            lines.append(f"  lineage    rollout_weight={value_text(lineage.get('rollout_weight'))} "
                         f"actor_weight={value_text(lineage.get('actor_weight'))}; topology " +
                         " ".join(f"{k}={value_text(v)}" for k, v in rank.items()))
        if self.config:
            lines.append("  config     " + ", ".join(f"{k}={value_text(v)}" for k, v in self.config.items()))
        if self.samples or self.rank_samples:
            per_rank = ""
            if len(self.rank_samples) > 1:
                per_rank = "; " + ", ".join(f"rank {r}: {n}" for r, n in self.rank_samples.items())
            lines.append(f"  samples    {self.samples} ({self.tokens} response tokens{per_rank})")
        for stage, cap in self.stages.items():
            lines.append(f"  stage      {stage:<22} {cap}")
        if self.redaction:
            unknown = set(unknown_fields(self.redaction))
            lines.append("  redaction  " + ", ".join(
                f"{k}={v}" + (" (not a redactable field: was not applied)" if k in unknown else "")
                for k, v in self.redaction.items()))
        for p in self.payloads:
            chunks = f", {p['chunks']} chunks" if p.get("chunks") is not None else ""
            damage = "".join(f"  {label}: {p[key]}" for key, label in (("error", "UNREADABLE"),
                                                                         ("ref_error", "DAMAGED")) if p.get(key))
            shape = "[" + ", ".join(map(str, p["shape"])) + "]"
            lines.append(f"  payload    {p['name']:<16} {p['role']:<8} {p['dtype']:<14} {shape:<12} "
                         f"{human_bytes(p['size'])}{chunks}{damage}")
        if self.payloads:
            unreadable = f" ({human_bytes(self.unreadable_bytes)} unreadable)" if self.unreadable_bytes else ""
            dedup = ""
            if self.dedup_ratio is not None:
                of = (f" of the {human_bytes(self.logical_bytes - self.unreadable_bytes)} readable"
                      if self.unreadable_bytes else "")
                dedup = (f", {human_bytes(self.unique_chunk_bytes or 0)} in unique chunks "
                         f"(dedup {self.dedup_ratio:.2f}x{of})")
            shown = f" (rank {self.ranks[0]})" if len(self.rank_samples) > 1 and self.ranks else ""
            lines.append(f"  total      {human_bytes(self.logical_bytes)} of payloads{shown}{unreadable}{dedup}")
        shown = {f"payload {p['name']!r}" for p in self.payloads}
        for problem in self.problems:
            if problem.split(":", 1)[0] not in shown:  # other shards' damage has no payload line above
                lines.append(f"  damage     {problem}")
        if self.damaged:
            lines.append("  damage     run `trajectory-replay fsck` on the store root: it re-links a missing blob ref; "
                         "--repair-from URL re-fetches missing or corrupt objects from a copy")
        return "\n".join(lines)


@dataclass
class _PayloadState:
    """What the store holds for one payload: its verified record, or why it cannot be read; and what is wrong
    with its blob ref (the bytes stay readable through the manifest's record, but cp refuses the bundle)."""

    record: Optional[BlobRecord] = None
    error: Optional[str] = None
    ref_error: Optional[str] = None


def _read_keys(backend, keys: list[str]) -> dict[str, Optional[bytes]]:
    """The values of `keys` (None when absent): one concurrent batch, key by key only when one is missing."""
    keys = list(dict.fromkeys(keys))
    try:
        return dict(zip(keys, backend.read_many(keys)))
    except NotFoundError:
        pass
    out: dict[str, Optional[bytes]] = {}
    for key in keys:
        try:
            out[key] = backend.read(key)
        except NotFoundError:
            out[key] = None
    return out


def _record_problem(digest: str, record_digest: str, size: int, data: Optional[bytes]) -> BlobRecord | str:
    """The verified record `objects/<record_digest>` of blob `digest`, or a one-line reason it is not usable."""
    key = object_key(record_digest)
    if data is None:
        return f"record {key} is missing"
    if len(data) > MAX_RECORD_BYTES:
        return f"record {key} is corrupt ({len(data)} bytes, over the bound)"
    actual = hash_bytes(data)
    if actual != record_digest:
        return f"record {key} is corrupt (content hashes to {actual})"
    try:
        record = BlobRecord.from_bytes(data, record_digest)
    except TrajectoryReplayError as exc:
        return f"record {key} is corrupt ({exc})"
    if record.digest != digest:
        return f"record {key} describes blob {record.digest}, not {digest}"
    if size >= 0 and record.size != size:
        return f"record {key} says {record.size} bytes, the manifest {size}"
    return record


def _payload_states(store: ObjectStore, payloads: dict[str, PayloadSpec]) -> dict[str, _PayloadState]:
    """Read every payload's record and blob ref straight from the backend (a read cache would hide a record
    deleted or altered in the store)."""
    states = {name: _PayloadState() for name in payloads}
    usable = {}
    for name, spec in payloads.items():
        if spec.digest is None or spec.record is None:
            states[name].error = "no digest in the manifest"
        else:
            usable[name] = spec
    keys = [k for spec in usable.values() for k in (object_key(spec.record), blob_ref_key(spec.digest))]
    values = _read_keys(store.backend, keys) if keys else {}
    other_records: dict[str, str] = {}
    for name, spec in usable.items():
        state = states[name]
        got = _record_problem(spec.digest, spec.record, spec.size, values[object_key(spec.record)])
        if isinstance(got, BlobRecord):
            state.record = got
        else:
            state.error = got
        ref_key, ref = blob_ref_key(spec.digest), values[blob_ref_key(spec.digest)]
        if ref is None:
            state.ref_error = f"blob ref {ref_key} is missing"
            continue
        named = ref.decode("ascii", errors="replace").strip()
        try:
            parse_digest(named)
        except TrajectoryReplayError:
            state.ref_error = f"blob ref {ref_key} is corrupt (does not hold a digest)"
            continue
        if named != spec.record:
            # a writer that lost a race names the record the winner stored; the ref then names another record
            # of the same blob, which must be sound too
            other_records[name] = named
    if other_records:
        more = _read_keys(store.backend, [object_key(r) for r in other_records.values()])
        for name, record_digest in other_records.items():
            spec = usable[name]
            got = _record_problem(spec.digest, record_digest, spec.size, more[object_key(record_digest)])
            if not isinstance(got, BlobRecord):
                states[name].ref_error = f"blob ref {blob_ref_key(spec.digest)} names a bad record: {got}"
    return states


def _problems(states: dict[str, _PayloadState], prefix: str = "") -> list[str]:
    out = []
    for name, state in states.items():
        for what in (state.error, state.ref_error):
            if what:
                out.append(f"{prefix}payload {name!r}: {what}")
    return out


def _fill_from_source(out: Inspection, source, store: Optional[ObjectStore]) -> None:
    out.bundle_id = source.bundle_id
    ident = source.index.identity
    out.anchor = ident.anchor()
    out.identity = ident.model_dump(mode="json")
    out.producer = source.manifest.producer.model_dump(mode="json")
    contracts = source.manifest.stage_contracts
    out.stages = {str(k): str(contracts[k].capability) for k in STAGE_ORDER if k in contracts}
    out.config = source.index.config.model_dump(mode="json")
    out.samples = len(source.index.samples)
    out.tokens = sum(max(s.response_length, 0) for s in source.index.samples)
    out.redaction = dict(source.manifest.redaction)
    states = _payload_states(store, source.manifest.payloads) if store is not None else {}
    seen: dict[str, int] = {}
    for name, spec in source.manifest.payloads.items():
        entry = {"name": name, "role": spec.role, "dtype": spec.dtype, "shape": spec.shape, "size": spec.size,
                 "digest": spec.digest, "codec": spec.codec}
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


def _check_shards(out: Inspection, store: Optional[ObjectStore], first, open_rank, ranks) -> None:
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
    """`0, 1, 2`: ranks as a person writes them ('none' for no rank)."""
    return ", ".join(str(r) for r in ranks if r is not None) or "none"


def value_text(value: Any) -> str:
    """A document value for the human report: `unset` for a missing one, lists without brackets of quotes."""
    if value is None or value == "":
        return "unset"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return str(value)


def inspect_bundle(path_or_url: str | os.PathLike, **storage_options: Any) -> Inspection:
    """Inspect a native or older-format bundle; an incomplete native bundle is described, not refused."""
    text = os.fspath(path_or_url)
    if "://" not in text or text.startswith("file://"):
        from trajectory_replay.bundle import legacy

        local = Path(text.removeprefix("file://")).expanduser()
        if legacy.is_v1_bundle(local):
            out = Inspection(redact_url(text), "complete", format="v1")
            try:
                sources = legacy.open_v1(local)
            except BundleError as exc:
                out.state = "incomplete" if isinstance(exc, IncompleteBundleError) else "invalid"
                out.detail = str(exc)
                return out
            _fill_from_source(out, sources[0], None)
            out.ranks = [s.rank for s in sources if s.rank is not None]
            by_rank = {s.rank: s for s in sources[1:]}
            _check_shards(out, None, sources[0], by_rank.__getitem__, list(by_rank))
            return out
    from trajectory_replay.bundle.reader import BundleReader, describe_missing, open_native

    root, name, rank = split_bundle_path(text)
    store = ObjectStore.open(root, **storage_options)
    out = Inspection(redact_url(text), "complete", bundle_id=name)
    marker = read_complete(store.backend, name)
    unfinalized = ""
    if marker is None and landed_ranks(store.backend, name):
        try:
            marker = try_finalize(store.backend, name)
        except StorageUnavailableError:
            raise
        except (BackendError, OSError) as exc:  # this store or this user cannot write markers
            unfinalized = f"every rank landed and COMPLETE is missing; not finalized here: {exc}"
        except TrajectoryReplayError as exc:
            out.problems.append(str(exc))
            unfinalized = "every rank landed and COMPLETE is missing; the rank markers cannot be finalized"
        if marker is not None:
            out.detail = "finalized now: every rank had landed and COMPLETE was missing"
    if marker is None:
        landed = landed_ranks(store.backend, name)
        out.detail = describe_missing(store, name)
        if not landed:
            out.state = "incomplete"
            return out
        markers = [read_marker(store.backend, rank_key(name, r), RankMarker) for r in landed]
        out.ranks = landed
        out.expected_ranks = markers[0].expected_ranks  # type: ignore[union-attr]
        missing = [r for r in out.expected_ranks if r not in landed]
        out.state = "incomplete" if missing else "finalizable"
        if not missing:
            out.detail = unfinalized
        from trajectory_replay.bundle.markers import CompleteMarker

        # describe the landed shard as a reader would (documents are committed before a rank marker)
        shard = CompleteMarker(bundle_id=markers[0].bundle_id, anchor=markers[0].anchor,  # type: ignore[union-attr]
                               expected_ranks=out.expected_ranks, multi_rank=True,
                               shards={str(r): m.documents for r, m in zip(landed, markers)  # type: ignore
                                       if m is not None})
        first = BundleReader(store, name, shard, landed[0])
        _fill_from_source(out, first, store)
        _check_shards(out, store, first, lambda r: BundleReader(store, name, shard, r),
                      [r for r, m in zip(landed[1:], markers[1:]) if m is not None])
        return out
    readers = open_native(text, store=store)
    _fill_from_source(out, readers[0], store)
    if readers[0].rank is not None and len(readers) == 1:  # one rank addressed: the cohort is every rank
        others = {r.rank: r for r in readers[0].peers()}
    else:
        others = {r.rank: r for r in readers[1:]}
    _check_shards(out, store, readers[0], others.__getitem__, list(others))
    out.ranks = [int(r) for r in marker.shards] if marker.multi_rank else []
    out.expected_ranks = marker.expected_ranks if marker.multi_rank else []
    return out
