"""`validate`: is a bundle whole, safe and complete enough to replay?

Checks the format (opening already verified COMPLETE, the documents and their schema), every
payload's bytes (each chunk and the whole-blob digest, the safetensors header, dtype and
shape against the manifest), and the dependency closure: every recompute stage has the
payloads and expected outputs it reads. Non-finite values are warnings, not problems: they
are data a replay must locate, not a broken bundle. Lives beside the stages because the
dependency closure is theirs.

`validate_bundle` opens a remote store without trusting the local read cache: a cached copy
of an object proves nothing about the server's copy, which is what validation is about.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from trajectory_replay.bundle.schema import StageCapability, StageId
from trajectory_replay.errors import (
    BackendError, IncompleteBundleError, SelectionError, StorageUnavailableError, TrajectoryReplayError,
)
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.units import human_bytes

# what each recompute stage reads beyond the index: (payloads, expected entries)
STAGE_NEEDS: dict[StageId, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    StageId.SAMPLE: (("loss_mask",), ()),
    StageId.REWARD_RAW: ((), (("reward.raw", "raw_rewards"),)),
    StageId.REWARD_POST_PROCESS: ((), (("reward.post_process", "rewards"),)),
    StageId.ADVANTAGE_KL: (("old_log_probs", "kl"), ()),
    StageId.ADVANTAGE_ESTIMATE: (("advantages",), ()),
    StageId.LOSS_POLICY: (("old_log_probs", "log_probs", "entropy", "advantages", "loss_mask"),
                          tuple(("loss.policy", f) for f in ("loss", "pg_loss", "entropy_loss", "pg_clipfrac",
                                                             "ppo_kl"))),
}


@dataclass
class ValidationReport:
    """Problems (the bundle is invalid) and warnings (data replay will have to locate)."""

    target: str
    bundle_id: Optional[str] = None
    ranks: list[Optional[int]] = field(default_factory=list)
    payloads_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    incomplete: bool = False
    """The bundle's final COMPLETE is missing (its ranks have not all landed)."""

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def outcome(self) -> str:
        """The `--json` status: pass, incomplete or invalid."""
        return "pass" if self.valid else "incomplete" if self.incomplete else "invalid"

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "bundle_id": self.bundle_id, "valid": self.valid, "ranks": self.ranks,
                "payloads_checked": self.payloads_checked, "bytes_checked": self.bytes_checked,
                "problems": self.problems, "warnings": self.warnings, "incomplete": self.incomplete}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render_text(self) -> str:
        verdict = "valid" if self.valid else "INVALID (incomplete bundle)" if self.incomplete else "INVALID"
        ranks = ", ".join(str(r) for r in self.ranks if r is not None)
        lines = [f"bundle {self.bundle_id or self.target}: {verdict}",
                 f"  {self.payloads_checked} payloads verified ({human_bytes(self.bytes_checked)})"
                 + (f", ranks {ranks}" if ranks else "")]
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
        _check_payloads(source, where, report)
        _check_closure(source, where, report)
    return report


def _check_payloads(source: ReplaySource, where: str, report: ValidationReport) -> None:
    ids = [s.sample_id for s in source.index.samples]
    offsets = source.index.token_offsets()
    for name, spec in source.manifest.payloads.items():
        try:
            tensor = source.load_payload(name)
        except StorageUnavailableError:  # the store stopped answering: no verdict on this payload
            raise
        except TrajectoryReplayError as exc:
            report.problems.append(str(exc))
            continue
        report.payloads_checked += 1
        report.bytes_checked += spec.size
        if tensor.is_floating_point():
            bad = (~torch.isfinite(tensor)).nonzero().flatten()
            if bad.numel():
                first = int(bad[0])
                at = _locate(first, offsets, ids) if tensor.numel() == offsets[-1] else f"element {first}"
                report.warnings.append(f"{where}: payload {name!r} has {bad.numel()} non-finite value(s); "
                                       f"first {float(tensor[first])} at {at}")


def _locate(position: int, offsets: list[int], ids: list[str]) -> str:
    import bisect

    i = bisect.bisect_right(offsets, position) - 1
    return f"{ids[i]} token {position - offsets[i]}"


def _check_closure(source: ReplaySource, where: str, report: ValidationReport) -> None:
    config = source.index.config
    for stage_id, contract in source.manifest.stage_contracts.items():
        if contract.capability != StageCapability.RECOMPUTE:
            report.warnings.append(f"{where}: stage {stage_id} is declared {contract.capability.value} by the "
                                   "bundle; replay skips it")
            continue
        if stage_id not in STAGE_NEEDS:
            continue
        payloads, expected = STAGE_NEEDS[stage_id]
        needed = list(payloads)
        if stage_id == StageId.ADVANTAGE_KL and config.kl_coef != 0:
            needed.append("ref_log_probs")
        for name in needed:
            if not source.has_payload(name):
                report.problems.append(f"{where}: stage {stage_id} needs payload {name!r}, which is missing")
        for stage_key, field_name in expected:
            value = source.expected.get(stage_key)
            if not isinstance(value, dict) or field_name not in value:
                report.problems.append(f"{where}: stage {stage_id} needs expected {stage_key}.{field_name}, "
                                       "which is missing")
        for value in _expected_values(source.expected.get(stage_id.value)):
            if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
                report.warnings.append(f"{where}: expected {stage_id} holds a non-finite value ({value})")
                break


def _expected_values(entry: Any):
    if isinstance(entry, dict):
        for v in entry.values():
            if isinstance(v, list):
                yield from v
            else:
                yield v
