"""`export`: write a native bundle out as a self-contained directory in the older V1 layout.

The inverse of `import`: loss masks go back into the index records (`full_index()`), and each
payload's verified bytes go out as they are stored, with the dtype and shape of its checked header:
`bundle.legacy` wraps them in torch.save's format without torch (export does no math, so it runs
where torch is not installed) and writes the directory (payloads, documents, then COMPLETE last;
per rank and a cohort COMPLETE for a multi-rank bundle). Importing the result gives a bundle that
replays with the same verdicts.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trajectory_replay.bundle import legacy
from trajectory_replay.bundle.reader import BundleReader, open_native
from trajectory_replay.bundle.torchsave import RawTensor
from trajectory_replay.bundle.writer import LOSS_MASK
from trajectory_replay.errors import BundleError, TrajectoryReplayError
from trajectory_replay.ops.progress import Progress
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.units import human_bytes


@dataclass
class ExportReport(Outcome):
    """The bundle written in the older layout."""

    bundle: str
    out_dir: str
    bundle_id: str
    ranks: list[int | None] = field(default_factory=list)
    payloads: int = 0
    bytes: int = 0

    @property
    def status(self) -> Status:
        """Always pass: a bundle that cannot be exported is an error."""
        return Status.PASS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render_text(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks if r is not None)
        ranks = f" (ranks {ranks})" if ranks else ""
        return (
            f"exported {self.bundle_id}{ranks} to {self.out_dir}: {self.payloads} payloads, "
            f"{human_bytes(self.bytes)} of payloads (V1 layout)"
        )


def export_bundle(
    bundle: str | os.PathLike, out_dir: str | os.PathLike, *, progress: Progress | None = None, **storage_options: Any
) -> ExportReport:
    """Write the native bundle at `bundle` to `out_dir` (new or empty) as a V1 bundle directory."""
    progress = progress or Progress()
    target = Path(out_dir).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise BundleError(f"{target}: exists and is not an empty directory; export writes a new bundle directory")
    sources = open_native(os.fspath(bundle), **storage_options)
    report = ExportReport(os.fspath(bundle), str(target), sources[0].bundle_id, [s.rank for s in sources])
    progress.phase(
        "export",
        objects=sum(len(_payload_names(s)) for s in sources),
        nbytes=sum(s.spec(n).size for s in sources for n in _payload_names(s)),
    )
    shards = {}
    for source in sources:
        payloads = {}
        for name in _payload_names(source):
            payloads[name] = _raw_payload(source, name)
            size = source.spec(name).size
            report.payloads += 1
            report.bytes += size
            progress.advance(1, size)
        shards[source.rank] = (source.manifest, source.full_index(), source.expected, payloads)
    if sources[0].rank is None:
        manifest, index, expected, payloads = shards[None]
        legacy.write_v1_bundle(target, manifest, index, expected, payloads)
    else:
        legacy.write_v1_multirank(
            target, {r: shard for r, shard in shards.items() if r is not None}, sources[0].marker.expected_ranks
        )
    return report


def _raw_payload(source: BundleReader, name: str) -> RawTensor:
    """Payload `name`'s data bytes, dtype and shape, never decoded. The header read checks dtype and shape
    against the manifest; the whole blob is verified against its digests as it is fetched."""
    header = source.header(name)
    try:
        blob = source.store.get(source.payload_ref(name))
    except TrajectoryReplayError as exc:
        raise type(exc)(f"{source.label}: payload {name!r}: {exc}") from None
    return RawTensor(memoryview(blob)[header.data_start : header.data_end], header.dtype_name, header.shape)


def _payload_names(source: BundleReader) -> list[str]:
    """Tensor payloads as V1 stores them: loss masks live in the index records instead."""
    return [n for n in source.manifest.payloads if n != LOSS_MASK]


__all__ = ["ExportReport", "export_bundle"]
