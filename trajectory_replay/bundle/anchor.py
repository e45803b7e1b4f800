"""The anchor of a bundle: the actor step (step-level bundle) or the rollout (rollout-level bundle) it belongs to.

One type for each place an anchor appears: the identity in a bundle's index, the `anchor` field of its markers
(`{"actor_step_id": {"rollout_id": R, "step_id": S}}` or `{"rollout_id": R}`), the `--step R:S` / `--rollout R`
that pick a bundle, and the `step R:S` / `rollout R` that reports print. A filter designates exactly the
bundles whose anchor equals it: `--step 120:0` never matches a rollout-level bundle of rollout 120.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trajectory_replay.errors import UsageError

_INT64 = 1 << 63
_STEP_TEXT = re.compile(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*")


def _int64(value: Any, field: str) -> int:
    if type(value) is not int or not -_INT64 <= value < _INT64:
        shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
        raise ValueError(f"{field} must be a 64-bit integer, got {shown}")
    return value


@dataclass(frozen=True)
class Anchor:
    """(rollout_id, step_id) of a step-level bundle; (rollout_id, None) of a rollout-level one."""

    rollout_id: int
    step_id: int | None = None

    @property
    def level(self) -> str:
        """`step` or `rollout`."""
        return "step" if self.step_id is not None else "rollout"

    def __str__(self) -> str:
        return f"step {self.rollout_id}:{self.step_id}" if self.step_id is not None else f"rollout {self.rollout_id}"

    @property
    def flag(self) -> str:
        """The command-line filter that designates this anchor: `--step R:S` or `--rollout R`."""
        return (
            f"--step {self.rollout_id}:{self.step_id}" if self.step_id is not None else f"--rollout {self.rollout_id}"
        )

    # ---- from and to the forms it is stored and written in -------------------------------------------
    @classmethod
    def of(cls, identity: Any) -> Anchor:
        """The anchor of an index identity (its `actor_step_id`, else its `rollout_id`)."""
        step = identity.actor_step_id
        return cls(step.rollout_id, step.step_id) if step is not None else cls(identity.rollout_id)

    @classmethod
    def from_marker(cls, value: Any) -> Anchor:
        """The anchor a marker stores; ValueError naming the field that is wrong otherwise."""
        if isinstance(value, Anchor):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"expected an object with actor_step_id or rollout_id, got {type(value).__name__}")
        step, rollout = value.get("actor_step_id"), value.get("rollout_id")
        if (step is None) == (rollout is None):
            raise ValueError("needs exactly one of actor_step_id or rollout_id")
        if rollout is not None:
            return cls(_int64(rollout, "rollout_id"))
        if not isinstance(step, dict):
            raise ValueError(f"actor_step_id must be an object {{rollout_id, step_id}}, got {type(step).__name__}")
        return cls(
            _int64(step.get("rollout_id"), "actor_step_id.rollout_id"),
            _int64(step.get("step_id"), "actor_step_id.step_id"),
        )

    def to_marker(self) -> dict[str, Any]:
        """The form markers store."""
        if self.step_id is not None:
            return {"actor_step_id": {"rollout_id": self.rollout_id, "step_id": self.step_id}}
        return {"rollout_id": self.rollout_id}

    # ---- from the command line -------------------------------------------------------------------------
    @classmethod
    def parse_step(cls, text: str | None) -> Anchor:
        """`R:S` (the value of `--step`) as a step-level anchor; UsageError (exit 2) when malformed."""
        match = _STEP_TEXT.fullmatch(text or "")
        if not match:
            raise UsageError(f"--step {text!r}: expected ROLLOUT:STEP, e.g. 120:0")
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def requested(cls, step: str | None = None, rollout: int | None = None) -> Anchor | None:
        """The anchor `--step` or `--rollout` asks for; None when neither is given (no filter)."""
        if step is not None and rollout is not None:
            raise UsageError("--step and --rollout are mutually exclusive")
        if step is not None:
            return cls.parse_step(step)
        return None if rollout is None else cls(rollout)


__all__ = ["Anchor"]
