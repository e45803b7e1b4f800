"""The manifest's redaction policy, applied to the samples' text fields before anything is stored."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import blake3

from trajectory_replay.bundle.schema import TEXT_FIELDS, SampleRecord


def redact_text(value: Optional[str], rule: str) -> Optional[str]:
    """Apply one rule: `hash` (blake3 of the UTF-8 text), `truncate:N` (first N characters), `drop`."""
    if value is None:
        return None
    if rule == "drop":
        return None
    if rule == "hash":
        return "blake3:" + blake3.blake3(value.encode("utf-8")).hexdigest()
    if rule.startswith("truncate:"):
        return value[: int(rule.split(":", 1)[1])]
    raise ValueError(f"unknown redaction rule {rule!r}")


def redact_samples(samples: Sequence[SampleRecord], policy: Mapping[str, str]) -> list[SampleRecord]:
    """Copies of `samples` with every text field the policy names redacted."""
    rules = {f: r for f, r in policy.items() if f in TEXT_FIELDS}
    if not rules:
        return list(samples)
    return [s.model_copy(update={f: redact_text(getattr(s, f), r) for f, r in rules.items()}) for s in samples]
