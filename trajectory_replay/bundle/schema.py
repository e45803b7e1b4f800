"""The bundle documents: manifest, index and expected outputs, as pydantic v2 models.

Names follow the system this project replaces so that hand-built bundles keep working.
Only structure is validated here (types, required fields, name syntax); semantics such as
an unsupported estimator or a NaN in an expected value are written as given and left to
validate and replay. Unknown fields are kept out of the model and
reported with a `SchemaWarning`, never silently dropped.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Collection
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from trajectory_replay.bundle import profiles
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.store.layout import RESERVED_NAMES
from trajectory_replay.words import Word

FORMAT_VERSION = "1.1.0"
"""Manifest format written by this package. Major 1 is shared with the older directory format."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""Bundle ids and payload names (see docs/format.md, "On storage")."""

DIGEST_PATTERN = re.compile(r"blake3:[0-9a-f]{64}")

DTYPES = (
    "torch.float64",
    "torch.float32",
    "torch.float16",
    "torch.bfloat16",
    "torch.int64",
    "torch.int32",
    "torch.int16",
    "torch.int8",
    "torch.uint8",
    "torch.bool",
)
"""Payload dtypes, spelled as torch prints them (the older format's spelling)."""


class SchemaWarning(UserWarning):
    """A document holds a field this version does not know; it is ignored."""


def check_name(value: str, what: str) -> str:
    """Return `value` if it is a valid bundle id / payload name, else raise ValueError naming `what`."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value) or value in RESERVED_NAMES:
        raise ValueError(
            f"invalid {what} {value!r}: must match [A-Za-z0-9][A-Za-z0-9._-]* "
            "and not be a reserved name (objects, blobs)"
        )
    if ".." in value:
        raise ValueError(f"invalid {what} {value!r}: '..' is not allowed")
    return value


class _Model(BaseModel):
    """Shared configuration: unknown fields warn and are ignored; enums serialize as values.

    Unknown fields are collected as extras while pydantic validates (no Python hook runs before validation, so a
    JSON document is validated straight from its bytes) and dropped, with one warning each, right after."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, use_enum_values=False)

    def model_post_init(self, context: Any, /) -> None:
        extra = self.__pydantic_extra__
        if extra:
            for key in extra:
                warnings.warn(f"{type(self).__name__}: unknown field {key!r} ignored", SchemaWarning, stacklevel=2)
            object.__setattr__(self, "__pydantic_extra__", {})


class StageId(Word):
    """The replay stages, in pipeline order."""

    SAMPLE = "sample"
    ROLLOUT_MISMATCH = "rollout.mismatch"
    REWARD_RAW = "reward.raw"
    REWARD_POST_PROCESS = "reward.post_process"
    ADVANTAGE_KL = "advantage.kl"
    ADVANTAGE_ESTIMATE = "advantage.estimate"
    LOSS_POLICY = "loss.policy"
    LOSS_VALUE = "loss.value"


STAGE_ORDER: tuple[StageId, ...] = tuple(StageId)


class StageCapability(Word):
    """How replay can treat a stage."""

    RECOMPUTE = "recompute"
    RECORDED_ONLY = "recorded-only"
    INSPECT_ONLY = "inspect-only"
    UNSUPPORTED = "unsupported"

    @classmethod
    def _missing_(cls, value: object) -> StageCapability | None:
        # the older tool wrote underscores in places; accept both spellings
        if isinstance(value, str):
            norm = value.strip().lower().replace("_", "-")
            for member in cls:
                if member.value == norm:
                    return member
        return None

    def __str__(self) -> str:
        return self.value


class ActorStepId(_Model):
    """The (rollout, step) of a step-level bundle: which actor update (or, as `critic_step_id`, which update of a
    critic trained apart from the actor) consumed the samples."""

    model_config = ConfigDict(frozen=True)

    rollout_id: int
    step_id: int

    def __str__(self) -> str:
        return f"{self.rollout_id}:{self.step_id}"


class WeightLineage(_Model):
    """Weight versions that generated (rollout) and consumed (actor) the samples."""

    rollout_weight: int | str | None = None
    actor_weight: int | str | None = None


class RankTopology(_Model):
    """Parallel sizes of the producing job. Any sizes are accepted here; replay refuses what it cannot do."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1


class Identity(_Model):
    """Exactly one anchor (actor_step_id for the actor's step-level bundle, critic_step_id for a critic's,
    rollout_id for a rollout-level one) plus provenance. `critic_step_id` is stored only when set: every other
    identity is stored as it was before critics had an anchor of their own."""

    actor_step_id: ActorStepId | None = None
    critic_step_id: ActorStepId | None = None
    rollout_id: int | None = None
    rollout_partition_ids: list[str] = Field(default_factory=list)
    consumer_batch_ids: list[str] = Field(default_factory=list)
    micro_batch_ids: list[str] = Field(default_factory=list)
    semantic_group_ids: list[str] = Field(default_factory=list)
    normalization_cohort_ids: list[str] = Field(default_factory=list)
    weight_lineage: WeightLineage = Field(default_factory=WeightLineage)
    rank: RankTopology = Field(default_factory=RankTopology)

    @model_validator(mode="after")
    def _one_anchor(self) -> Identity:
        if sum(x is not None for x in (self.actor_step_id, self.critic_step_id, self.rollout_id)) != 1:
            raise ValueError("identity must have exactly one of actor_step_id, critic_step_id or rollout_id")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_critic(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("critic_step_id", 0) is None:
            del out["critic_step_id"]
        return out

    @property
    def level(self) -> Literal["step", "rollout"]:
        """`step` for a step-level bundle (the actor's or a critic's), `rollout` for a rollout-level one."""
        return "rollout" if self.rollout_id is not None else "step"

    def anchor(self) -> str:
        """A short human-readable anchor: `step R:S`, `critic R:S` or `rollout R`."""
        return str(Anchor.of(self))


class SampleRecord(_Model):
    """Per-sample scalars (and optional text, redacted before storage)."""

    sample_id: str
    group_index: int | None = None
    response_length: int
    total_length: int
    loss_mask: list[int] = Field(default_factory=list)
    raw_reward: float
    reward: float
    label_hash: str | None = None
    micro_batch_id: str | None = None
    policy_version: int | None = None
    """The weights version that generated the sample (rollout.mismatch checks its staleness)."""
    rollout_id: int | None = None
    """In a step-level bundle: the rollout-level bundle (its rollout_id anchor) that produced the sample, which a
    chained replay checks the step's inputs against."""
    prompt: str | None = None
    response: str | None = None
    label: str | None = None
    tool_output: str | None = None


TEXT_FIELDS = ("prompt", "response", "label", "tool_output")


class RejectionBounds(_Model):
    """What a divergence criterion of rejection keeps. A k1 criterion bounds the ratio trainer / engine
    (exp of the token's log ratio, of its sample's sum or mean): lower (None: 1 / upper) and upper, both inclusive.
    A k2 or k3 criterion bounds the divergence from above: upper only."""

    lower: float | None = None
    upper: float | None = None


class RecomputeConfig(_Model):
    """Algorithm settings replay recomputes with; every default reproduces the older tool.

    Any value is accepted here (a bundle that reproduces a broken production step must be writable);
    replay refuses what it cannot recompute, naming the field. docs/algorithms.md gives the math of each.
    """

    advantage_estimator: str = "grpo"
    n_samples_per_prompt: int = 1
    group_size_check: str = "exact"
    """exact: every reward group has n_samples_per_prompt members; any: groups of any size."""
    grpo_std_normalization: bool = False
    std_unbiased: bool = True
    std_eps: float = 1e-6
    singleton_group: str = "nan"
    """A reward group of one: nan (the formula applied literally) or unit (mean 0, std 1)."""
    std_scope: str = "group"
    """The std grpo_std_normalization divides by: group (each reward group's own) or batch (that of every reward of
    the cohort, around the cohort's mean; the centering stays the group's mean)."""
    nan_rewards: str = "propagate"
    """A NaN reward: propagate (the formulas applied literally, NaN spreads through its group) or exclude (left out
    of its group's mean and std, and of the batch's; every NaN post-processed reward then becomes 0)."""
    mask_advantages: bool = False
    gamma: float = 1.0
    lam: float = 1.0
    masked_return: str = "restart"
    """How reinforce_plus_plus's running return crosses a token with mask 0: restart (zeroed after it) or carry
    (passed over it unchanged: no discount, and that token's reward dropped)."""
    kl_in_reward: bool = False
    kl_in_score: bool = False
    """With kl_in_reward, an estimator that does not take the KL in its token rewards (grpo, dr_grpo, rloo,
    reinforce_plus_plus_baseline) subtracts kl_coef times the sample's masked KL sum from its reward before
    post-processing; false: it ignores the reward-side KL."""
    kl_loss_type: str = "k1"
    kl_coef: float = 0.0
    kl_log_ratio_clamp: float | None = None
    kl_output_clamp: float | None = None
    kl_clamped: list[str] | None = None
    """The KL estimators kl_log_ratio_clamp and kl_output_clamp apply to (None: every one)."""
    policy_loss: str = "ppo_clip"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float | None = None
    ratio_log_clamp: float | None = None
    cispo_clip: str = "window"
    """How cispo bounds its ratio weight: window (clipped to [1 - eps_clip, 1 + eps_clip_high]) or cap (min(ratio,
    eps_clip_high), no lower bound; a token counts as clipped where the ratio exceeds the cap and its advantage is
    positive)."""
    loss_agg_mode: str = "sum_of_sample_means"
    loss_denominator: float | None = None
    loss_scale_factor: float | None = None
    loss_scale: float = 1.0
    clip_metric_agg: str = "loss_agg_mode"
    """How pg_clipfrac, ppo_kl and vf_clipfrac are reduced: loss_agg_mode (aggregated like the loss, by the mode
    and its denominators), micro_batch_token_mean (a token mean per micro-batch, by the records' micro_batch_id
    within each rank, averaged over the micro-batches) or micro_batch_seq_mean (likewise, but each micro-batch's
    mean over its samples of each one's token mean)."""
    entropy_coef: float = 0.0
    entropy_agg: str = "loss_agg_mode"
    """How entropy_loss is aggregated: loss_agg_mode (like the loss, by the mode and its denominators, times
    loss_scale), token_mean (over the cohort's masked-in tokens) or micro_batch_token_mean (a token mean per
    micro-batch, by the records' micro_batch_id within each rank, averaged over the micro-batches)."""
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    kl_loss_ratio_weighted: bool = False
    """The KL loss term of each token is multiplied by the policy loss's importance ratio, exp(log_probs -
    old_log_probs) (per sequence for gspo), before it is aggregated."""
    loss_terms_reported: bool = True
    """Production computes pg_loss, ppo_kl and kl_loss, each aggregated like the loss; false where it computes none
    of them (TRL, which logs other means of them), and a bundle may then leave them out."""
    metrics_per_rank: bool = True
    """Production's pg_clipfrac and entropy_loss are each rank's own; false where it logs them only as means over
    every process's tokens (TRL with several processes), and a bundle may then leave them out."""
    cliprange_value: float = 0.2
    actor_version: int | None = None
    """The weights version of the trainer consuming the samples (staleness = actor_version - policy_version)."""
    max_staleness: int | None = None
    rollout_is: str = "none"
    """Importance-sampling correction of the training-inference mismatch: none, token or sequence."""
    rollout_is_threshold: float = 2.0
    """The upper bound of the importance weights."""
    rollout_is_threshold_lower: float | None = None
    """None: weights above rollout_is_threshold are truncated to it. Set: a weight outside [this,
    rollout_is_threshold] is 0 and the others are kept as they are (IcePop)."""
    rollout_rs: str = "none"
    """Rejection sampling on the same ratio: none, token, sequence, or a comma-separated list of divergence
    criteria (token_k1, seq_sum_k3, ...: `replay.mismatch.DIVERGENCE_CRITERIA`), all of which a token must pass."""
    rollout_rs_lower: float | None = None
    """Lower bound on the ratio rejection keeps (None: 1 / the upper bound)."""
    rollout_rs_upper: float | None = None
    """Upper bound on the ratio rejection keeps (None: rollout_is_threshold)."""
    rollout_rs_bounds: dict[str, RejectionBounds] = Field(default_factory=dict)
    """The bounds of each divergence criterion of rollout_rs, by name; a criterion without an entry takes
    rollout_rs_lower and rollout_rs_upper."""
    mismatch_max_kl_k3: float | None = None
    mismatch_max_token_log_ratio: float | None = None
    expect_on_policy: bool = False
    """The step's current log-probs must equal its old ones (the first mini-batch after they were computed)."""

    _profile: str | None = PrivateAttr(default=None)
    _framework_version: str | None = PrivateAttr(default=None)

    @property
    def profile(self) -> str | None:
        """The convention profile this config was built from (`from_profile`), if any; the writer records it."""
        return self._profile

    @property
    def framework_version(self) -> str | None:
        """The version of the profile's framework that produced the step (`from_profile`), if given; the writer
        records it as the manifest's `producer.framework_version`."""
        return self._framework_version

    @classmethod
    def from_profile(cls, profile: str, *, framework_version: str | None = None, **overrides: Any) -> RecomputeConfig:
        """The config a framework's defaults amount to (`bundle/profiles.py`), with `overrides` given by our field
        names or the framework's own option names; it remembers the profile (`profile`) and the version of the
        framework that produced the step (`framework_version`, e.g. `profiles.installed_version(profile)`).

        ValueError, one line naming the option, for an override no field expresses or a value a field refuses."""
        prof = profiles.profile(profile)
        try:
            config = cls.model_validate(prof.fields(overrides, cls.model_fields))
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else "config"
            raise ValueError(prof.refusal(field, error["msg"], overrides, cls.model_fields)) from None
        config._profile = profile
        config._framework_version = framework_version
        return config

    def with_conventions_of(self, profile: str, keep: Collection[str] = ()) -> RecomputeConfig:
        """This config with profile `profile`'s conventions (the `CONVENTION_FIELDS`, at the profile's values or the
        defaults) and the run's own hyperparameters kept, and the fields in `keep` (conventions the run set itself)."""
        defaults, settings = RecomputeConfig(), profiles.profile(profile).settings
        update = {f: settings.get(f, getattr(defaults, f)) for f in profiles.CONVENTION_FIELDS if f not in keep}
        return RecomputeConfig.model_validate({**self.model_dump(), **update})

    def set_by_run(self, profile: str) -> list[str]:
        """The conventions this config sets otherwise than profile `profile` does: built from that profile, the
        framework options the run changed (verl's norm_adv_by_std_in_grpo, kl_loss_type), which trying the profile
        keeps (`with_conventions_of(..., keep=)`)."""
        applied = self.with_conventions_of(profile)
        return [f for f in profiles.CONVENTION_FIELDS if getattr(applied, f) != getattr(self, f)]


class KernelRef(_Model):
    """A production implementation a stage contract names: replay uses exactly it (a registered plugin)."""

    name: str
    package: str
    version: str | None = None


class ConventionsRecord(_Model):
    """The convention profile a producer built its recompute config from, and the framework version it follows."""

    profile: str
    framework: str | None = None
    framework_version: str | None = None

    @classmethod
    def of_profile(cls, profile: str) -> ConventionsRecord:
        """What a manifest records of profile `profile`."""
        prof = profiles.profile(profile)
        return cls(profile=prof.name, framework=prof.framework, framework_version=prof.framework_version)

    def resolved(self) -> str | None:
        """The profile this record means today (`profiles.recorded_profile`): a bundle that recorded a bare name when
        it modelled an older version means the pinned profile of that version; None for an unknown profile."""
        return profiles.recorded_profile(self.profile, self.framework_version)


class StageContract(_Model):
    """What a bundle promises about one stage."""

    stage: StageId
    version: str = "v1"
    capability: StageCapability = StageCapability.RECOMPUTE
    implementation: Literal["reuse", "reimplemented"] = "reimplemented"
    inputs: list[str] = Field(default_factory=list)
    expected_outputs: list[str] = Field(default_factory=list)
    kernel: KernelRef | None = None
    """The production kernel the stage must be replayed with (absent: replay's own implementation)."""


class PayloadSpec(_Model):
    """One tensor payload: how it is encoded and where its bytes are (filled in by the writer)."""

    name: str
    role: Literal["input", "expected"] = "input"
    codec: str = "safetensors"
    dtype: str
    shape: list[int]
    size: int = Field(ge=0, description="Size in bytes of the encoded payload blob.")
    digest: str | None = Field(default=None, description="blake3 digest of the encoded payload blob.")
    record: str | None = Field(default=None, description="blake3 digest of the blob's record.")
    per_token: bool = Field(default=True, description="Flat concatenation of the samples' response tokens.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "payload name")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"unsupported dtype {v!r} (one of {', '.join(DTYPES)})")
        return v

    @field_validator("digest", "record")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not DIGEST_PATTERN.fullmatch(v):
            raise ValueError(f"invalid digest {v!r}: expected blake3:<64 lowercase hex>")
        return v


class ProducerInfo(_Model):
    """Which code produced the bundle, and the training framework (name and version) that produced the step."""

    commit: str = "unknown"
    dirty_patch_digest: str | None = None
    torch_version: str | None = None
    framework: str | None = None
    framework_version: str | None = None

    @model_serializer(mode="wrap")
    def _without_unset_framework(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a bundle with no framework recorded serializes as before the framework fields existed
        doc: dict[str, Any] = handler(self)
        for key in ("framework", "framework_version"):
            if doc.get(key) is None:
                doc.pop(key, None)
        return doc


class Tolerance(_Model):
    """Absolute and relative tolerance of one stage; a missing value takes the default."""

    atol: float | None = None
    rtol: float | None = None


class ComparisonPolicy(_Model):
    """Per-stage tolerances and fields compared exactly between replica ranks. Every field is optional."""

    exact_fields: list[str] = Field(default_factory=list)
    tolerances: dict[str, Tolerance] = Field(default_factory=dict)


class TriggerRecord(_Model):
    """Why the flight recorder kept a bundle (`capture.recorder`): the trigger `name` that fired, the `value` it
    saw (a number, or "nan"/"inf"/"-inf", or the reason a user gave), the `threshold` it compares with (None for a
    trigger without one), the step bundle it fired at (`step`), and the rank that fired it."""

    name: str
    value: float | str | None = None
    threshold: float | None = None
    step: str
    rank: int | None = None
    detail: str | None = None


class Manifest(_Model):
    """What the bundle contains: stage contracts, payloads, comparison and redaction policy; `trigger`, only in a
    bundle the flight recorder kept, why it kept it."""

    format_version: str = FORMAT_VERSION
    bundle_id: str
    producer: ProducerInfo = Field(default_factory=ProducerInfo)
    stage_contracts: dict[StageId, StageContract] = Field(default_factory=dict)
    payloads: dict[str, PayloadSpec] = Field(default_factory=dict)
    comparison_policy: ComparisonPolicy = Field(default_factory=ComparisonPolicy)
    redaction: dict[str, str] = Field(default_factory=dict)
    conventions: ConventionsRecord | None = None
    trigger: TriggerRecord | None = None

    @field_validator("bundle_id")
    @classmethod
    def _bundle_id(cls, v: str) -> str:
        return check_name(v, "bundle_id")

    @field_validator("payloads")
    @classmethod
    def _payload_names(cls, v: dict[str, PayloadSpec]) -> dict[str, PayloadSpec]:
        for key, spec in v.items():
            check_name(key, "payload name")
            if spec.name != key:
                raise ValueError(f"payload {key!r} is described as {spec.name!r}")
        return v

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: str) -> str:
        major = v.split(".", 1)[0]
        if major != "1":
            raise ValueError(f"unsupported format_version {v!r}: major version must be 1")
        return v

    @field_validator("redaction")
    @classmethod
    def _redaction(cls, v: dict[str, str]) -> dict[str, str]:
        # Field names are not checked here: this model also reads bundles, and one written before the writer
        # refused unknown names (redaction.check_policy) must still open. Writing is strict, reading lenient.
        for field, rule in v.items():
            if rule in ("hash", "drop"):
                continue
            if rule.startswith("truncate:") and rule[len("truncate:") :].isdigit():
                continue
            raise ValueError(f"invalid redaction rule {rule!r} for field {field!r}: expected hash, drop or truncate:N")
        return v


class BundleIndex(_Model):
    """Identity, per-sample records and recompute config."""

    bundle_id: str
    identity: Identity
    samples: list[SampleRecord]
    config: RecomputeConfig = Field(default_factory=RecomputeConfig)

    @field_validator("bundle_id")
    @classmethod
    def _bundle_id(cls, v: str) -> str:
        return check_name(v, "bundle_id")

    def token_offsets(self) -> list[int]:
        """Where each sample's rows start in a flat per-token payload, plus the total (sample i's rows are
        [offsets[i], offsets[i + 1])). A negative length counts as 0 here; replay reports it."""
        return list(itertools.accumulate((max(s.response_length, 0) for s in self.samples), initial=0))


class RewardRawExpected(_Model):
    raw_rewards: list[float]


class RewardPostProcessExpected(_Model):
    rewards: list[float]


class LossPolicyExpected(_Model):
    """The loss scalars production reported. Each may be missing (replay then fails that field)."""

    loss: float | None = None
    pg_loss: float | None = None
    entropy_loss: float | None = None
    pg_clipfrac: float | None = None
    ppo_kl: float | None = None
    kl_loss: float | None = None


class RolloutMismatchExpected(_Model):
    """The training-inference mismatch metrics production reported; each is compared when present."""

    kl_k1: float | None = None
    kl_k3: float | None = None
    log_ratio_max_abs: float | None = None
    seq_log_ratio_max_abs: float | None = None
    staleness_max: float | None = None
    # verl's rollout-correction metrics (stage_io.OFF_POLICY_FIELDS), by verl's key less `rollout_corr/`
    training_ppl: float | None = None
    training_log_ppl: float | None = None
    rollout_ppl: float | None = None
    rollout_log_ppl: float | None = None
    log_ppl_diff: float | None = None
    log_ppl_abs_diff: float | None = None
    log_ppl_diff_max: float | None = None
    log_ppl_diff_min: float | None = None
    ppl_ratio: float | None = None
    chi2_token: float | None = None
    chi2_seq: float | None = None
    rollout_is_mean: float | None = None
    rollout_is_max: float | None = None
    rollout_is_min: float | None = None
    rollout_rs_masked_fraction: float | None = None


class LossValueExpected(_Model):
    """The value-loss scalars production reported."""

    vf_loss: float | None = None
    vf_clipfrac: float | None = None


class Expected(_Model):
    """expected.json: the scalar outputs production reported (per-token ones are payloads)."""

    rollout_mismatch: RolloutMismatchExpected | None = Field(default=None, alias="rollout.mismatch")
    reward_raw: RewardRawExpected | None = Field(default=None, alias="reward.raw")
    reward_post_process: RewardPostProcessExpected | None = Field(default=None, alias="reward.post_process")
    loss_policy: LossPolicyExpected | None = Field(default=None, alias="loss.policy")
    loss_value: LossValueExpected | None = Field(default=None, alias="loss.value")


def json_schemas() -> dict[str, Any]:
    """The JSON Schema of the three bundle documents."""
    return {
        "manifest": Manifest.model_json_schema(),
        "index": BundleIndex.model_json_schema(),
        "expected": Expected.model_json_schema(by_alias=True),
    }


__all__ = [
    "ActorStepId",
    "BundleIndex",
    "ComparisonPolicy",
    "ConventionsRecord",
    "DTYPES",
    "Expected",
    "FORMAT_VERSION",
    "Identity",
    "KernelRef",
    "LossPolicyExpected",
    "LossValueExpected",
    "Manifest",
    "RolloutMismatchExpected",
    "PayloadSpec",
    "ProducerInfo",
    "RankTopology",
    "RecomputeConfig",
    "RejectionBounds",
    "SampleRecord",
    "SchemaWarning",
    "STAGE_ORDER",
    "StageCapability",
    "StageContract",
    "StageId",
    "TEXT_FIELDS",
    "Tolerance",
    "TriggerRecord",
    "WeightLineage",
    "check_name",
    "json_schemas",
]
