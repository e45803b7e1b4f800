"""The anchor of a bundle: the step (step-level bundle) or the rollout (rollout-level bundle) it belongs to.

A step's anchor also says whose step it is: the actor's (`step R:S`, bundle `step-<R>-<S>`) or a critic's trained
on its own mini-batches (`critic R:S`, bundle `critic-<R>-<S>`), so that the two bundles of one R:S are told apart.
One type for each place an anchor appears: the identity in a bundle's index, the `anchor` field of its markers
(`{"actor_step_id": {"rollout_id": R, "step_id": S}}`, `{"critic_step_id": {"rollout_id": R, "step_id": S}}` or
`{"rollout_id": R}`), the `--step R:S` / `--critic R:S` / `--rollout R` that pick a bundle, and the `step R:S` /
`critic R:S` / `rollout R` that reports print. A filter designates exactly the bundles whose anchor equals it:
`--step 120:0` never matches a rollout-level bundle of rollout 120, nor the critic's bundle of step 120:0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trajectory_replay.errors import UsageError

_INT64 = 1 << 63
_STEP_TEXT = re.compile(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*")

ACTOR, CRITIC = "actor", "critic"
"""The roles of a step: the actor's (the policy update) and a critic's trained apart from it."""
ROLES = (ACTOR, CRITIC)
_STEP_FIELD = {ACTOR: "actor_step_id", CRITIC: "critic_step_id"}
"""The identity and marker field that holds a step of each role."""
_STEP_FLAG = {ACTOR: "--step", CRITIC: "--critic"}
"""The command-line filter that designates a step of each role."""
_STEP_WORD = {ACTOR: "step", CRITIC: "critic"}
"""How reports name a step of each role."""


def _int64(value: Any, field: str) -> int:
    if type(value) is not int or not -_INT64 <= value < _INT64:
        shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
        raise ValueError(f"{field} must be a 64-bit integer, got {shown}")
    return value


@dataclass(frozen=True)
class Anchor:
    """(rollout_id, step_id, role) of a step-level bundle, `role` the actor's or a critic's step; (rollout_id,
    None) of a rollout-level one."""

    rollout_id: int
    step_id: int | None = None
    role: str = ACTOR
    """`actor` or `critic`: whose step it is (a rollout-level anchor is the actor's)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role != ACTOR and self.step_id is None:
            raise ValueError(f"a {self.role}'s anchor is a step: it needs a step_id")

    @property
    def level(self) -> str:
        """`step` or `rollout`."""
        return "step" if self.step_id is not None else "rollout"

    def __str__(self) -> str:
        if self.step_id is None:
            return f"rollout {self.rollout_id}"
        return f"{_STEP_WORD[self.role]} {self.rollout_id}:{self.step_id}"

    @property
    def flag(self) -> str:
        """The command-line filter that designates this anchor: `--step R:S`, `--critic R:S` or `--rollout R`."""
        if self.step_id is None:
            return f"--rollout {self.rollout_id}"
        return f"{_STEP_FLAG[self.role]} {self.rollout_id}:{self.step_id}"

    # ---- from and to the forms it is stored and written in -------------------------------------------
    @classmethod
    def of(cls, identity: Any) -> Anchor:
        """The anchor of an index identity (its `actor_step_id`, else its `critic_step_id`, else its
        `rollout_id`)."""
        for role, name in _STEP_FIELD.items():
            step = getattr(identity, name, None)
            if step is not None:
                return cls(step.rollout_id, step.step_id, role)
        return cls(identity.rollout_id)

    @classmethod
    def from_marker(cls, value: Any) -> Anchor:
        """The anchor a marker stores; ValueError naming the field that is wrong otherwise."""
        if isinstance(value, Anchor):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"expected an object with actor_step_id, critic_step_id or rollout_id, got {type(value).__name__}"
            )
        given = [name for name in (*_STEP_FIELD.values(), "rollout_id") if value.get(name) is not None]
        if len(given) != 1:
            raise ValueError("needs exactly one of actor_step_id, critic_step_id or rollout_id")
        if given[0] == "rollout_id":
            return cls(_int64(value["rollout_id"], "rollout_id"))
        name = given[0]
        step = value[name]
        if not isinstance(step, dict):
            raise ValueError(f"{name} must be an object {{rollout_id, step_id}}, got {type(step).__name__}")
        role = next(r for r, field in _STEP_FIELD.items() if field == name)
        return cls(
            _int64(step.get("rollout_id"), f"{name}.rollout_id"), _int64(step.get("step_id"), f"{name}.step_id"), role
        )

    def to_marker(self) -> dict[str, Any]:
        """The form markers store."""
        if self.step_id is not None:
            return {_STEP_FIELD[self.role]: {"rollout_id": self.rollout_id, "step_id": self.step_id}}
        return {"rollout_id": self.rollout_id}

    # ---- from the command line -------------------------------------------------------------------------
    @classmethod
    def parse_step(cls, text: str | None, role: str = ACTOR) -> Anchor:
        """`R:S` (the value of `--step`, or of `--critic` for role `critic`) as a step-level anchor; UsageError
        (exit 2) when malformed."""
        match = _STEP_TEXT.fullmatch(text or "")
        if not match:
            raise UsageError(f"{_STEP_FLAG[role]} {text!r}: expected ROLLOUT:STEP, e.g. 120:0")
        return cls(int(match.group(1)), int(match.group(2)), role)

    @classmethod
    def requested(cls, step: str | None = None, rollout: int | None = None, critic: str | None = None) -> Anchor | None:
        """The anchor `--step`, `--critic` or `--rollout` asks for; None when none is given (no filter). UsageError
        when more than one is given."""
        flags = (("--step", step), ("--critic", critic), ("--rollout", rollout))
        given = [flag for flag, value in flags if value is not None]
        if len(given) > 1:
            raise UsageError(f"{' and '.join(given)} are mutually exclusive")
        if step is not None:
            return cls.parse_step(step)
        if critic is not None:
            return cls.parse_step(critic, CRITIC)
        return None if rollout is None else cls(rollout)


FILTER_FLAGS = "--step ROLLOUT:STEP, --critic ROLLOUT:STEP or --rollout ROLLOUT"
"""The filters that pick a bundle by its anchor, as messages name them."""

__all__ = ["ACTOR", "Anchor", "CRITIC", "FILTER_FLAGS", "ROLES"]
