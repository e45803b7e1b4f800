"""Building bundles for tests from the canonical case."""

from __future__ import annotations

from typing import Any

from trajectory_replay.bundle import BundleWriter
from trajectory_replay.replay import canonical_case


def write_canonical(
    root: str,
    *,
    buggy: bool = False,
    name: str | None = None,
    current_logprob: float = 0.0,
    storage_options: dict | None = None,
    **writer_kwargs: Any,
) -> str:
    """Write the canonical case under `root`; returns the bundle path/URL."""
    case = canonical_case(buggy=buggy, current_logprob=current_logprob)
    name = name or case.manifest.bundle_id
    if name != case.manifest.bundle_id:
        case = case._replace(
            manifest=case.manifest.model_copy(update={"bundle_id": name}),
            index=case.index.model_copy(update={"bundle_id": name}),
        )
    url = f"{root}/{name}"
    writer = BundleWriter(url, case.manifest, case.index, case.expected, **(storage_options or {}), **writer_kwargs)
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    writer.finalize()
    return url
