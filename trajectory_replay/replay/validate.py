"""`validate`: is a bundle whole, safe and complete enough to replay?

Checks the format (opening already verified COMPLETE, the documents and their schema), the samples'
structure as the `sample` stage checks it (`replay.structure`), every payload's bytes (each chunk and the whole-blob
digest, the safetensors header, dtype and
shape against the manifest), and the dependency closure: every recompute stage has the
payloads and expected outputs `bundle.stage_io.STAGE_IO` says it reads under the bundle's config and estimator
(`replay.flags`: a plugin estimator's flags are its kernel's). Non-finite values are
warnings, not problems: they are data a replay must locate, not a broken bundle.

A native bundle is validated without torch (its payloads are decoded with numpy), so `validate`
works where torch is not installed; a source that can only hand over tensors (the older format)
is checked through them.

`validate_bundle` opens a remote store without trusting the local read cache: a cached copy
of an object proves nothing about the server's copy, which is what validation is about.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy

from trajectory_replay.bundle.schema import StageCapability
from trajectory_replay.bundle.stage_io import STAGE_IO
from trajectory_replay.errors import (
    BackendError,
    IncompleteBundleError,
    SelectionError,
    StorageUnavailableError,
    TrajectoryReplayError,
)
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.replay.flags import setting as setting_of
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.replay.structure import payload_size_problems, record_problems
from trajectory_replay.units import human_bytes

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ArraySource(Protocol):
    """A source that hands over a whole payload, verified, as a numpy array (a native bundle's reader)."""

    def load_array(self, name: str) -> numpy.ndarray: ...


@dataclass
class ValidationReport(Outcome):
    """Problems (the bundle is invalid) and warnings (data replay will have to locate)."""

    target: str
    bundle_id: str | None = None
    ranks: list[int | None] = field(default_factory=list)
    payloads_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    incomplete: bool = False
    """The bundle's final COMPLETE is missing (its ranks have not all landed)."""

    @property
    def status(self) -> Status:
        """pass (no problem), incomplete (the problem is a missing COMPLETE) or invalid."""
        if not self.problems:
            return Status.PASS
        return Status.INCOMPLETE if self.incomplete else Status.INVALID

    @property
    def valid(self) -> bool:
        return self.status is Status.PASS

    def failures(self) -> list[str]:
        return self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "bundle_id": self.bundle_id,
            "valid": self.valid,
            "ranks": self.ranks,
            "payloads_checked": self.payloads_checked,
            "bytes_checked": self.bytes_checked,
            "problems": self.problems,
            "warnings": self.warnings,
            "incomplete": self.incomplete,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render_text(self) -> str:
        verdict = "valid" if self.valid else "INVALID (incomplete bundle)" if self.incomplete else "INVALID"
        ranks = ", ".join(str(r) for r in self.ranks if r is not None)
        lines = [
            f"bundle {self.bundle_id or self.target}: {verdict}",
            f"  {self.payloads_checked} payloads verified ({human_bytes(self.bytes_checked)})"
            + (f", ranks {ranks}" if ranks else ""),
        ]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def validate_bundle(path_or_url: str, **storage_options: Any) -> ValidationReport:
    """Open the bundle at `path_or_url`, reading every byte from its store (never from the read cache), and
    validate it. A bundle that cannot even be opened is an invalid report, not an exception."""
    from trajectory_replay.bundle import open_sources

    try:
        return validate_sources(path_or_url, open_sources(path_or_url, trust_cache=False, **storage_options))
    except (BackendError, SelectionError):  # the store is unreachable, or nothing is there: not a verdict
        raise
    except TrajectoryReplayError as exc:
        return ValidationReport(path_or_url, problems=[str(exc)], incomplete=isinstance(exc, IncompleteBundleError))


def validate_sources(target: str, sources: Sequence[ReplaySource]) -> ValidationReport:
    """Verify every payload of every rank and the dependency closure of every recompute stage."""
    report = ValidationReport(target, sources[0].bundle_id if sources else None, [s.rank for s in sources])
    for source in sources:
        where = source.bundle_id + (f" rank {source.rank}" if source.rank is not None else "")
        _check_structure(source, where, report)
        _check_payloads(source, where, report)
        _check_closure(source, where, report)
    return report


def _check_structure(source: ReplaySource, where: str, report: ValidationReport) -> None:
    """What the sample stage checks: a bundle that fails it would pass validate only to diverge at `sample`."""
    samples = source.index.samples
    report.problems += [f"{where}: {p.message}" for p in record_problems(samples)]
    report.problems += [
        f"{where}: {message}" for message in payload_size_problems(samples, source.manifest.payloads.values())
    ]


def _check_payloads(source: ReplaySource, where: str, report: ValidationReport) -> None:
    ids = [s.sample_id for s in source.index.samples]
    offsets = source.index.token_offsets()
    for name, spec in source.manifest.payloads.items():
        try:
            values = _payload_values(source, name)
        except StorageUnavailableError:  # the store stopped answering: no verdict on this payload
            raise
        except TrajectoryReplayError as exc:
            report.problems.append(str(exc))
            continue
        report.payloads_checked += 1
        report.bytes_checked += spec.size
        if values.dtype.kind == "f":
            bad = numpy.flatnonzero(~numpy.isfinite(values))
            if bad.size:
                first = int(bad[0])
                at = _locate(first, offsets, ids) if values.size == offsets[-1] else f"element {first}"
                report.warnings.append(
                    f"{where}: payload {name!r} has {bad.size} non-finite value(s); "
                    f"first {float(values[first])} at {at}"
                )


def _payload_values(source: ReplaySource, name: str) -> numpy.ndarray:
    """The whole payload, verified by the source; without torch where the source can."""
    if isinstance(source, ArraySource):
        return source.load_array(name)
    return _as_array(source.load_payload(name))


def _as_array(tensor: torch.Tensor) -> numpy.ndarray:
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly
    flat = tensor.detach().reshape(-1)
    return (flat.float() if str(flat.dtype) == "torch.bfloat16" else flat).numpy()


def _locate(position: int, offsets: list[int], ids: list[str]) -> str:
    i = bisect.bisect_right(offsets, position) - 1
    return f"{ids[i]} token {position - offsets[i]}"


def _check_closure(source: ReplaySource, where: str, report: ValidationReport) -> None:
    setting = setting_of(source.index.config, source.manifest)
    for stage_id, contract in source.manifest.stage_contracts.items():
        if contract.capability != StageCapability.RECOMPUTE:
            report.warnings.append(
                f"{where}: stage {stage_id} is declared {contract.capability.value} by the bundle; replay skips it"
            )
            continue
        io = STAGE_IO[stage_id]
        for name in io.needed_payloads(setting):
            if not source.has_payload(name):
                report.problems.append(f"{where}: stage {stage_id} needs payload {name!r}, which is missing")
        expected = io.needed_expected(stage_id, setting)
        for stage_key, field_name in expected:
            value = source.expected.get(stage_key)
            if not isinstance(value, dict) or field_name not in value:
                report.problems.append(
                    f"{where}: stage {stage_id} needs expected {stage_key}.{field_name}, which is missing"
                )
        for value in _expected_values(source.expected.get(stage_id.value)) if expected else ():
            if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
                report.warnings.append(f"{where}: expected {stage_id} holds a non-finite value ({value})")
                break


def _expected_values(entry: Any) -> Iterator[Any]:
    if isinstance(entry, dict):
        for v in entry.values():
            if isinstance(v, list):
                yield from v
            else:
                yield v
