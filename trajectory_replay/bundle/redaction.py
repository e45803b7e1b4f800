"""The manifest's redaction policy, applied to the samples' text fields before anything is stored.

A policy is checked when a bundle is written, not when one is read: a field name the samples do
not have (`Prompt` for `prompt`) would otherwise leave the text it meant to hide stored in clear,
so the writer refuses it before storing anything. Reading stays lenient, so bundles written before
this check (whose policy may name such a field) still open.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import blake3

from trajectory_replay.bundle.schema import TEXT_FIELDS, SampleRecord
from trajectory_replay.errors import BundleError

REDACTABLE_FIELDS = TEXT_FIELDS
"""The SampleRecord fields a policy may name: the optional text ones."""

_RULE = re.compile(r"hash|drop|truncate:[0-9]+")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _hint(field: Any) -> str:
    """` (did you mean 'prompt'?)` for a known field spelled in another case."""
    if isinstance(field, str) and field.lower() in REDACTABLE_FIELDS:
        return f" (did you mean {field.lower()!r}?)"
    return ""


def unknown_fields(policy: Mapping[str, Any]) -> list[str]:
    """The fields of `policy` that are not redactable fields of SampleRecord, in policy order."""
    return [f for f in policy if f not in REDACTABLE_FIELDS]


def check_policy(policy: Any, where: str) -> dict[str, str]:
    """`policy` as a dict if every field is a redactable SampleRecord field and every rule is valid;
    else a one-line BundleError naming `where`, the field and the fields a policy may name."""
    if not isinstance(policy, Mapping):
        raise BundleError(
            f"{where}: manifest field 'redaction': expected a mapping of field -> rule, got {type(policy).__name__}"
        )
    unknown = unknown_fields(policy)
    if unknown:
        named = [_short(f) + _hint(f) for f in unknown[:5]]
        if len(unknown) > 5:
            named.append(f"and {len(unknown) - 5} more")
        raise BundleError(
            f"{where}: manifest field 'redaction': unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(named)}; known fields: {', '.join(REDACTABLE_FIELDS)}; "
            "the bundle was not written"
        )
    for field, rule in policy.items():
        # ASCII digits only: int() of other Unicode digits fails or surprises at finalize
        if not isinstance(rule, str) or not _RULE.fullmatch(rule):
            raise BundleError(
                f"{where}: manifest field 'redaction.{field}': invalid rule {_short(rule)}: "
                "expected hash, drop or truncate:N; the bundle was not written"
            )
    return dict(policy)


def redact_text(value: str | None, rule: str) -> str | None:
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


def redact_samples(
    samples: Sequence[SampleRecord], policy: Mapping[str, str], where: str = "bundle"
) -> list[SampleRecord]:
    """Copies of `samples` with every text field the policy names redacted; BundleError on a policy
    `check_policy` refuses (never a silent skip, which would store the text in clear)."""
    rules = check_policy(policy, where)
    if not rules:
        return list(samples)
    return [s.model_copy(update={f: redact_text(getattr(s, f), r) for f, r in rules.items()}) for s in samples]


__all__ = ["REDACTABLE_FIELDS", "check_policy", "redact_samples", "redact_text", "unknown_fields"]
