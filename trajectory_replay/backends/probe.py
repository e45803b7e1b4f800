"""Self-test of create-if-absent on the real target.

A server that ignores `If-None-Match`, or a filesystem without hard links, would let two
ranks both "win" a completion marker. Declared capabilities are not enough, so before a
backend writes markers it proves, on a scratch key under `.probe/`, that a second create of
different bytes is refused and that among concurrent creators exactly one wins.

A probe that fails because the target could not be reached (`Backend.transient_error`) says
nothing about create-once: its result is marked transient, and the backend probes again later.
`Backend.probe` runs it and remembers its `ProbeResult`.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

CONCURRENT_WRITERS = 8

PROBE_DIR = ".probe"
"""The top-level prefix of the probe's scratch keys; the store's root layout (`store.layout`) reserves it."""


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of `Backend.probe()`: whether create-once markers can be trusted on this target."""

    ok: bool
    checks: dict[str, bool]
    detail: str = ""
    transient: bool = False
    """The probe could not finish (target unreachable, a timeout, a server error): it says nothing about
    create-once, so it is not remembered and runs again later."""


class Probed(Protocol):
    """What the probe asks of a backend (`backends.base.Backend` has it all)."""

    def create_if_absent(self, key: str, data: bytes) -> bool: ...

    def read(self, key: str, limit: int | None = None) -> bytes: ...

    def delete(self, key: str) -> None: ...

    def transient_error(self, exc: BaseException) -> bool: ...


def run_probe(backend: Probed) -> ProbeResult:
    """Run the create-once checks against `backend` and clean up after them."""
    token = uuid.uuid4().hex
    seq_key = f"{PROBE_DIR}/{token}-seq"
    con_key = f"{PROBE_DIR}/{token}-con"
    checks: dict[str, bool] = {}
    detail = []
    transient = False
    reached = False
    try:
        first = backend.create_if_absent(seq_key, b"probe-a")
        reached = True
        second = backend.create_if_absent(seq_key, b"probe-b")
        same = backend.create_if_absent(seq_key, b"probe-a")
        checks["sequential"] = first and not second and same and backend.read(seq_key) == b"probe-a"
        if not checks["sequential"]:
            detail.append("a second create of different bytes was not refused")

        payloads = [f"probe-{i}".encode() for i in range(CONCURRENT_WRITERS)]
        with ThreadPoolExecutor(CONCURRENT_WRITERS) as pool:
            wins = list(pool.map(lambda p: backend.create_if_absent(con_key, p), payloads))
        stored = backend.read(con_key)
        winners = [p for p, won in zip(payloads, wins) if won]
        checks["concurrent"] = len(winners) == 1 and winners[0] == stored
        if not checks["concurrent"]:
            detail.append(f"{len(winners)} of {CONCURRENT_WRITERS} concurrent creators won")
    except Exception as exc:  # a backend that cannot even run the probe is not safe
        # a check the target already failed stands, whatever cut the rest short
        transient = backend.transient_error(exc) and all(checks.values())
        checks.setdefault("sequential", False)
        checks["error"] = False
        detail.append(f"{type(exc).__name__}: {exc}")
    finally:
        # nothing was created on a target that never answered, and each delete would wait out the outage again
        leftovers = (seq_key, con_key) if reached or not transient else ()
        for key in leftovers:
            try:
                backend.delete(key)
            except Exception:  # cleanup is best effort; the probe keys are tiny
                log.debug("could not remove probe key %s", key)
    ok = all(checks.values())
    return ProbeResult(ok=ok, checks=checks, detail="; ".join(detail) or "ok", transient=transient and not ok)
