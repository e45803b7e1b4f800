"""The older "V1" directory bundle format: its writer, and a verifying reader that serves it as a ReplaySource.

Layout, as the older tool writes it:

    <bundle>/manifest.json index.json expected.json payloads/<name>.pt
    <bundle>/COMPLETE.<r>   {actor_step_id, rollout_id, payloads, metadata, expected_ranks}
    <bundle>/COMPLETE       {ranks, expected_ranks, metadata}              (no bundle id)

    several producers:
    <bundle>/rank-<r>/...   one bundle as above per rank
    <bundle>/COMPLETE.<r>   the rank's marker plus its `relpath` (rank-<r>)
    <bundle>/COMPLETE       {ranks, shards: {"<r>": COMPLETE.<r>}}       (once every rank landed)

Its capture directories name bundles `replay-<R>-<S>` (step level) and `replay-rollout-<R>`
(rollout level); `capture_dir_name` gives the name, and readers find bundles by their identity,
whatever the directory is called. Multi-rank captures of that tool number samples per rank (every
rank starts at `s-0` with its own data): replay decides from the content which ranks are replicas.

JSON is written with indent 2, sorted keys, UTF-8 and a trailing newline; checksums are SHA-256
of those exact bytes. Payloads are files in torch.save's format (`torchsave` writes them without
torch), loaded only with `weights_only=True`.
The reader checks in the documented order and turns every problem into a one-line BundleError
naming the file and the field or payload; nothing is trusted before its hash is checked.
The tool's later format 2 (no reward stages, per-token rewards) is refused in one line.
"""

from __future__ import annotations

import hashlib
import io
import json
import operator
import os
import re
import stat
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.codec import manifest_dtype
from trajectory_replay.bundle.documents import DEFAULT_MAX_DOCUMENT_BYTES, check_document_size, max_document_bytes
from trajectory_replay.bundle.documents import parse_json as _parse_json
from trajectory_replay.bundle.documents import validate_document as _validate
from trajectory_replay.bundle.markers import MAX_RANK, MAX_RANKS
from trajectory_replay.bundle.paths import check_directory, find_v1_bundles, is_v1_bundle, rank_of_dir
from trajectory_replay.bundle.schema import (
    TEXT_FIELDS,
    ActorStepId,
    BundleIndex,
    Expected,
    Manifest,
    RecomputeConfig,
    StageContract,
    StageId,
    check_name,
)
from trajectory_replay.bundle.stage_io import LOSS_MASK, RECORDED_PAYLOADS
from trajectory_replay.bundle.status import BundleStatus
from trajectory_replay.bundle.torchsave import RawTensor, encode_pt, raw_tensor
from trajectory_replay.errors import (
    BundleError,
    IncompleteBundleError,
    TrajectoryReplayError,
    UnsupportedError,
)
from trajectory_replay.outcome import QUOTE_LIMIT, one_line

if TYPE_CHECKING:  # torch is imported where payloads are decoded; writing them needs none
    import torch

PathLike = Union[str, "os.PathLike[str]"]
Payload = Union["torch.Tensor", RawTensor]
"""What the writer takes for a payload: a tensor, or its bytes, dtype and shape as they are."""

V1_FORMAT_VERSION = "1.0.0"
V1_CODEC = "torch-pt"
"""Codec name given to V1 payloads in our PayloadSpec."""
MAX_DOCUMENT_BYTES = DEFAULT_MAX_DOCUMENT_BYTES
"""The default bound on a JSON document; the bound in force is `documents.max_document_bytes()`."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

_M = TypeVar("_M", bound=BaseModel)


# --------------------------------------------------------------------------- V1 document models


class _V1Model(BaseModel):
    """Base of the V1-only documents: unknown keys are ignored, as the older tool did."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def _check_sha256(value: str) -> str:
    """`value` if it is a lowercase hex SHA-256, else ValueError."""
    if not _SHA256_HEX.fullmatch(value):
        raise ValueError(f"invalid sha256 {value!r}: expected 64 lowercase hex digits")
    return value


def _check_ranks(ranks: list[int]) -> list[int]:
    """`ranks` sorted, if it is a non-empty list of distinct non-negative integers, else ValueError."""
    if not ranks:
        raise ValueError("must list at least one rank")
    if len(ranks) > MAX_RANKS:
        raise ValueError(f"lists {len(ranks)} ranks, more than the bound of {MAX_RANKS}")
    if len(set(ranks)) != len(ranks) or any(not 0 <= r <= MAX_RANK for r in ranks):
        raise ValueError(
            f"ranks {ranks[:16]}{'…' if len(ranks) > 16 else ''} must be distinct integers in [0, {MAX_RANK}]"
        )
    return sorted(ranks)


class V1Metadata(_V1Model):
    """SHA-256 of the three JSON documents, as recorded in COMPLETE."""

    manifest_json: str = Field(alias="manifest.json")
    index_json: str = Field(alias="index.json")
    expected_json: str = Field(alias="expected.json")

    @field_validator("manifest_json", "index_json", "expected_json")
    @classmethod
    def _sha256(cls, v: str) -> str:
        return _check_sha256(v)

    def by_document(self) -> dict[str, str]:
        """{document file name: sha256}."""
        return self.model_dump(by_alias=True)


class V1Ranks(_V1Model):
    """The ranks a COMPLETE lands and the ranks the bundle expects (both kept sorted)."""

    ranks: list[int]
    expected_ranks: list[int]

    @field_validator("ranks", "expected_ranks")
    @classmethod
    def _ranks(cls, v: list[int]) -> list[int]:
        return _check_ranks(v)

    @model_validator(mode="after")
    def _landed_are_expected(self) -> V1Ranks:
        if not set(self.ranks) <= set(self.expected_ranks):
            raise ValueError(f"ranks {self.ranks} are not all in expected_ranks {self.expected_ranks}")
        return self


class V1Complete(V1Ranks):
    """COMPLETE of one bundle (a single producer, or one rank-<r> directory)."""

    metadata: V1Metadata


class V1Shard(_V1Model):
    """COMPLETE.<r>: rank r landed; also the entries of the parent COMPLETE's `shards`. The copy inside the
    bundle directory itself (single producer, or rank-<r>/) has no `relpath`."""

    actor_step_id: ActorStepId | None = None
    rollout_id: int | None = None
    payloads: dict[str, str] = Field(default_factory=dict)
    metadata: V1Metadata
    expected_ranks: list[int]
    relpath: str | None = None

    @field_validator("expected_ranks")
    @classmethod
    def _ranks(cls, v: list[int]) -> list[int]:
        return _check_ranks(v)


class V1CohortComplete(_V1Model):
    """The parent COMPLETE of a multi-rank bundle: every expected shard has landed."""

    ranks: list[int]
    shards: dict[str, V1Shard]

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, v: list[int]) -> list[int]:
        return _check_ranks(v)

    @model_validator(mode="after")
    def _shards_match_ranks(self) -> V1CohortComplete:
        if sorted(self.shards) != sorted(str(r) for r in self.ranks):
            raise ValueError(f"shards {sorted(self.shards)} do not match ranks {self.ranks}")
        for key, shard in self.shards.items():
            # relpath names a directory we will open: only the one fixed form is allowed
            if shard.relpath != f"rank-{key}":
                raise ValueError(f"shard {key}: relpath {shard.relpath!r} must be 'rank-{key}'")
        return self


class V1PayloadEntry(_V1Model):
    """One payload in a V1 manifest."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int = Field(ge=0)
    sha256: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # the name becomes a file name under payloads/, so this also keeps reads inside the bundle
        return check_name(v, "payload name")

    @field_validator("sha256")
    @classmethod
    def _sha256(cls, v: str) -> str:
        return _check_sha256(v)


class V1Manifest(_V1Model):
    """manifest.json as the older tool wrote it (major version 1)."""

    format_version: str
    bundle_id: str
    producer: dict[str, Any] = Field(default_factory=dict)
    stage_contracts: dict[StageId, StageContract] = Field(default_factory=dict)
    payloads: dict[str, V1PayloadEntry] = Field(default_factory=dict)
    comparison_policy: dict[str, Any] = Field(default_factory=dict)
    redaction: dict[str, str] = Field(default_factory=dict)

    @field_validator("format_version")
    @classmethod
    def _major_1(cls, v: str) -> str:
        if v.split(".", 1)[0] != "1":
            raise ValueError(f"unsupported format_version {v!r}: major version must be 1")
        return v

    @model_validator(mode="after")
    def _keys_match(self) -> V1Manifest:
        for key, entry in self.payloads.items():
            if entry.name != key:
                raise ValueError(f"payload {key!r} has name {entry.name!r}")
        for stage, contract in self.stage_contracts.items():
            if contract.stage != stage:
                raise ValueError(f"stage contract {stage.value!r} declares stage {contract.stage.value!r}")
        return self

    def manifest_data(self) -> dict[str, Any]:
        """Input for our Manifest model; a payload is `expected` when a contract says so, or it is one that always
        holds recorded outputs (`stage_io.RECORDED_PAYLOADS`)."""
        expected_names = set(RECORDED_PAYLOADS)
        for contract in self.stage_contracts.values():
            expected_names.update(contract.expected_outputs)
        payloads = {
            name: {
                "name": name,
                "role": "expected" if name in expected_names else "input",
                "codec": V1_CODEC,
                "dtype": entry.dtype,
                "shape": entry.shape,
                "size": entry.bytes,
            }
            for name, entry in self.payloads.items()
        }
        return {
            "format_version": self.format_version,
            "bundle_id": self.bundle_id,
            "producer": self.producer,
            "stage_contracts": {
                stage.value: contract.model_dump(mode="json") for stage, contract in self.stage_contracts.items()
            },
            "payloads": payloads,
            "comparison_policy": self.comparison_policy,
            "redaction": self.redaction,
        }


# --------------------------------------------------------------------------- shared helpers


def _read_bounded(path: Path, label: str, limit: int) -> bytes:
    """The bytes of `path`, refusing a missing file or one larger than `limit` before reading it. Opened without
    blocking and read only when it is a regular file: a FIFO would block, a device (/dev/zero) never end."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb") as f:
            info = os.fstat(f.fileno())
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError
            if not stat.S_ISREG(info.st_mode):
                raise BundleError(f"{label}: not a regular file (a FIFO, device or socket); replace it with the file")
            size = info.st_size
            if size > limit:
                raise BundleError(f"{label}: {size} bytes exceeds the limit of {limit} bytes")
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise BundleError(f"{label}: missing") from None
    except IsADirectoryError:
        raise BundleError(f"{label}: is a directory, expected a file") from None
    except OSError as exc:
        raise BundleError(f"{label}: cannot be read ({one_line(exc.strerror or exc, QUOTE_LIMIT)})") from None
    if len(data) > limit:  # the file grew while we read it
        raise BundleError(f"{label}: exceeds the limit of {limit} bytes")
    return data


def _read_document(path: Path, label: str) -> bytes:
    """A JSON document's bytes, refused before reading when it is over the document bound."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # _read_bounded names what is wrong with the path
    check_document_size(size, label)
    return _read_bounded(path, label, max_document_bytes())


def _load_document(path: Path, label: str, model: type[_M], data: bytes | None = None) -> tuple[Any, _M]:
    """Read (unless `data` is given), parse and validate one JSON document: (raw value, model)."""
    if data is None:
        data = _read_document(path, label)
    raw = _parse_json(data, label)
    return raw, _validate(model, raw, label)


def _sha256(data: bytes) -> str:
    """Lowercase hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def _short(digest: str) -> str:
    """A digest abbreviated for messages."""
    return digest[:12] + "…"


def _json_bytes(value: Any) -> bytes:
    """The V1 encoding: indent 2, sorted keys, UTF-8, trailing newline (its SHA-256 is the checksum)."""
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _label_of(directory: Path) -> str:
    """How messages name a bundle directory: `b-1`, or `b-1/rank-0` for a rank of a multi-rank bundle."""
    if rank_of_dir(directory) is not None:
        return f"{directory.parent.name}/{directory.name}"
    return directory.name


# --------------------------------------------------------------------------- tensors


def _payload_file(where: str, value: object) -> tuple[bytes, RawTensor]:
    """The `.pt` file of one payload and what it holds. `value` is a tensor or a RawTensor (bytes, dtype,
    shape): export hands over a native payload's bytes as they are, so it needs no torch."""
    try:
        if isinstance(value, tuple) and len(value) == 3:
            raw = RawTensor(*value)
        else:
            torch = sys.modules.get("torch")  # no tensor can exist unless torch is loaded already
            if torch is None or not isinstance(value, torch.Tensor):
                raise BundleError(f"expected a torch.Tensor, got {type(value).__name__}")
            raw = raw_tensor(value)
        return encode_pt(*raw), raw
    except BundleError as exc:
        raise BundleError(f"{where}: {exc}") from None


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _safe_loader_reason(exc: BaseException) -> str:
    """Why torch's safe loader refused the file, in our own words. torch's message goes on to advise allowlisting
    what it refused, or loading with its unsafe loader; a payload file is never worth either, so none of that
    message is repeated, only the name of what the pickle asked for."""
    import pickle

    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
        found = _REFUSED_GLOBAL.search(text)
        what = f"it calls or builds {one_line(found.group(1), 80)}" if found else "it holds pickled objects"
        return f"refused by the safe loader: {what}; only plain tensors are loaded from payload files"
    for line in text.splitlines():  # a zip or format error: its first line, unless it is advice about loading
        line = line.strip()
        if (
            line
            and "weights_only" not in line
            and not line.startswith(("Please file an issue", "Check the documentation"))
        ):
            return one_line(line, QUOTE_LIMIT)
    return type(exc).__name__


def _decode_tensor(data: bytes, label: str) -> torch.Tensor:
    """Unpickle `data` with torch's safe loader and insist on a plain strided tensor."""
    import torch

    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols it does not default to; the result is checked below anyway
            warnings.simplefilter("ignore")
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, zip errors...
        raise BundleError(f"{label}: not a loadable tensor file ({_safe_loader_reason(exc)})") from None
    if type(obj) is not torch.Tensor or obj.layout != torch.strided:
        got = type(obj).__name__ if type(obj) is not torch.Tensor else f"{obj.layout} tensor"
        raise BundleError(f"{label}: not a plain tensor (got {got})")
    return obj


# --------------------------------------------------------------------------- writer


def _write_atomic(path: Path, data: bytes, *, create_only: bool = False) -> bool:
    """Write `path` so no reader sees a partial file; with `create_only`, False (and no write) if it exists."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if not create_only:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # create-if-absent: never replaces a marker another writer landed
        except FileExistsError:
            return False
        return True
    finally:
        # after os.replace the temp name is gone; after os.link (or a failure) it must be removed
        if os.path.lexists(tmp):
            os.unlink(tmp)


V1_CONFIG_FIELDS = (
    "advantage_estimator",
    "n_samples_per_prompt",
    "grpo_std_normalization",
    "kl_loss_type",
    "kl_coef",
    "eps_clip",
    "eps_clip_high",
    "eps_clip_c",
    "entropy_coef",
)
"""The recompute config fields the older format has."""


def _v1_manifest_doc(manifest: Manifest, payload_entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """manifest.json in the V1 field names; tolerances keep only the values that are set."""
    policy = manifest.comparison_policy
    return {
        "format_version": V1_FORMAT_VERSION,
        "bundle_id": manifest.bundle_id,
        "producer": manifest.producer.model_dump(mode="json"),
        "stage_contracts": {
            stage.value: contract.model_dump(mode="json", exclude_none=contract.kernel is None)
            for stage, contract in manifest.stage_contracts.items()
        },
        "payloads": payload_entries,
        "comparison_policy": {
            "exact_fields": list(policy.exact_fields),
            "tolerances": {
                stage: tol.model_dump(mode="json", exclude_none=True) for stage, tol in policy.tolerances.items()
            },
        },
        "redaction": dict(manifest.redaction),
    }


def _v1_index_doc(index: BundleIndex) -> dict[str, Any]:
    """index.json; this project's optional text fields, policy versions and producing rollouts are left out when
    unset, as V1 never had them."""
    doc = index.model_dump(mode="json")
    # the fields V1 knew always; the others only where they differ from the default (which reproduces V1)
    defaults = RecomputeConfig().model_dump(mode="json")
    doc["config"] = {k: v for k, v in doc["config"].items() if k in V1_CONFIG_FIELDS or v != defaults[k]}
    for sample in doc["samples"]:
        for field in TEXT_FIELDS + ("policy_version", "rollout_id"):
            if sample.get(field) is None:
                sample.pop(field, None)
    return doc


def _anchor_fields(index: BundleIndex) -> dict[str, Any]:
    """The identity anchor as a rank marker records it: `actor_step_id` and `rollout_id`, both keys always.
    BundleError for a critic's step, which the older format cannot anchor (its step is the actor's)."""
    if index.identity.critic_step_id is not None:
        raise BundleError(
            f"the older format has no anchor for a critic's step ({index.identity.anchor()}): it cannot hold this "
            "bundle"
        )
    step = index.identity.actor_step_id
    return {
        "actor_step_id": None if step is None else step.model_dump(mode="json"),
        "rollout_id": index.identity.rollout_id,
    }


def _write_bundle(
    path: Path,
    manifest: Manifest,
    index: BundleIndex,
    expected: Mapping[str, Any],
    payloads: Mapping[str, Payload],
    ranks: Sequence[int],
    expected_ranks: Sequence[int],
    rank_marker: bool = True,
) -> tuple[V1Metadata, dict[str, str]]:
    """Write one V1 bundle directory, COMPLETE last; return its metadata and {payload: sha256}.

    With `rank_marker`, `COMPLETE.<r>` of the (one) producing rank comes just before COMPLETE, as the
    older tool writes it; without, the bundle looks like one from before that tool wrote rank markers."""
    label = _label_of(path)
    if manifest.bundle_id != index.bundle_id:
        raise BundleError(
            f"{label}: manifest bundle_id {manifest.bundle_id!r} differs from index bundle_id {index.bundle_id!r}"
        )
    rank_sets = _validate(V1Ranks, {"ranks": list(ranks), "expected_ranks": list(expected_ranks)}, f"{label}/COMPLETE")
    anchor = _anchor_fields(index)  # before anything is written: a critic's step has no V1 anchor
    if (path / "COMPLETE").exists():
        raise BundleError(f"{label}/COMPLETE: already exists; a finished bundle is never rewritten")

    encoded: dict[str, tuple[bytes, RawTensor]] = {}
    for name, value in payloads.items():
        if name == LOSS_MASK:
            raise BundleError(
                f"{label}/payloads/{name}.pt: V1 keeps loss masks in index.json samples, not as a payload"
            )
        try:
            check_name(name, "payload name")
        except ValueError as exc:
            raise BundleError(f"{label}/payloads: {exc}") from None
        encoded[name] = _payload_file(f"{label}/payloads/{name}.pt", value)

    (path / "payloads").mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    for name, (data, raw) in encoded.items():
        _write_atomic(path / "payloads" / f"{name}.pt", data)
        entries[name] = {
            "name": name,
            "dtype": manifest_dtype(raw.dtype),
            "shape": list(raw.shape),
            "bytes": len(data),
            "sha256": _sha256(data),
        }

    documents = {
        "manifest.json": _v1_manifest_doc(manifest, entries),
        "index.json": _v1_index_doc(index),
        "expected.json": dict(expected),
    }
    hashes: dict[str, str] = {}
    for filename, doc in documents.items():
        data = _json_bytes(doc)
        _write_atomic(path / filename, data)
        hashes[filename] = _sha256(data)

    metadata = V1Metadata.model_validate(hashes)
    payload_shas = {name: entry["sha256"] for name, entry in entries.items()}
    if rank_marker and len(rank_sets.ranks) == 1:
        marker = {
            **anchor,
            "payloads": payload_shas,
            "metadata": metadata.by_document(),
            "expected_ranks": rank_sets.expected_ranks,
        }
        _write_atomic(path / f"COMPLETE.{rank_sets.ranks[0]}", _json_bytes(marker))
    complete_doc = {
        "ranks": rank_sets.ranks,
        "expected_ranks": rank_sets.expected_ranks,
        "metadata": metadata.by_document(),
    }
    if not _write_atomic(path / "COMPLETE", _json_bytes(complete_doc), create_only=True):
        raise BundleError(f"{label}/COMPLETE: another writer finished this bundle first")
    return metadata, payload_shas


def write_v1_bundle(
    path: PathLike,
    manifest: Manifest,
    index: BundleIndex,
    expected: Mapping[str, Any],
    payloads: Mapping[str, Payload],
    *,
    ranks: Sequence[int] = (0,),
    expected_ranks: Sequence[int] | None = None,
    rank_marker: bool = True,
) -> Path:
    """Write a single-producer V1 bundle directory at `path` (the payload table is built from `payloads`,
    tensors or RawTensor values) and return it: COMPLETE.<r> then COMPLETE `{ranks, expected_ranks, metadata}`, as the
    older tool does
    (`rank_marker=False` leaves COMPLETE.<r> out)."""
    target = Path(path)
    _write_bundle(
        target,
        manifest,
        index,
        expected,
        payloads,
        ranks,
        ranks if expected_ranks is None else expected_ranks,
        rank_marker,
    )
    return target


def capture_dir_name(index: BundleIndex) -> str:
    """The directory the older tool's capture gives a bundle: `replay-<R>-<S>` for a step-level bundle,
    `replay-rollout-<R>` for a rollout-level one."""
    step = index.identity.actor_step_id
    if step is not None:
        return f"replay-{step.rollout_id}-{step.step_id}"
    return f"replay-rollout-{index.identity.rollout_id}"


ShardDocs = tuple[Manifest, BundleIndex, Mapping[str, Any], Mapping[str, Payload]]


def write_v1_multirank(
    path: PathLike,
    shards: Mapping[int, ShardDocs],
    expected_ranks: Sequence[int],
    *,
    land: Sequence[int] | None = None,
    rank_markers: bool = True,
) -> Path:
    """Write ranks `land` (default: all of `shards`) of a multi-rank V1 bundle as the older tool does: each
    rank a full bundle in `rank-<r>/` (with its own COMPLETE.<r> unless `rank_markers` is False), then
    `COMPLETE.<r>` (with `relpath`) beside them, and the parent COMPLETE `{ranks, shards}` once all landed.
    Shards may number their samples per rank (each from `s-0`), as that tool's captures do."""
    root = Path(path)
    expected = sorted(expected_ranks)
    to_land = sorted(shards) if land is None else sorted(land)
    missing = [r for r in to_land if r not in shards]
    if missing or not set(to_land) <= set(expected):
        raise BundleError(f"{root.name}: ranks to land {to_land} must have shards and be in expected_ranks {expected}")
    for rank in to_land:
        _anchor_fields(shards[rank][1])  # before anything is written: a critic's step has no V1 anchor
    root.mkdir(parents=True, exist_ok=True)
    for rank in to_land:
        manifest, index, docs, payloads = shards[rank]
        relpath = f"rank-{rank}"
        metadata, payload_shas = _write_bundle(
            root / relpath, manifest, index, docs, payloads, [rank], expected, rank_markers
        )
        marker = {
            **_anchor_fields(index),
            "payloads": payload_shas,
            "metadata": metadata.by_document(),
            "expected_ranks": expected,
            "relpath": relpath,
        }
        if not _write_atomic(root / f"COMPLETE.{rank}", _json_bytes(marker), create_only=True):
            raise BundleError(f"{root.name}/COMPLETE.{rank}: already exists")
    _finalize_cohort(root, expected)
    return root


def _finalize_cohort(root: Path, expected_ranks: list[int]) -> bool:
    """Write the parent COMPLETE from the rank markers once every expected rank has landed; True if it exists."""
    if not all((root / f"COMPLETE.{r}").exists() for r in expected_ranks):
        return False
    shards = {}
    for rank in expected_ranks:
        label = f"{root.name}/COMPLETE.{rank}"
        raw, marker = _load_document(root / f"COMPLETE.{rank}", label, V1Shard)
        if marker.expected_ranks != expected_ranks:
            raise BundleError(f"{label}: expected_ranks {marker.expected_ranks} differ from {expected_ranks}")
        shards[str(rank)] = raw
    data = _json_bytes({"ranks": expected_ranks, "shards": shards})
    if not _write_atomic(root / "COMPLETE", data, create_only=True):
        # another rank finalized first: fine when it wrote the same cohort
        if _read_document(root / "COMPLETE", f"{root.name}/COMPLETE") != data:
            raise BundleError(f"{root.name}/COMPLETE: already exists with a different cohort")
    return True


# --------------------------------------------------------------------------- reader


class LegacyBundle:
    """One verified V1 bundle (or one rank of a multi-rank one) as a ReplaySource; payloads load lazily, once."""

    bundle_id: str
    manifest: Manifest
    index: BundleIndex
    expected: dict[str, Any]
    rank: int | None

    def __init__(
        self,
        path: Path,
        label: str,
        rank: int | None,
        v1_manifest: V1Manifest,
        manifest: Manifest,
        index: BundleIndex,
        expected: dict[str, Any],
        metadata: V1Metadata,
    ) -> None:
        self.path = path
        self.label = label
        self.rank = rank
        self.bundle_id = manifest.bundle_id
        self.manifest = manifest
        self.index = index
        self.expected = expected
        self._v1_manifest = v1_manifest
        self._metadata = metadata
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def sha256_metadata(self) -> dict[str, str]:
        """SHA-256 of manifest.json, index.json and expected.json, as verified against COMPLETE."""
        return self._metadata.by_document()

    @property
    def v1_digests(self) -> dict[str, str]:
        """SHA-256 of every payload file by payload name, as the V1 manifest declares them."""
        return {name: entry.sha256 for name, entry in self._v1_manifest.payloads.items()}

    @property
    def payload_digests(self) -> dict[str, str]:
        """`sha256:<hex>` of every payload by name: equal digests mean equal payloads (replay compares ranks
        by them without loading anything)."""
        return {name: f"sha256:{sha}" for name, sha in self.v1_digests.items()}

    def has_payload(self, name: str) -> bool:
        """True when the bundle holds per-token payload `name`; `loss_mask` always exists (from the index)."""
        return name == LOSS_MASK or name in self._v1_manifest.payloads

    def load_payload(self, name: str, samples: Sequence[int] | None = None) -> torch.Tensor:
        """The flat per-token tensor `name`, or only the rows of sample positions `samples`, in that order."""
        if name == LOSS_MASK:
            return self._loss_mask(samples)
        tensor = self._payload(name)
        if samples is None:
            return tensor
        if tensor.dim() != 1:
            raise BundleError(f"{self.label}/payloads/{name}.pt: shape {list(tensor.shape)} is not flat per-token")
        offsets = self._token_offsets()
        if tensor.numel() != offsets[-1]:
            raise BundleError(
                f"{self.label}/payloads/{name}.pt: {tensor.numel()} elements, but the index samples "
                f"have {offsets[-1]} response tokens"
            )
        positions = self._check_positions(samples)
        import torch

        return torch.cat([tensor[offsets[i] : offsets[i + 1]] for i in positions]) if positions else tensor.new_empty(0)

    def verify_payloads(self) -> None:
        """Load (and so verify) every payload now instead of on first use."""
        for name in self._v1_manifest.payloads:
            self._payload(name)

    def _payload(self, name: str) -> torch.Tensor:
        """Verify size and SHA-256, load and check dtype/shape, once; later calls hit the cache."""
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        entry = self._v1_manifest.payloads.get(name)
        if entry is None:
            raise BundleError(
                f"{self.label}: no payload {name!r} (manifest.json lists "
                f"{sorted(self._v1_manifest.payloads) or 'none'})"
            )
        label = f"{self.label}/payloads/{name}.pt"
        data = _read_payload_file(self.path / "payloads" / f"{name}.pt", label, entry)
        if _sha256(data) != entry.sha256:
            raise BundleError(
                f"{label}: sha256 mismatch (expected {_short(entry.sha256)}, got {_short(_sha256(data))})"
            )
        tensor = _decode_tensor(data, label)
        if str(tensor.dtype) != entry.dtype:
            raise BundleError(f"{label}: dtype {tensor.dtype} differs from manifest dtype {entry.dtype}")
        if list(tensor.shape) != entry.shape:
            raise BundleError(f"{label}: shape {list(tensor.shape)} differs from manifest shape {entry.shape}")
        self._cache[name] = tensor
        return tensor

    def _loss_mask(self, samples: Sequence[int] | None) -> torch.Tensor:
        """The per-token uint8 loss mask built from the index samples' loss_mask lists."""
        records = self.index.samples
        positions = range(len(records)) if samples is None else self._check_positions(samples)
        values: list[int] = []
        for i in positions:
            mask = records[i].loss_mask
            if any(v not in (0, 1) for v in mask):
                raise BundleError(
                    f"{self.label}/index.json: sample {records[i].sample_id!r} loss_mask holds "
                    "values other than 0 and 1"
                )
            values.extend(mask)
        import torch

        return torch.tensor(values, dtype=torch.uint8)

    def _token_offsets(self) -> list[int]:
        """Cumulative response_length: sample i's rows are [offsets[i], offsets[i + 1])."""
        offsets = [0]
        for record in self.index.samples:
            if record.response_length < 0:
                raise BundleError(
                    f"{self.label}/index.json: sample {record.sample_id!r} has negative "
                    f"response_length {record.response_length}"
                )
            offsets.append(offsets[-1] + record.response_length)
        return offsets

    def _check_positions(self, samples: Sequence[int]) -> list[int]:
        """`samples` as Python ints, each a valid position in the index."""
        count = len(self.index.samples)
        try:
            positions = [operator.index(p) for p in samples]  # accepts numpy/torch integers, refuses floats
        except TypeError:
            raise BundleError(f"{self.label}: sample positions must be integers, got {list(samples)!r}") from None
        bad = [p for p in positions if not 0 <= p < count]
        if bad:
            raise BundleError(f"{self.label}: sample positions {bad} out of range (bundle has {count} samples)")
        return positions

    def __repr__(self) -> str:
        return f"LegacyBundle({str(self.path)!r}, bundle_id={self.bundle_id!r}, rank={self.rank})"


def _check_payload_file(path: Path, label: str, entry: V1PayloadEntry) -> None:
    """Refuse a missing payload file or one whose size differs from the manifest, without reading it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise BundleError(f"{label}: missing (listed in manifest.json)") from None
    except OSError as exc:
        raise BundleError(f"{label}: cannot be read ({one_line(exc.strerror or exc, QUOTE_LIMIT)})") from None
    if size != entry.bytes:
        raise BundleError(f"{label}: size {size} bytes differs from manifest bytes {entry.bytes}")


def _read_payload_file(path: Path, label: str, entry: V1PayloadEntry) -> bytes:
    """The payload's bytes, its size checked against the manifest before reading."""
    _check_payload_file(path, label, entry)
    return _read_bounded(path, label, entry.bytes)


def _read_complete(directory: Path, label: str) -> dict[str, Any]:
    """COMPLETE's parsed JSON object; a missing one means the bundle is not finished."""
    if not (directory / "COMPLETE").is_file():
        raise IncompleteBundleError(f"{label}: incomplete bundle (COMPLETE is missing)")
    return _parse_json(_read_document(directory / "COMPLETE", f"{label}/COMPLETE"), f"{label}/COMPLETE")


def _check_parent_cohort(directory: Path, label: str, rank: int, complete: V1Complete) -> V1Shard:
    """The parent COMPLETE's entry for `rank`; refused until the parent exists and lists every expected rank."""
    parent_label = f"{directory.parent.name}/COMPLETE"
    if not (directory.parent / "COMPLETE").is_file():
        raise IncompleteBundleError(
            f"{label}: refused until the multi-rank bundle is complete ({parent_label} is missing)"
        )
    _, cohort = _load_document(directory.parent / "COMPLETE", parent_label, V1CohortComplete)
    if sorted(cohort.ranks) != complete.expected_ranks:
        raise BundleError(
            f"{parent_label}: ranks {sorted(cohort.ranks)} differ from expected_ranks "
            f"{complete.expected_ranks} of {label}"
        )
    return cohort.shards[str(rank)]


def _check_shard(
    directory: Path, label: str, shard: V1Shard, complete: V1Complete, manifest: V1Manifest, index: BundleIndex
) -> None:
    """The parent COMPLETE's shard entry must describe exactly this rank bundle."""
    where = f"{directory.parent.name}/COMPLETE: shard {directory.name}"
    if shard.metadata != complete.metadata:
        raise BundleError(f"{where}: metadata differs from {label}/COMPLETE")
    if shard.payloads != {name: entry.sha256 for name, entry in manifest.payloads.items()}:
        raise BundleError(f"{where}: payloads differ from {label}/manifest.json")
    if sorted(shard.expected_ranks) != complete.expected_ranks:
        raise BundleError(f"{where}: expected_ranks {sorted(shard.expected_ranks)} differ from {label}/COMPLETE")
    identity = index.identity
    if shard.actor_step_id != identity.actor_step_id or shard.rollout_id != identity.rollout_id:
        raise BundleError(f"{where}: anchor differs from {label}/index.json identity ({identity.anchor()})")


def _check_own_marker(
    directory: Path, label: str, complete: V1Complete, manifest: V1Manifest, index: BundleIndex
) -> None:
    """The bundle's own COMPLETE.<r> (the older tool writes one beside COMPLETE) must describe this bundle;
    bundles written before that tool wrote them have none, which is fine."""
    for rank in complete.ranks:
        path = directory / f"COMPLETE.{rank}"
        if not path.is_file():
            continue
        where = f"{label}/COMPLETE.{rank}"
        _, marker = _load_document(path, where, V1Shard)
        if marker.metadata != complete.metadata:
            raise BundleError(f"{where}: metadata differs from {label}/COMPLETE")
        if marker.payloads != {name: entry.sha256 for name, entry in manifest.payloads.items()}:
            raise BundleError(f"{where}: payloads differ from {label}/manifest.json")
        if sorted(marker.expected_ranks) != complete.expected_ranks:
            raise BundleError(f"{where}: expected_ranks {sorted(marker.expected_ranks)} differ from {label}/COMPLETE")
        identity = index.identity
        if marker.actor_step_id != identity.actor_step_id or marker.rollout_id != identity.rollout_id:
            raise BundleError(f"{where}: anchor differs from {label}/index.json identity ({identity.anchor()})")


def _check_format_version(raw: Any, label: str) -> None:
    """Refuse the older tool's format 2 by name: its records and stages differ (reward stages dropped, no
    raw_reward, a reward may be a per-token list), so reading it as format 1 would replay the wrong thing."""
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if isinstance(version, str) and version.split(".", 1)[0] == "2":
        raise UnsupportedError(
            f"{label}: format_version {version!r} is the older tool's format 2 (no reward "
            "stages, per-token rewards), which this version does not read; only format 1 is "
            "read"
        )


def open_v1_bundle(path: PathLike) -> LegacyBundle:
    """Open and verify one V1 bundle directory (a single producer, or `<bundle>/rank-<r>`)."""
    directory = Path(path)
    label = _label_of(directory)
    check_directory(directory)

    raw_complete = _read_complete(directory, label)
    if "shards" in raw_complete:
        raise BundleError(f"{label}: a multi-rank bundle root; open it with open_v1 (one source per rank)")
    complete = _validate(V1Complete, raw_complete, f"{label}/COMPLETE")

    rank = rank_of_dir(directory)
    if rank is not None and complete.ranks != [rank]:
        raise BundleError(f"{label}/COMPLETE: ranks {complete.ranks} do not match the directory (expected [{rank}])")
    if rank is None and complete.ranks != complete.expected_ranks:
        raise IncompleteBundleError(
            f"{label}/COMPLETE: incomplete bundle (ranks {complete.ranks} of expected {complete.expected_ranks})"
        )
    shard = _check_parent_cohort(directory, label, rank, complete) if rank is not None else None

    documents: dict[str, bytes] = {}
    for filename, sha in complete.metadata.by_document().items():
        data = _read_document(directory / filename, f"{label}/{filename}")
        if _sha256(data) != sha:
            raise BundleError(
                f"{label}/{filename}: sha256 mismatch with COMPLETE metadata "
                f"(expected {_short(sha)}, got {_short(_sha256(data))})"
            )
        documents[filename] = data

    raw_manifest = _parse_json(documents["manifest.json"], f"{label}/manifest.json")
    _check_format_version(raw_manifest, f"{label}/manifest.json")
    v1_manifest = _validate(V1Manifest, raw_manifest, f"{label}/manifest.json")
    manifest = _validate(Manifest, v1_manifest.manifest_data(), f"{label}/manifest.json")
    _, index = _load_document(directory / "index.json", f"{label}/index.json", BundleIndex, documents["index.json"])
    expected, _ = _load_document(
        directory / "expected.json", f"{label}/expected.json", Expected, documents["expected.json"]
    )
    if manifest.bundle_id != index.bundle_id:
        raise BundleError(
            f"{label}/index.json: bundle_id {index.bundle_id!r} differs from manifest.json "
            f"bundle_id {manifest.bundle_id!r}"
        )
    if shard is not None:
        _check_shard(directory, label, shard, complete, v1_manifest, index)
    _check_own_marker(directory, label, complete, v1_manifest, index)

    # existence and size are cheap; SHA-256 and the tensor checks wait for the first load of each payload
    for name, entry in v1_manifest.payloads.items():
        _check_payload_file(directory / "payloads" / f"{name}.pt", f"{label}/payloads/{name}.pt", entry)
    return LegacyBundle(directory, label, rank, v1_manifest, manifest, index, expected, complete.metadata)


def open_v1(path: PathLike) -> list[LegacyBundle]:
    """Open a V1 bundle as one source per rank, in rank order (a single-producer bundle gives one)."""
    root = Path(path)
    label = _label_of(root)
    check_directory(root)
    raw_complete = _read_complete(root, label)
    if "shards" not in raw_complete:
        return [open_v1_bundle(root)]
    cohort = _validate(V1CohortComplete, raw_complete, f"{label}/COMPLETE")
    sources = [open_v1_bundle(root / f"rank-{rank}") for rank in sorted(cohort.ranks)]
    ids = {source.bundle_id for source in sources}
    if len(ids) != 1:
        raise BundleError(f"{label}: ranks disagree on bundle_id ({sorted(ids)})")
    return sources


@dataclass(frozen=True)
class V1Status:
    """What a listing shows of one V1 bundle directory, in the states of `status.BundleStatus`."""

    path: Path
    status: BundleStatus
    """complete | incomplete | finalizable (every rank landed, the parent COMPLETE missing; no reader writes it) |
    corrupt | unsupported (the older tool's format 2)"""
    rollout_id: int | None = None
    step_id: int | None = None
    """The identity anchor (step level when step_id is set), when known."""
    ranks: tuple[int, ...] = ()
    expected_ranks: tuple[int, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    payload_bytes: int = 0
    """Sum of the payload file sizes of every rank (the format stores each payload whole, once per rank)."""
    mtime: float | None = None
    detail: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def anchor(self) -> Anchor | None:
        """The identity's anchor, read as a native bundle's `BundleState.anchor` (None when unknown)."""
        return None if self.rollout_id is None else Anchor(self.rollout_id, self.step_id)

    @property
    def landed_ranks(self) -> list[int]:
        return list(self.ranks)


def v1_status(path: PathLike) -> V1Status:
    """The status of the V1 bundle at `path`, opened and verified as a replay would (payload bytes are not
    hashed); never raises for a bundle that is broken or unfinished, which is what its status says."""
    directory = Path(path)
    try:
        sources = open_v1(directory)
        complete = _parse_json(
            _read_document(directory / "COMPLETE", f"{directory.name}/COMPLETE"), f"{directory.name}/COMPLETE"
        )
        mtime = (directory / "COMPLETE").stat().st_mtime
    except IncompleteBundleError as exc:
        return _unfinished_status(directory, str(exc))
    except UnsupportedError as exc:
        return V1Status(directory, BundleStatus.UNSUPPORTED, detail=one_line(exc, QUOTE_LIMIT))
    except (TrajectoryReplayError, OSError) as exc:
        return V1Status(directory, BundleStatus.CORRUPT, detail=one_line(exc, QUOTE_LIMIT))
    ident = sources[0].index.identity
    step = ident.actor_step_id
    ranks = sorted(int(r) for r in complete.get("ranks", [])) or [0]
    expected = sorted(complete.get("expected_ranks") or ranks)
    return V1Status(
        directory,
        BundleStatus.COMPLETE,
        ident.rollout_id if step is None else step.rollout_id,
        None if step is None else step.step_id,
        tuple(ranks),
        tuple(expected),
        (),
        sum(spec.size for s in sources for spec in s.manifest.payloads.values()),
        mtime,
    )


def _unfinished_status(directory: Path, reason: str) -> V1Status:
    """An unfinished bundle: which ranks landed (their COMPLETE.<r> beside the rank directories) and which not."""
    markers: dict[int, V1Shard] = {}
    try:
        for marker_path in directory.glob("COMPLETE.*"):
            suffix = marker_path.name.removeprefix("COMPLETE.")
            if suffix.isdigit() and str(int(suffix)) == suffix:
                _, markers[int(suffix)] = _load_document(marker_path, f"{directory.name}/{marker_path.name}", V1Shard)
        mtimes = [p.stat().st_mtime for p in directory.glob("COMPLETE.*")]
    except (TrajectoryReplayError, OSError) as exc:
        return V1Status(directory, BundleStatus.CORRUPT, detail=one_line(exc, QUOTE_LIMIT))
    if not markers:
        return V1Status(directory, BundleStatus.INCOMPLETE, detail=reason)
    first = markers[min(markers)]
    step = first.actor_step_id
    expected = sorted(first.expected_ranks)
    missing = tuple(r for r in expected if r not in markers)
    status, detail = (
        (BundleStatus.INCOMPLETE, f"missing ranks {list(missing)} of {expected}")
        if missing
        else (
            BundleStatus.FINALIZABLE,
            "every rank landed; the parent COMPLETE is missing (older format: readers do not write it)",
        )
    )
    return V1Status(
        directory,
        status,
        first.rollout_id if step is None else step.rollout_id,
        None if step is None else step.step_id,
        tuple(sorted(markers)),
        tuple(expected),
        missing,
        mtime=max(mtimes) if mtimes else None,
        detail=detail,
    )


__all__ = [
    "LegacyBundle",
    "V1Status",
    "V1_CODEC",
    "V1_FORMAT_VERSION",
    "capture_dir_name",
    "find_v1_bundles",
    "is_v1_bundle",
    "open_v1",
    "open_v1_bundle",
    "v1_status",
    "write_v1_bundle",
    "write_v1_multirank",
]
