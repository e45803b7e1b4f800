"""Capture configuration, read from the environment only (no command-line change in the training program).

    TRAJECTORY_REPLAY_CAPTURE            1/true/yes/on or 0/false/no/off (case-insensitive); unset = off
    TRAJECTORY_REPLAY_CAPTURE_DIR        store root: a path or any fsspec URL (s3://bucket/run-42); required when on
    TRAJECTORY_REPLAY_CAPTURE_STEPS      optional step filter: R:S,R:S,...  (unset or empty = every step)
    TRAJECTORY_REPLAY_CAPTURE_ROLLOUTS   optional rollout filter: R,R,...   (unset or empty = every rollout)
    TRAJECTORY_REPLAY_CAPTURE_WRITER     optional writer: auto, process or thread (unset or empty = auto; a
                                         `writer=` the program passes to the manager wins)
    TRAJECTORY_REPLAY_CAPTURE_POLICY     optional: which steps are kept (unset or empty = all):
                                         all                        every step (and the STEPS filter, if set)
                                         steps=R:S,R:S,...          these actor steps (as the STEPS variable)
                                         every:N                    every N-th actor step of the run (N >= 1)
                                         recorder:K[,after=M][,max_bytes=B]
                                                                    the flight recorder (`capture.recorder`):
                                                                    every step goes to a local spool; a
                                                                    trigger keeps the K steps up to it and
                                                                    the M after in the store
    TRAJECTORY_REPLAY_CAPTURE_SPOOL      optional: the recorder's local spool directory (default: one per
                                         store under <system temp dir>/trajectory-replay-spool)
    TRAJECTORY_REPLAY_RUN_ID             optional: the identity of this launch of the training job, the same on
                                         every rank and new at every (re)start; default: what the launcher says
                                         (torchrun's TORCHELASTIC_RUN_ID and restart count, Slurm's job id and
                                         restart count), else none. Rank markers carry it, so that ranks of two
                                         launches never complete one bundle together (`run_identity`).

The older tool's names of the capture variables (`OLDER_NAMES`: RELAX_REPLAY_CAPTURE, RELAX_REPLAY_CAPTURE_DIR,
..._STEPS, ..._ROLLOUTS, ..._WRITER) are read too. A variable set (not empty) under both names to values that mean
different things is a `CaptureConfigError` naming both.

S3 endpoint and credentials come from the usual places (AWS_* variables, AWS config files, FSSPEC_S3_*).
While capture is off the other variables are not read, so they can never break a run that does not
capture. A bad value is a `CaptureConfigError` whose one-line message names the variable (as it was set) and the
value.

Also here: the checks of the CaptureManager options that choose its writer and its producer ranks
(`choose_writer`, `producer_ranks`), a ValueError naming the option.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from blake3 import blake3

from trajectory_replay.errors import TrajectoryReplayError

ENV_CAPTURE = "TRAJECTORY_REPLAY_CAPTURE"
ENV_DIR = "TRAJECTORY_REPLAY_CAPTURE_DIR"
ENV_STEPS = "TRAJECTORY_REPLAY_CAPTURE_STEPS"
ENV_ROLLOUTS = "TRAJECTORY_REPLAY_CAPTURE_ROLLOUTS"
ENV_WRITER = "TRAJECTORY_REPLAY_CAPTURE_WRITER"
ENV_RUN_ID = "TRAJECTORY_REPLAY_RUN_ID"
ENV_POLICY = "TRAJECTORY_REPLAY_CAPTURE_POLICY"
ENV_SPOOL = "TRAJECTORY_REPLAY_CAPTURE_SPOOL"
OLDER_NAMES = {
    name: name.replace("TRAJECTORY_REPLAY_", "RELAX_REPLAY_", 1)
    for name in (ENV_CAPTURE, ENV_DIR, ENV_STEPS, ENV_ROLLOUTS, ENV_WRITER)
}
"""The older tool's name of each capture variable (RELAX_REPLAY_CAPTURE, ...), still read."""
MAX_RUN_ID = 200
_RUN_ID = re.compile(r"[\x21-\x7e]+")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_DIGITS = re.compile(r"[0-9]+")
_PROTOCOLS = frozenset({"file", "local", "s3", "s3a", "s3n", "memory"})

WRITER_MODES = ("auto", "process", "thread")
WRITER_PRIORITIES = ("idle", "low")
"""How the writer yields the CPU to training. "idle": the writer process runs in Linux's idle scheduling class
(SCHED_IDLE: it gets only CPU time nothing else wants); "low": it runs at nice 10. A writer thread, which shares
training's GIL and must not be starved while it holds it, always runs at nice 10."""


class CaptureConfigError(TrajectoryReplayError, ValueError):
    """An environment variable of the capture configuration holds a value that cannot be used."""


POLICY_KINDS = ("all", "steps", "every", "recorder")
DEFAULT_RECORDER_AFTER = 0
"""Steps a trigger keeps after the K up to it, unless `after=` says."""
DEFAULT_RECORDER_MAX_BYTES = 8 << 30
"""The spool's byte bound, unless `max_bytes=` says."""
_SIZE = re.compile(r"([0-9]+)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class CapturePolicy:
    """Which actor steps capture keeps: `all`; `steps` (those of `steps`); `every` (every `every`-th step
    bundle the rank ends, the first included); `recorder` (every step into the local spool, `keep` steps up to a
    trigger and `after` steps after it promoted to the store; the spool holds at most `keep` steps and
    `max_bytes` bytes)."""

    kind: str = "all"
    steps: frozenset[tuple[int, int]] | None = None
    every: int = 1
    keep: int = 0
    after: int = DEFAULT_RECORDER_AFTER
    max_bytes: int = DEFAULT_RECORDER_MAX_BYTES

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"capture policy must be one of {', '.join(POLICY_KINDS)}, got {self.kind!r}")
        if self.kind == "every" and self.every < 1:
            raise ValueError(f"every:N needs N >= 1, got {self.every}")
        if self.kind == "recorder" and (self.keep < 1 or self.after < 0 or self.max_bytes < 1):
            raise ValueError(
                f"recorder:K needs K >= 1, after >= 0 and max_bytes >= 1, got {self.keep}, {self.after}, "
                f"{self.max_bytes}"
            )

    @property
    def recorder(self) -> bool:
        return self.kind == "recorder"

    def __str__(self) -> str:
        if self.kind == "steps":
            return "steps=" + ",".join(f"{r}:{s}" for r, s in sorted(self.steps or ()))
        if self.kind == "every":
            return f"every:{self.every}"
        if self.kind == "recorder":
            return f"recorder:{self.keep},after={self.after},max_bytes={self.max_bytes}"
        return "all"


def _size(text: str, variable: str, value: str, what: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise _bad(variable, value, f"{what} {text.strip()!r} is not a size (bytes, or with K, M, G, T)")
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()[:1]]


def parse_policy(value: str | None, variable: str = ENV_POLICY) -> CapturePolicy:
    """`all`, `steps=R:S,...`, `every:N` (or `every=N`), `recorder:K[,after=M][,max_bytes=B]` (or `recorder=K`);
    unset or empty -> `all`. B takes K, M, G, T suffixes (powers of 1024)."""
    if value is None or value.strip() == "":
        return CapturePolicy()
    text = value.strip()
    head, sep, rest = text.partition(":") if ":" in text.split("=", 1)[0] else text.partition("=")
    kind = head.strip().lower()
    if kind == "all" and not sep:
        return CapturePolicy()
    if kind == "steps" and sep == "=":
        steps = parse_steps(rest, variable)
        if steps is None:
            raise _bad(variable, value, "steps= names no step (expected steps=ROLLOUT:STEP,...)")
        return CapturePolicy("steps", steps=steps)
    if kind == "every" and sep:
        n = _int(rest, variable, value, "every")
        if n < 1:
            raise _bad(variable, value, "every:N needs N >= 1")
        return CapturePolicy("every", every=n)
    if kind == "recorder" and sep:
        first, *options = rest.split(",")
        keep = _int(first, variable, value, "K")
        if keep < 1:
            raise _bad(variable, value, "recorder:K needs K >= 1")
        after, max_bytes = DEFAULT_RECORDER_AFTER, DEFAULT_RECORDER_MAX_BYTES
        for option in options:
            name, eq, given = option.partition("=")
            name = name.strip().lower()
            if not eq or name not in ("after", "max_bytes"):
                raise _bad(
                    variable, value, f"unknown recorder option {option.strip()!r} (expected after=M, max_bytes=B)"
                )
            if name == "after":
                after = _int(given, variable, value, "after")
            else:
                max_bytes = _size(given, variable, value, "max_bytes")
                if max_bytes < 1:
                    raise _bad(variable, value, "max_bytes must be at least 1 byte")
        return CapturePolicy("recorder", keep=keep, after=after, max_bytes=max_bytes)
    raise _bad(variable, value, "expected all, steps=R:S,..., every:N or recorder:K[,after=M][,max_bytes=B]")


DEFAULT_SPOOL = os.path.join(tempfile.gettempdir(), "trajectory-replay-spool")
"""Where the recorder spools when no spool is set: one directory per store under it (`default_spool`)."""


def default_spool(capture_dir: str) -> str:
    """The spool of a capture into `capture_dir` when none is set: a directory under DEFAULT_SPOOL named by the
    store's URL, so that two jobs on one host that capture into different stores never share (and clear) a spool,
    while a relaunch of the same job finds and clears what its killed predecessor left."""
    key = blake3(capture_dir.encode()).hexdigest()[:16]
    return os.path.join(DEFAULT_SPOOL, key)


def parse_spool(value: str | None, variable: str = ENV_SPOOL) -> str | None:
    """The recorder's spool: a local directory (None when unset: `default_spool` of the store); a URL is
    refused."""
    if value is None or value.strip() == "":
        return None
    text = value.strip()
    if "://" in text and not text.startswith("file://"):
        raise _bad(variable, value, "the spool is a local directory, not a URL")
    return os.path.abspath(os.path.expanduser(text.removeprefix("file://")))


def policy_of(policy: CapturePolicy | str | None) -> CapturePolicy | None:
    """A policy the integration passes (a `CapturePolicy` or its text), parsed; None stays None."""
    if policy is None or isinstance(policy, CapturePolicy):
        return policy
    return parse_policy(policy, "policy")


def choose_policy(environ: Mapping[str, str], policy: CapturePolicy | str | None) -> CapturePolicy:
    """The policy a capture follows: TRAJECTORY_REPLAY_CAPTURE_POLICY when it is set (the environment wins), else
    the one an integration's call passes (`policy`), else `all`."""
    if environ.get(ENV_POLICY, "").strip() or policy is None:
        return parse_policy(environ.get(ENV_POLICY))
    return policy_of(policy) or CapturePolicy()


@dataclass(frozen=True)
class CaptureConfig:
    """The parsed configuration. `steps` / `rollouts` None means no filter (capture every one); `writer` None
    means the manager's own default."""

    enabled: bool = False
    capture_dir: str | None = None
    steps: frozenset[tuple[int, int]] | None = None
    rollouts: frozenset[int] | None = None
    writer: str | None = None
    run_id: str | None = None
    """The launch this capture belongs to (`run_identity`), or None when nothing names it."""
    dir_variable: str = ENV_DIR
    """The variable `capture_dir` was read from (ENV_DIR, or its older name when only that is set)."""
    writer_variable: str = ENV_WRITER
    """The variable `writer` was read from (ENV_WRITER, or its older name when only that is set)."""
    policy: CapturePolicy = CapturePolicy()
    spool: str | None = None
    """The recorder's local spool directory; None: the store's `default_spool`."""

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        """True when the step-level bundle of actor step (rollout_id, step_id) is to be captured."""
        return self.steps is None or (rollout_id, step_id) in self.steps

    def wants_rollout(self, rollout_id: int) -> bool:
        """True when the rollout-level bundle of rollout `rollout_id` is to be captured."""
        return self.rollouts is None or rollout_id in self.rollouts


def _bad(variable: str, value: str, why: str) -> CaptureConfigError:
    return CaptureConfigError(f"{variable}={value!r}: {why}")


def parse_switch(value: str | None, variable: str = ENV_CAPTURE) -> bool:
    """The on/off switch; unset or empty is off."""
    if value is None or value.strip() == "":
        return False
    norm = value.strip().lower()
    if norm in _TRUE:
        return True
    if norm in _FALSE:
        return False
    raise _bad(variable, value, "expected one of 1/true/yes/on or 0/false/no/off")


def _int(text: str, variable: str, value: str, what: str) -> int:
    text = text.strip()
    if not _DIGITS.fullmatch(text):  # ASCII digits only: no sign, no spaces inside, not empty
        raise _bad(variable, value, f"{what} {text!r} is not a non-negative integer")
    return int(text)


def parse_steps(value: str | None, variable: str = ENV_STEPS) -> frozenset[tuple[int, int]] | None:
    """`R:S,R:S,...` -> {(R, S), ...}; unset or empty -> None (no filter)."""
    if value is None or value.strip() == "":
        return None
    out = set()
    for item in value.split(","):
        if item.strip() == "":
            raise _bad(variable, value, "empty item (expected ROLLOUT:STEP,ROLLOUT:STEP,...)")
        parts = item.split(":")
        if len(parts) != 2:
            raise _bad(variable, value, f"item {item.strip()!r} is not ROLLOUT:STEP")
        out.add((_int(parts[0], variable, value, "rollout id"), _int(parts[1], variable, value, "step id")))
    return frozenset(out)


def parse_rollouts(value: str | None, variable: str = ENV_ROLLOUTS) -> frozenset[int] | None:
    """`R,R,...` -> {R, ...}; unset or empty -> None (no filter)."""
    if value is None or value.strip() == "":
        return None
    out = set()
    for item in value.split(","):
        if item.strip() == "":
            raise _bad(variable, value, "empty item (expected ROLLOUT,ROLLOUT,...)")
        out.add(_int(item, variable, value, "rollout id"))
    return frozenset(out)


def parse_dir(value: str | None, variable: str = ENV_DIR, switch: str = ENV_CAPTURE) -> str:
    """The capture directory: required (when the variable `switch` is on), a path or a URL of a supported
    protocol."""
    if value is None or value.strip() == "":
        raise CaptureConfigError(
            f"{variable} is not set: it is required when {switch} is on (a path or a URL such as s3://bucket/run-42)"
        )
    text = value.strip()
    if "://" in text:
        protocol, rest = text.split("://", 1)
        if protocol.lower() not in _PROTOCOLS:
            raise _bad(
                variable, value, f"unsupported storage protocol {protocol!r} (use a path, file://, s3:// or memory://)"
            )
        if not rest.strip("/"):
            raise _bad(variable, value, "the URL has no path")
    return text


def parse_writer(value: str | None, variable: str = ENV_WRITER) -> str | None:
    """The writer mode (`auto`, `process` or `thread`, case-insensitive); unset or empty -> None."""
    if value is None or value.strip() == "":
        return None
    norm = value.strip().lower()
    if norm not in WRITER_MODES:
        raise _bad(variable, value, f"expected one of {', '.join(WRITER_MODES)}")
    return norm


_T = TypeVar("_T")


def read_variable(env: Mapping[str, str], name: str, parse: Callable[[str | None, str], _T]) -> tuple[str, _T]:
    """The capture variable `name` as `parse` (its value, the variable's name) reads it, and the name it was read
    from: `name`, or its older name (`OLDER_NAMES`) when only that is set. Empty counts as unset. Set under both
    names to values that `parse` reads differently: CaptureConfigError naming both."""
    older = OLDER_NAMES[name]
    given = [(variable, env[variable]) for variable in (name, older) if env.get(variable, "").strip()]
    if not given:
        return name, parse(None, name)
    (variable, value), *others = given
    parsed = parse(value, variable)
    for other, other_value in others:
        if parse(other_value, other) != parsed:
            raise CaptureConfigError(
                f"{variable}={value!r} and {other}={other_value!r} disagree: set one of them "
                f"({other} is the older name of {variable})"
            )
    return variable, parsed


def load_config(environ: Mapping[str, str] | None = None) -> CaptureConfig:
    """Read the capture configuration from `environ` (default `os.environ`)."""
    env = os.environ if environ is None else environ
    switch, enabled = read_variable(env, ENV_CAPTURE, parse_switch)
    if not enabled:
        return CaptureConfig(enabled=False)
    dir_variable, capture_dir = read_variable(env, ENV_DIR, lambda value, name: parse_dir(value, name, switch))
    writer_variable, writer = read_variable(env, ENV_WRITER, parse_writer)
    if writer is not None:
        check_env_writer(writer, env[writer_variable], capture_dir, store_given=False, variable=writer_variable)
    steps_variable, steps = read_variable(env, ENV_STEPS, parse_steps)
    policy = parse_policy(env.get(ENV_POLICY))
    if policy.kind == "steps":
        if steps is not None and steps != policy.steps:
            raise CaptureConfigError(
                f"{ENV_POLICY}={env[ENV_POLICY]!r} and {steps_variable}={env[steps_variable]!r} disagree: set one"
            )
        steps = policy.steps
    elif steps is not None and policy.kind != "all":
        raise CaptureConfigError(
            f"{ENV_POLICY}={env[ENV_POLICY]!r} and {steps_variable}={env[steps_variable]!r}: a step filter goes "
            f"with the policy all or steps=, not {policy.kind}"
        )
    return CaptureConfig(
        enabled=True,
        capture_dir=capture_dir,
        policy=policy,
        spool=parse_spool(env.get(ENV_SPOOL)),
        steps=steps,
        rollouts=read_variable(env, ENV_ROLLOUTS, parse_rollouts)[1],
        writer=writer,
        run_id=run_identity(env),
        dir_variable=dir_variable,
        writer_variable=writer_variable,
    )


def run_identity(environ: Mapping[str, str] | None = None) -> str | None:
    """The identity of this launch of the training job: the same on every rank of it, different after a restart.

    TRAJECTORY_REPLAY_RUN_ID when set (a launcher or the user sets it once for all ranks); else torchrun's
    TORCHELASTIC_RUN_ID with its TORCHELASTIC_RESTART_COUNT (a restart of the workers is another launch); else
    Slurm's SLURM_JOB_ID with SLURM_RESTART_COUNT (a requeued job); else None. Ranks agree on it without talking
    to each other, which is what a rank marker needs: a rank of a restarted run must not complete a bundle with
    the ranks an earlier launch landed (their data differ; see docs/capture.md)."""
    env = os.environ if environ is None else environ
    given = env.get(ENV_RUN_ID, "").strip()
    if given:
        if len(given) > MAX_RUN_ID or not _RUN_ID.fullmatch(given):
            raise _bad(ENV_RUN_ID, given[:80], f"expected up to {MAX_RUN_ID} printable characters without spaces")
        return given
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic.lower() != "none":
        return f"torchelastic:{elastic}:{env.get('TORCHELASTIC_RESTART_COUNT', '0').strip() or '0'}"[:MAX_RUN_ID]
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        return f"slurm:{job}:{env.get('SLURM_RESTART_COUNT', '0').strip() or '0'}"[:MAX_RUN_ID]
    return None


def choose_writer(writer: str, writer_priority: str, capture_dir: str, store_given: bool) -> str:
    """The writer mode ("process" or "thread") of CaptureManager's options `writer` and `writer_priority`, for a
    manager given `capture_dir` and, if `store_given`, a store object."""
    if writer not in WRITER_MODES:
        raise ValueError(f"writer must be one of {', '.join(WRITER_MODES)}, got {writer!r}")
    if writer_priority not in WRITER_PRIORITIES:
        raise ValueError(f"writer_priority must be one of {', '.join(WRITER_PRIORITIES)}, got {writer_priority!r}")
    # a store object given here (or an in-memory one) lives in this process only
    in_process_only = store_given or capture_dir.startswith("memory://")
    if writer == "process" and in_process_only:
        raise ValueError(
            "writer='process' needs a path or URL the writer process can open itself, "
            "not a store object or a memory:// store"
        )
    if writer == "auto":
        # a process of its own keeps the writer's Python work off training's GIL
        return "thread" if in_process_only else "process"
    return writer


def check_env_writer(writer: str, value: str, capture_dir: str, store_given: bool, variable: str = ENV_WRITER) -> None:
    """CaptureConfigError naming `variable` (TRAJECTORY_REPLAY_CAPTURE_WRITER or its older name, set to `value`)
    when `choose_writer` refuses its `writer` for this capture directory (and, if `store_given`, a store object the
    program passes)."""
    try:
        choose_writer(writer, WRITER_PRIORITIES[0], capture_dir, store_given)
    except ValueError as exc:
        raise _bad(variable, value, f"{exc} (use thread or auto)") from None


def producer_ranks(rank: int, expected_ranks: Sequence[int] | None) -> list[int]:
    """The producer ranks of one bundle, sorted (default: `rank` alone); `rank` must be among them."""
    ranks = sorted({int(r) for r in expected_ranks}) if expected_ranks is not None else [rank]
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not among expected ranks {ranks}")
    return ranks


__all__ = [
    "CaptureConfig",
    "CaptureConfigError",
    "CapturePolicy",
    "DEFAULT_RECORDER_AFTER",
    "DEFAULT_RECORDER_MAX_BYTES",
    "ENV_POLICY",
    "ENV_SPOOL",
    "POLICY_KINDS",
    "parse_policy",
    "parse_spool",
    "choose_policy",
    "default_spool",
    "DEFAULT_SPOOL",
    "policy_of",
    "ENV_CAPTURE",
    "ENV_DIR",
    "ENV_ROLLOUTS",
    "ENV_RUN_ID",
    "ENV_STEPS",
    "ENV_WRITER",
    "OLDER_NAMES",
    "read_variable",
    "run_identity",
    "WRITER_MODES",
    "WRITER_PRIORITIES",
    "check_env_writer",
    "choose_writer",
    "load_config",
    "parse_dir",
    "parse_rollouts",
    "parse_steps",
    "parse_switch",
    "parse_writer",
    "producer_ranks",
]
