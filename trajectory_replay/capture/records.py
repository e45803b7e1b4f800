"""Capture records: what one captured bundle holds, and how its documents are built (on the writer side).

The training thread turns hook arguments into a `Columns` snapshot (per-sample values) plus
snapshotted per-token tensors, and wraps them in a typed record, `RolloutRecord` or `StepRecord`.
Everything that costs more than a copy (pydantic documents, Python lists from tensors, concatenations
of micro-batches) happens in the record's `build()`, after the CUDA copies landed, in the writer thread
or the writer process (a record is picklable: it travels there inside a `BundleJob`).

Rollout-level bundle `rollout-<R>`: identity rollout_id=R; stages sample, reward.raw,
reward.post_process, advantage.kl, advantage.estimate (recompute), and rollout.mismatch when the engine's
log-probs or the samples' policy versions are given; payloads old_log_probs, ref_log_probs, kl, advantages
(+ values and returns when given: gae; + rollout_log_probs, rollout_is_weights when given); expected
reward.raw.raw_rewards, reward.post_process.rewards (+ rollout.mismatch metrics when given).

Step-level bundle `step-<R>-<S>`: identity actor_step_id=(R, S); stages sample and loss.policy (+ loss.value
when any value-loss input is given, + rollout.mismatch like the rollout-level bundle); payloads old_log_probs,
log_probs, entropy, advantages (+ ref_log_probs, values, vpreds, returns, rollout_log_probs when given); every
record names the rollout-level bundle it came from (`rollout_id` = R), which a chained replay links it to; records
carry their micro_batch_id; expected loss.policy {loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl} (+ kl_loss
when the config's kl_loss_coef is not 0) and loss.value {vf_loss, vf_clipfrac}.

A critic's step-level bundle `critic-<R>-<S>` (kind "critic": a critic trained on its own mini-batches, apart from
the actor's step): identity critic_step_id=(R, S) (anchor `critic R:S`, apart from the actor's `step R:S`), the
same records, stages sample and loss.value only; payloads values, vpreds,
returns; expected loss.value {vf_loss, vf_clipfrac}.

Each stage contract's inputs and expected outputs come from `bundle.stage_io.STAGE_IO` under the record's config
and the flags of the estimator it names (`replay.flags`: a built-in's without loading anything, a plugin's from its
kernel, which loads it where the bundle is built). The payloads a bundle of each kind takes are the table's too
(`bundle_payloads`: every payload its stages may read, the loss mask aside): the hooks hand them over as one
mapping by name (`given_payloads`, which refuses a name the table does not declare for that kind), a record writes
each one given, and the loss.value inputs among them contract loss.value. A payload added to a stage's entry is
thereby taken, snapshotted and written with no change here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trajectory_replay.bundle.codec import RawTensor
from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RankTopology,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
    WeightLineage,
)
from trajectory_replay.bundle.stage_io import (
    LOSS_FIELDS,
    LOSS_MASK,
    MISMATCH_FIELDS,
    STAGE_IO,
    Setting,
    payloads_of,
)
from trajectory_replay.capture.values import materialize_float, materialize_masks, required_list
from trajectory_replay.replay.flags import setting as setting_of

if TYPE_CHECKING:  # the capture writer process builds bundles from these records without importing torch
    import torch

    from trajectory_replay.capture.snapshot import Snapshot

ROLLOUT_STAGES = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
)
"""The stages a rollout-level bundle always contracts (rollout.mismatch follows sample when its inputs are given)."""
STEP_STAGES = (StageId.SAMPLE, StageId.LOSS_POLICY)
"""The stages a step-level bundle always contracts (+ rollout.mismatch as above, + loss.value when given)."""
CRITIC_STAGES = (StageId.SAMPLE, StageId.LOSS_VALUE)
"""The stages a critic's step-level bundle contracts: the value loss of a critic trained apart from the actor."""
BUNDLE_STAGES: dict[str, tuple[StageId, ...]] = {
    "rollout": ROLLOUT_STAGES + (StageId.ROLLOUT_MISMATCH,),
    "step": STEP_STAGES + (StageId.ROLLOUT_MISMATCH, StageId.LOSS_VALUE),
    "critic": CRITIC_STAGES,
}
"""Every stage a bundle of each kind ("rollout", "step", "critic") may contract."""
STEP_KINDS = ("step", "critic")
"""The kinds of step-level bundle: the actor's step (`step-<R>-<S>`, with loss.value when the same step gives the
value-loss inputs) and a critic's step (`critic-<R>-<S>`), which a trainer whose critic runs its own mini-batches
captures apart."""


def bundle_payloads(kind: str) -> tuple[str, ...]:
    """The per-token payloads a bundle of `kind` takes from capture: every payload its stages may read under any
    setting, but the loss mask (made from the sample records). Read from the stage table when asked."""
    return tuple(n for n in payloads_of(BUNDLE_STAGES[kind]) if n != LOSS_MASK)


def value_loss_payloads() -> tuple[str, ...]:
    """The loss.value inputs: any of them given contracts the stage."""
    return tuple(n for n in payloads_of((StageId.LOSS_VALUE,)) if n != LOSS_MASK)


def given_payloads(kind: str, named: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The payloads a hook was given, by name: its named arguments, then its `payloads` mapping (`extra`), those
    that are None left out. ValueError naming the payload when one is not a payload of a bundle of `kind` (as the
    stage table declares them: `bundle_payloads`), or is given twice; a named argument the hook leaves None is not
    given (a critic's micro-batch has no log-probs)."""
    accepted = bundle_payloads(kind)
    given: dict[str, Any] = {}
    for source in ({k: v for k, v in named.items() if v is not None}, extra or {}):
        for name, value in source.items():
            if name not in accepted:
                raise ValueError(
                    f"payloads: {name!r} is not a payload of a {kind}-level bundle (the stage table "
                    f"declares: {', '.join(accepted)})"
                )
            if value is not None:
                if name in given:
                    raise ValueError(f"payloads: {name!r} is given both as an argument and in payloads")
                given[name] = value
    return given


def step_scalars(named: Mapping[str, Any], kind: str = "step") -> dict[str, Any]:
    """The loss scalars `capture_step_end` was given, those that are None left out. ValueError naming one that is
    not an output of a loss stage of a step-level bundle of `kind` (as the stage table declares them)."""
    fields = tuple(
        n
        for stage in BUNDLE_STAGES[kind]
        if stage != StageId.ROLLOUT_MISMATCH and STAGE_IO[stage].recorded_as == "expected"
        for n in STAGE_IO[stage].outputs
    )
    unknown = [k for k in named if k not in fields]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a loss scalar of a step-level bundle (scalars: {', '.join(fields)})")
    return {k: v for k, v in named.items() if v is not None}


def _torch_version() -> str:
    import torch  # a Provenance is made in the training process, which has torch

    return torch.__version__


def _concat(parts: list) -> Any:
    """One flat tensor of micro-batches' flat tensors: torch's, or the writer process's raw ones."""
    if all(isinstance(p, RawTensor) for p in parts):
        return RawTensor.cat(parts)
    import torch

    return torch.cat(parts)


def check_mismatch_metrics(metrics: Mapping[str, Any]) -> None:
    """ValueError naming the first key of `metrics` that is not a rollout.mismatch field."""
    unknown = sorted(set(metrics) - set(MISMATCH_FIELDS))
    if unknown:
        raise ValueError(f"mismatch_metrics: unknown field {unknown[0]!r} (fields: {', '.join(MISMATCH_FIELDS)})")


def _mismatch_stage(records: Sequence[SampleRecord], tensors: Mapping[str, Any]) -> tuple[StageId, ...]:
    """rollout.mismatch when the bundle has the engine's log-probs or any sample its policy version."""
    if "rollout_log_probs" in tensors or any(r.policy_version is not None for r in records):
        return (StageId.ROLLOUT_MISMATCH,)
    return ()


EXACT_FIELDS = ["sample_id", "loss_mask", "group_index"]


def check_fields(obj: Any, **kinds: type | tuple[type, ...]) -> None:
    """A one-line TypeError naming the first field of `obj` whose value is not of its kind (a bool is no int)."""
    for name, kind in kinds.items():
        value = getattr(obj, name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise TypeError(f"{type(obj).__name__}.{name}: expected {names}, got {type(value).__name__}")


def rollout_bundle_id(rollout_id: int) -> str:
    return f"rollout-{int(rollout_id)}"


def step_bundle_id(rollout_id: int, step_id: int, kind: str = "step") -> str:
    """`step-<R>-<S>`, or `critic-<R>-<S>` for a critic's step (`kind`, one of STEP_KINDS)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind: {kind!r} is not a kind of step-level bundle ({', '.join(STEP_KINDS)})")
    return f"{kind}-{int(rollout_id)}-{int(step_id)}"


@dataclass(frozen=True)
class BundleParts:
    """Everything a BundleWriter needs."""

    manifest: Manifest
    index: BundleIndex
    expected: dict[str, Any]
    payloads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Columns:
    """Per-sample values of some samples, as snapshotted on the training thread."""

    sample_ids: Any
    group_index: Any
    response_lengths: Any
    total_lengths: Any
    loss_masks: Any
    raw_rewards: Any
    rewards: Any
    micro_batch_ids: Any = None
    policy_versions: Any = None

    @classmethod
    def estimate(cls, **values: Any) -> int:
        from trajectory_replay.capture.snapshot import estimate_nbytes

        return sum(estimate_nbytes(v) for v in values.values())

    @classmethod
    def take(cls, snap: Snapshot, **values: Any) -> Columns:
        return cls(**{k: snap.values(v, k) for k, v in values.items()})

    def records(self, micro_batch_id: str | None = None, rollout_id: int | None = None) -> list[SampleRecord]:
        """Sample records (writer thread). Lists of different lengths are a structural error."""
        ids = required_list(self.sample_ids, "sample_ids")
        n = len(ids)
        groups = required_list(self.group_index, "group_index", n)
        resp = required_list(self.response_lengths, "response_lengths", n)
        total = required_list(self.total_lengths, "total_lengths", n)
        raw = required_list(self.raw_rewards, "raw_rewards", n)
        rewards = required_list(self.rewards, "rewards", n)
        masks = materialize_masks(self.loss_masks, [int(r) for r in resp])
        mbs: list[Any] = (
            required_list(self.micro_batch_ids, "micro_batch_ids", n)
            if self.micro_batch_ids is not None
            else [micro_batch_id] * n
        )
        versions: list[Any] = (
            required_list(self.policy_versions, "policy_versions", n)
            if self.policy_versions is not None
            else [None] * n
        )
        return [
            SampleRecord(
                sample_id=str(ids[i]),
                group_index=None if groups[i] is None else int(groups[i]),
                response_length=int(resp[i]),
                total_length=int(total[i]),
                loss_mask=masks[i],
                raw_reward=float(raw[i]),
                reward=float(rewards[i]),
                micro_batch_id=None if mbs[i] is None else str(mbs[i]),
                policy_version=None if versions[i] is None else int(versions[i]),
                rollout_id=rollout_id,
            )
            for i in range(n)
        ]


@dataclass(frozen=True)
class Provenance:
    """Identity provenance and producer settings shared by every bundle of a manager."""

    producer: ProducerInfo = field(default_factory=lambda: ProducerInfo(torch_version=_torch_version()))
    topology: RankTopology = field(default_factory=RankTopology)

    @classmethod
    def of(
        cls, producer: ProducerInfo | None = None, topology: RankTopology | Mapping[str, int] | None = None
    ) -> Provenance:
        """From the manager's options `producer` and `topology` (a RankTopology or a mapping of its fields);
        None keeps the default."""
        given: dict[str, Any] = {}
        if producer is not None:
            given["producer"] = producer
        if topology is not None:
            given["topology"] = (
                topology if isinstance(topology, RankTopology) else RankTopology.model_validate(dict(topology))
            )
        return cls(**given)


def _config(config: Any) -> RecomputeConfig:
    if isinstance(config, RecomputeConfig):
        return config
    if isinstance(config, Mapping):
        return RecomputeConfig.model_validate(dict(config))
    raise TypeError(f"config: expected a RecomputeConfig or a mapping, got {type(config).__name__}")


def _lineage(weight_lineage: Any) -> WeightLineage:
    if weight_lineage is None:
        return WeightLineage()
    if isinstance(weight_lineage, WeightLineage):
        return weight_lineage
    if isinstance(weight_lineage, Mapping):
        return WeightLineage.model_validate(dict(weight_lineage))
    raise TypeError(f"weight_lineage: expected a WeightLineage or a mapping, got {type(weight_lineage).__name__}")


def _manifest(bundle_id: str, stages: Sequence[StageId], prov: Provenance, setting: Setting) -> Manifest:
    contracts = {
        s: StageContract(
            stage=s,
            capability=StageCapability.RECOMPUTE,
            implementation="reimplemented",
            inputs=list(STAGE_IO[s].declared_inputs(setting)),
            expected_outputs=list(STAGE_IO[s].outputs_for(setting)),
        )
        for s in stages
    }
    return Manifest(
        bundle_id=bundle_id,
        producer=prov.producer,
        stage_contracts=contracts,
        comparison_policy=ComparisonPolicy(exact_fields=list(EXACT_FIELDS)),
    )


def _unique(values: Sequence[str | None]) -> list[str]:
    return list(dict.fromkeys(v for v in values if v is not None))


def _group_ids(records: Sequence[SampleRecord]) -> list[str]:
    return _unique([None if r.group_index is None else f"g-{r.group_index}" for r in records])


@dataclass(frozen=True)
class RolloutRecord:
    """What `capture_rollout` took: the rollout-level bundle `rollout-<R>` of this rank's samples."""

    rollout_id: int
    columns: Columns
    payloads: Mapping[str, torch.Tensor | None]
    config: Any  # a RecomputeConfig or a mapping of its fields; checked by build()
    weight_lineage: Any  # a WeightLineage, a mapping of its fields, or None; checked by build()
    provenance: Provenance
    mismatch_metrics: Mapping[str, Any] = field(default_factory=dict)
    """rollout.mismatch metrics production reported (numbers or one-element tensors), by field name."""

    def __post_init__(self) -> None:
        check_fields(
            self, rollout_id=int, columns=Columns, payloads=Mapping, provenance=Provenance, mismatch_metrics=Mapping
        )

    @property
    def bundle_id(self) -> str:
        return rollout_bundle_id(self.rollout_id)

    def build(self) -> BundleParts:
        """The documents and payloads of `rollout-<R>`."""
        bundle_id, prov = self.bundle_id, self.provenance
        records = self.columns.records()
        identity = Identity(
            rollout_id=self.rollout_id,
            weight_lineage=_lineage(self.weight_lineage),
            rank=prov.topology,
            micro_batch_ids=_unique([r.micro_batch_id for r in records]),
            semantic_group_ids=_group_ids(records),
        )
        index = BundleIndex(bundle_id=bundle_id, identity=identity, samples=records, config=_config(self.config))
        expected: dict[str, dict[str, Any]] = {
            "reward.raw": {"raw_rewards": [r.raw_reward for r in records]},
            "reward.post_process": {"rewards": [r.reward for r in records]},
        }
        tensors = {k: v for k in bundle_payloads("rollout") if (v := self.payloads.get(k)) is not None}
        check_mismatch_metrics(self.mismatch_metrics)
        if self.mismatch_metrics:
            expected["rollout.mismatch"] = {k: materialize_float(v) for k, v in self.mismatch_metrics.items()}
        stages = ROLLOUT_STAGES[:1] + _mismatch_stage(records, tensors) + ROLLOUT_STAGES[1:]
        return BundleParts(_manifest(bundle_id, stages, prov, setting_of(index.config)), index, expected, tensors)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step, snapshotted."""

    micro_batch_id: str
    columns: Columns
    payloads: Mapping[str, torch.Tensor | None]


@dataclass(frozen=True)
class StepRecord:
    """What the micro-batch hooks and `capture_step_end` took: the step-level bundle `step-<R>-<S>`."""

    rollout_id: int
    step_id: int
    micro_batches: tuple[MicroBatch, ...]  # in the order they were fed
    scalars: Mapping[str, Any]  # the reported loss scalars: numbers or one-element tensors
    config: Any
    weight_lineage: Any
    provenance: Provenance
    kind: str = "step"
    """"step" (the actor's step) or "critic" (a critic's step: sample and loss.value only)."""

    def __post_init__(self) -> None:
        check_fields(self, rollout_id=int, step_id=int, micro_batches=tuple, scalars=Mapping, provenance=Provenance)
        if self.kind not in STEP_KINDS:
            raise ValueError(f"StepRecord.kind: {self.kind!r} is not one of {', '.join(STEP_KINDS)}")
        for i, mb in enumerate(self.micro_batches):
            if not isinstance(mb, MicroBatch):
                raise TypeError(f"StepRecord.micro_batches[{i}]: expected MicroBatch, got {type(mb).__name__}")

    @property
    def bundle_id(self) -> str:
        return step_bundle_id(self.rollout_id, self.step_id, self.kind)

    def build(self) -> BundleParts:
        """The documents and payloads of `step-<R>-<S>` (`critic-<R>-<S>`)."""
        bundle_id, prov, micro_batches = self.bundle_id, self.provenance, self.micro_batches
        records: list[SampleRecord] = []
        for mb in micro_batches:
            records.extend(mb.columns.records(mb.micro_batch_id, rollout_id=self.rollout_id))
        step = ActorStepId(rollout_id=self.rollout_id, step_id=self.step_id)
        identity = Identity(
            **{"critic_step_id" if self.kind == "critic" else "actor_step_id": step},
            weight_lineage=_lineage(self.weight_lineage),
            rank=prov.topology,
            micro_batch_ids=[mb.micro_batch_id for mb in micro_batches],
            semantic_group_ids=_group_ids(records),
        )
        index = BundleIndex(bundle_id=bundle_id, identity=identity, samples=records, config=_config(self.config))
        tensors: dict[str, torch.Tensor] = {}
        for name in bundle_payloads(self.kind):
            parts = [p for mb in micro_batches if (p := mb.payloads.get(name)) is not None]
            if len(parts) != len(micro_batches):
                continue  # written as given: a payload missing in any micro-batch is left out (replay reports it)
            tensors[name] = _concat([p.reshape(-1) for p in parts]) if len(parts) != 1 else parts[0]
        stages: tuple[StageId, ...]
        if self.kind == "critic":
            stages = CRITIC_STAGES
        else:
            stages = (
                STEP_STAGES[:1]
                + _mismatch_stage(records, tensors)
                + STEP_STAGES[1:]
                + ((StageId.LOSS_VALUE,) if self.has_value_loss else ())
            )
        setting = setting_of(index.config)
        expected = {
            stage.value: {k: materialize_float(self.scalars.get(k)) for k in STAGE_IO[stage].outputs_for(setting)}
            for stage in stages
            if stage not in (StageId.SAMPLE, StageId.ROLLOUT_MISMATCH)
        }
        return BundleParts(_manifest(bundle_id, stages, prov, setting), index, expected, tensors)

    @property
    def has_value_loss(self) -> bool:
        """True when any value-loss input or scalar was given: loss.value is then contracted, and whatever of it is
        missing is reported by validate and replay rather than silently not checked."""
        return any(
            mb.payloads.get(name) is not None for mb in self.micro_batches for name in value_loss_payloads()
        ) or any(self.scalars.get(name) is not None for name in STAGE_IO[StageId.LOSS_VALUE].outputs)


CaptureRecord = RolloutRecord | StepRecord
CAPTURE_RECORDS = (RolloutRecord, StepRecord)


__all__ = [
    "BUNDLE_STAGES",
    "BundleParts",
    "CAPTURE_RECORDS",
    "CRITIC_STAGES",
    "CaptureRecord",
    "Columns",
    "EXACT_FIELDS",
    "LOSS_FIELDS",
    "MicroBatch",
    "Provenance",
    "ROLLOUT_STAGES",
    "RolloutRecord",
    "STEP_KINDS",
    "STEP_STAGES",
    "StepRecord",
    "bundle_payloads",
    "check_fields",
    "check_mismatch_metrics",
    "given_payloads",
    "rollout_bundle_id",
    "step_bundle_id",
    "step_scalars",
    "value_loss_payloads",
]
