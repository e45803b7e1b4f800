"""`inspect`: what a bundle is and holds, including a bundle that is not complete (it says what is missing)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trajectory_replay.backends import redact_url
from trajectory_replay.bundle.markers import RankMarker, landed_ranks, rank_key, read_complete, read_marker
from trajectory_replay.bundle.paths import split_bundle_path
from trajectory_replay.bundle.schema import STAGE_ORDER
from trajectory_replay.errors import BundleError, TrajectoryReplayError
from trajectory_replay.store import ObjectStore


@dataclass
class Inspection:
    """Everything `inspect` shows, as data (`--json` prints `to_dict()`)."""

    target: str
    status: str
    """complete | incomplete | finalizable"""
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
    tokens: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=list)
    logical_bytes: int = 0
    unique_chunk_bytes: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render_text(self) -> str:
        lines = [f"bundle {self.bundle_id or self.target} [{self.format}] — {self.status}"
                 + (f": {self.detail}" if self.detail else "")]
        if self.anchor:
            lines.append(f"  anchor     {self.anchor}")
        if self.expected_ranks:
            lines.append(f"  ranks      landed {self.ranks} of {self.expected_ranks}")
        if self.producer:
            lines.append("  producer   " + ", ".join(f"{k}={v}" for k, v in self.producer.items() if v is not None))
        if self.identity:
            lineage = self.identity.get("weight_lineage") or {}
            rank = self.identity.get("rank") or {}
            lines.append(f"  lineage    rollout_weight={lineage.get('rollout_weight')} "
                         f"actor_weight={lineage.get('actor_weight')}; topology " +
                         " ".join(f"{k}={v}" for k, v in rank.items()))
        if self.config:
            lines.append("  config     " + ", ".join(f"{k}={v}" for k, v in self.config.items()))
        if self.samples:
            lines.append(f"  samples    {self.samples} ({self.tokens} response tokens)")
        for stage, cap in self.stages.items():
            lines.append(f"  stage      {stage:<22} {cap}")
        for p in self.payloads:
            chunks = f", {p['chunks']} chunks" if p.get("chunks") is not None else ""
            lines.append(f"  payload    {p['name']:<16} {p['role']:<8} {p['dtype']:<14} {str(p['shape']):<12} "
                         f"{p['size']} bytes{chunks}")
        if self.payloads:
            dedup = ""
            if self.unique_chunk_bytes:
                dedup = f", {self.unique_chunk_bytes} in unique chunks (dedup {self.logical_bytes / self.unique_chunk_bytes:.2f}x)"
            lines.append(f"  total      {self.logical_bytes} payload bytes{dedup}")
        return "\n".join(lines)


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
    seen: dict[str, int] = {}
    for name, spec in source.manifest.payloads.items():
        entry = {"name": name, "role": spec.role, "dtype": spec.dtype, "shape": spec.shape, "size": spec.size,
                 "digest": spec.digest, "codec": spec.codec}
        if store is not None and spec.digest and spec.record:
            try:
                record = store.record(source.payload_ref(name))
                entry["chunks"] = len(record.chunks)
                for c in record.chunks:
                    seen[c.digest] = c.size
            except TrajectoryReplayError as exc:
                entry["error"] = str(exc)
        out.payloads.append(entry)
        out.logical_bytes += spec.size
    if store is not None:
        out.unique_chunk_bytes = sum(seen.values())


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
                out.status, out.detail = "incomplete" if "COMPLETE" in str(exc) else "invalid", str(exc)
                return out
            _fill_from_source(out, sources[0], None)
            out.ranks = [s.rank for s in sources if s.rank is not None]
            return out
    from trajectory_replay.bundle.reader import BundleReader, describe_missing, open_native

    root, name, rank = split_bundle_path(text)
    store = ObjectStore.open(root, **storage_options)
    out = Inspection(redact_url(text), "complete", bundle_id=name)
    marker = read_complete(store.backend, name)
    if marker is None:
        landed = landed_ranks(store.backend, name)
        out.detail = describe_missing(store, name)
        if not landed:
            out.status = "incomplete"
            return out
        markers = [read_marker(store.backend, rank_key(name, r), RankMarker) for r in landed]
        out.ranks = landed
        out.expected_ranks = markers[0].expected_ranks  # type: ignore[union-attr]
        missing = [r for r in out.expected_ranks if r not in landed]
        out.status = "incomplete" if missing else "finalizable"
        if not missing:
            out.detail = "every rank landed and COMPLETE is missing; a reader, ls or fsck will finalize it"
        from trajectory_replay.bundle.markers import CompleteMarker

        # describe the landed shard as a reader would (documents are committed before a rank marker)
        shard = CompleteMarker(bundle_id=markers[0].bundle_id, anchor=markers[0].anchor,  # type: ignore[union-attr]
                               expected_ranks=out.expected_ranks, multi_rank=True,
                               shards={str(landed[0]): markers[0].documents})  # type: ignore[union-attr]
        _fill_from_source(out, BundleReader(store, name, shard, landed[0]), store)
        return out
    readers = open_native(text, store=store)
    _fill_from_source(out, readers[0], store)
    out.ranks = [int(r) for r in marker.shards] if marker.multi_rank else []
    out.expected_ranks = marker.expected_ranks if marker.multi_rank else []
    return out
