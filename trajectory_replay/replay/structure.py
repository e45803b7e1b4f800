"""The structure of a bundle's samples: what the `sample` stage checks and `validate` reports, without torch.

Every record's lengths (response_length not negative, total_length not below it, a loss_mask list as long as the
response when the record carries one), sample ids unique, and every per-token payload holding one element per
response token (sum of response_length, read from the manifest's shapes: nothing is loaded). One function serves
both, so a bundle `validate` passes never fails the sample stage of its replay on its structure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trajectory_replay.bundle.schema import PayloadSpec, SampleRecord


@dataclass(frozen=True)
class StructureProblem:
    """One structural fault; `field` (with the numbers) when the sample stage reports it as a divergence."""

    message: str
    field: str | None = None
    sample_id: str | None = None
    expected: float | None = None
    actual: float | None = None
    abs_error: float | None = None


def record_problems(records: Sequence[SampleRecord]) -> list[StructureProblem]:
    """The records' own faults: lengths, loss_mask lists, duplicate sample ids (the first ten named)."""
    out = []
    for r in records:
        if r.response_length < 0 or r.total_length < r.response_length:
            out.append(
                StructureProblem(
                    f"sample {r.sample_id}: response_length {r.response_length}, total_length {r.total_length}",
                    "length",
                    r.sample_id,
                    float(r.total_length),
                    float(r.response_length),
                )
            )
        if r.loss_mask and len(r.loss_mask) != r.response_length:
            out.append(
                StructureProblem(
                    f"sample {r.sample_id}: loss_mask has {len(r.loss_mask)} values, "
                    f"response_length {r.response_length}",
                    "loss_mask_length",
                    r.sample_id,
                    float(r.response_length),
                    float(len(r.loss_mask)),
                    float(abs(len(r.loss_mask) - r.response_length)),
                )
            )
    duplicates = sorted(sid for sid, count in Counter(r.sample_id for r in records).items() if count > 1)
    if duplicates:
        out.append(StructureProblem(f"duplicate sample ids: {', '.join(duplicates[:10])}"))
    return out


def payload_size_problems(records: Sequence[SampleRecord], payloads: Iterable[PayloadSpec]) -> list[str]:
    """Every per-token payload whose manifest shape does not hold sum(response_length) elements."""
    tokens = sum(r.response_length for r in records)
    return [
        f"payload {spec.name!r} has {math.prod(spec.shape)} elements, the responses have {tokens} tokens"
        for spec in payloads
        if spec.per_token and math.prod(spec.shape) != tokens
    ]
