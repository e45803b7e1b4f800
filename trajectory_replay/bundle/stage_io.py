"""What each stage reads from a bundle and what it produces: the one table of stage inputs and outputs.

Capture declares it in the stage contracts it writes (and takes the payloads to write from it), the writers mark
the payloads that hold recorded outputs by it, `validate` checks that a bundle holds it, and replay plans, loads,
reads ahead, releases and hands outputs downstream by it; all of them read it here, so adding a payload is one
entry of `STAGE_IO` (plus the kernel that reads it). Pure data (no torch): the commands that only look at bundles
import it.

Some entries exist only under some settings (`StageIO.only_when`): the reference log-probs when kl_coef is not 0,
the old values and returns of an estimator that reads values. Some may be left out under some settings
(`StageIO.optional_when`): the entropy when the loss has no entropy term. Those conditions ask the recompute config
and the flags of the advantage estimator it names (`EstimatorFlags`: does it read the `values` payload, does it take
the reward-side KL in its token rewards; one that does not takes it in each sample's reward under kl_in_score),
handed in together as a `Setting`. The built-in estimators' flags are declared here
(`BUILTIN_ESTIMATOR_FLAGS`; the registry's built-in kernels take theirs from it), so a torch-free command answers for
them without loading a kernel; a plugin estimator's flags are those of its registered kernel, which the caller
resolves (`replay.flags`) and hands in. The table never looks a kernel up itself: bundle code does not import replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from trajectory_replay.bundle.schema import RecomputeConfig, StageId

LOSS_MASK = "loss_mask"
"""The payload of every sample's loss mask (the writers make it from the records)."""

PRE_REJECTION_MASK = "pre_rejection_mask"
"""The payload of the loss mask before a rollout correction's rejection, where the loss mask is the one after it:
the mask the importance weights, the rejection and the mismatch metrics are taken over (as verl takes them)."""


@dataclass(frozen=True)
class EstimatorFlags:
    """What the stage table asks of an advantage estimator."""

    needs_values: bool = False
    """Its advantages read the `values` payload (and it produces returns)."""
    reads_kl: bool = False
    """With kl_in_reward (and kl_coef != 0) its token rewards take the reward-side KL."""


BUILTIN_ESTIMATOR_FLAGS: dict[str, EstimatorFlags] = {
    "grpo": EstimatorFlags(),
    "dr_grpo": EstimatorFlags(),
    "rloo": EstimatorFlags(),
    "reinforce_plus_plus": EstimatorFlags(reads_kl=True),
    "reinforce_plus_plus_baseline": EstimatorFlags(),
    "gae": EstimatorFlags(needs_values=True, reads_kl=True),
}
"""The flags of every built-in estimator, by name."""


@dataclass(frozen=True)
class Setting:
    """What decides a stage's conditional inputs and outputs: the recompute config and the flags of the estimator
    it names."""

    config: RecomputeConfig
    estimator: EstimatorFlags = EstimatorFlags()


@dataclass(frozen=True)
class When:
    """A condition under which a conditional entry exists, and the config fields that meet it, as an error names
    them ("kl_loss_coef=0.1 needs payload 'ref_log_probs'")."""

    holds: Callable[[Setting], bool]
    named: Callable[[Setting], str]

    def __or__(self, other: When) -> When:
        """Either condition, named by the first of the two that holds."""
        return When(lambda s: self.holds(s) or other.holds(s), lambda s: (self if self.holds(s) else other).named(s))


def kl_in_reward(setting: Setting) -> bool:
    """True when the config puts the reward-side KL into the token rewards of its estimator."""
    config = setting.config
    return config.kl_in_reward and config.kl_coef != 0 and setting.estimator.reads_kl


def kl_in_score(setting: Setting) -> bool:
    """True when the config puts the reward-side KL into each sample's reward before post-processing: an estimator
    that does not take it in its token rewards, under kl_in_reward with kl_in_score (and kl_coef != 0)."""
    config = setting.config
    return config.kl_in_reward and config.kl_in_score and config.kl_coef != 0 and not setting.estimator.reads_kl


def rollout_correction(config: RecomputeConfig) -> bool:
    """True when the policy loss corrects for the training-inference mismatch (importance weights or rejection)."""
    return config.rollout_is != "none" or config.rollout_rs != "none"


KL_USED = When(lambda s: s.config.kl_coef != 0, lambda s: f"kl_coef={s.config.kl_coef}")
KL_IN_REWARD = When(kl_in_reward, lambda s: f"kl_in_reward with advantage_estimator={s.config.advantage_estimator}")
KL_IN_SCORE = When(
    kl_in_score, lambda s: f"kl_in_reward and kl_in_score with advantage_estimator={s.config.advantage_estimator}"
)
NEEDS_VALUES = When(lambda s: s.estimator.needs_values, lambda s: f"advantage_estimator={s.config.advantage_estimator}")
KL_LOSS = When(lambda s: s.config.kl_loss_coef != 0, lambda s: f"kl_loss_coef={s.config.kl_loss_coef}")
NO_REWARD_KL = When(lambda s: s.config.kl_coef == 0, lambda s: f"kl_coef={s.config.kl_coef}")
LOSS_TERMS_UNREPORTED = When(lambda s: not s.config.loss_terms_reported, lambda s: "loss_terms_reported=False")
NO_ENTROPY_TERM = When(lambda s: s.config.entropy_coef == 0, lambda s: f"entropy_coef={s.config.entropy_coef}")
METRICS_OVER_PROCESSES = When(lambda s: not s.config.metrics_per_rank, lambda s: "metrics_per_rank=False")
CORRECTED = When(
    lambda s: rollout_correction(s.config),
    lambda s: f"rollout_is={s.config.rollout_is!r}, rollout_rs={s.config.rollout_rs!r}",
)


@dataclass(frozen=True)
class StageIO:
    """The inputs and outputs of one stage. A name listed in `only_when` exists only under settings for which its
    condition holds (the reference log-probs when kl_coef is 0, the returns of an estimator that has none)."""

    payloads: tuple[str, ...] = ()
    """Per-token payloads the stage reads as inputs."""
    fields: tuple[str, ...] = ()
    """Sample-record fields the stage reads."""
    upstream: tuple[tuple[StageId, str], ...] = ()
    """Outputs of earlier stages the stage consumes, as (stage, output name). A name that is also one of `payloads`
    is taken from the earlier stage when the bundle contracts it, else from the payload."""
    outputs: tuple[str, ...] = ()
    """What the stage produces, named as production's recorded values of it are."""
    per: Literal["token", "sample", "cohort"] = "cohort"
    """How many values each output has: "token" (production's are per-token payloads of the same names), "sample"
    (lists in the stage's entry of the expected document) or "cohort" (scalars there)."""
    in_records: Mapping[str, str] = field(default_factory=dict)
    """Per-sample outputs whose recorded values the sample records also carry: output -> record field."""
    only_when: Mapping[str, When] = field(default_factory=dict)
    """Conditional payloads, upstream outputs and outputs, with the settings under which they exist."""
    optional: tuple[str, ...] = ()
    """Payloads and outputs a bundle may leave out: the stage uses or compares each one that is there."""
    optional_when: Mapping[str, When] = field(default_factory=dict)
    """Payloads and outputs a bundle may leave out under the settings for which the condition holds (and must hold
    under the others): the stage uses or compares each one that is there."""
    planned: tuple[str, ...] = ()
    """Payloads whose absence makes the stage unsupported, found before replay reads anything (`replay.plan`),
    rather than a divergence of the stage."""

    def is_optional(self, name: str, setting: Setting | None) -> bool:
        """True when a bundle may leave `name` out under `setting` (None: under some setting)."""
        if name in self.optional:
            return True
        when = self.optional_when.get(name)
        return when is not None and (setting is None or when.holds(setting))

    def _present(self, names: tuple[str, ...], setting: Setting | None) -> tuple[str, ...]:
        if setting is None:
            return names
        return tuple(n for n in names if n not in self.only_when or self.only_when[n].holds(setting))

    @property
    def recorded_as(self) -> Literal["payload", "expected"]:
        """Where production's values of `outputs` are stored: "payload" (per-token payloads of the same names) or
        "expected" (fields of the stage's entry in the expected document)."""
        return "payload" if self.per == "token" else "expected"

    @property
    def upstream_stages(self) -> tuple[StageId, ...]:
        """The earlier stages whose outputs this one may consume, each once."""
        return tuple(dict.fromkeys(stage for stage, _ in self.upstream))

    def consumes(self, setting: Setting) -> tuple[tuple[StageId, str], ...]:
        """The upstream outputs the stage consumes under `setting`."""
        return tuple((s, n) for s, n in self.upstream if n in self._present((n,), setting))

    def outputs_for(self, setting: Setting | None = None) -> tuple[str, ...]:
        """What the stage produces under `setting` (every output it may produce when None)."""
        return self._present(self.outputs, setting)

    @property
    def payloads_read(self) -> tuple[str, ...]:
        """Every payload the stage may load: its inputs, then the recorded values it compares with."""
        recorded = self.outputs if self.recorded_as == "payload" else ()
        return tuple(dict.fromkeys(self.payloads + recorded))

    def payloads_read_under(self, setting: Setting) -> tuple[str, ...]:
        """The payloads the stage may load under `setting`: `payloads_read` without those the setting rules out (the
        optional ones stay: the stage reads each one the bundle holds)."""
        return self._present(self.payloads_read, setting)

    def declared_inputs(self, setting: Setting | None = None) -> tuple[str, ...]:
        """The `inputs` of the stage's contract: its payloads, the upstream outputs it consumes, its fields."""
        names = self.payloads + tuple(name for _, name in self.upstream) + self.fields
        return tuple(dict.fromkeys(self._present(names, setting)))

    def needed_payloads(self, setting: Setting) -> tuple[str, ...]:
        """The payloads a bundle must hold for the stage to be replayed under `setting`."""
        return tuple(n for n in self._present(self.payloads_read, setting) if not self.is_optional(n, setting))

    def needed_expected(self, stage: StageId, setting: Setting | None = None) -> tuple[tuple[str, str], ...]:
        """The (stage entry, field) pairs of the expected document the stage compares with."""
        if self.recorded_as != "expected":
            return ()
        return tuple((stage.value, name) for name in self.outputs_for(setting) if not self.is_optional(name, setting))

    def planned_payloads(
        self, setting: Setting, contracted: frozenset[StageId] | set[StageId], stage: StageId
    ) -> tuple[tuple[str, str], ...]:
        """(payload, what needs it) for each of `planned` the stage needs under `setting`, given the stages the
        bundle contracts: a payload that an upstream stage produces is needed only when that stage is not there."""
        from_stage = {name: s for s, name in self.upstream}
        needs = []
        for name in self._present(self.planned, setting):
            if name in from_stage:
                if from_stage[name] not in contracted:
                    needs.append((name, f"{stage} without {from_stage[name]}"))
            else:
                needs.append((name, self.only_when[name].named(setting) if name in self.only_when else stage.value))
        return tuple(needs)


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")
"""The loss.policy scalars production reports (plus `kl_loss` when the config has a KL loss)."""

VALUE_LOSS_FIELDS = ("vf_loss", "vf_clipfrac")
"""The loss.value scalars production reports."""

OFF_POLICY_FIELDS = (
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
    "rollout_is_mean",
    "rollout_is_max",
    "rollout_is_min",
    "rollout_rs_masked_fraction",
)
"""The rollout.mismatch metrics of verl's rollout correction (its `rollout_corr/<name>` keys) that are functions of
the recorded log-probs, masks and config; recomputed only when production's value is recorded."""

MISMATCH_FIELDS = ("kl_k1", "kl_k3", "log_ratio_max_abs", "seq_log_ratio_max_abs", "staleness_max") + OFF_POLICY_FIELDS
"""The rollout.mismatch metrics; production's values of any of them are compared when recorded."""

STAGE_IO: dict[StageId, StageIO] = {
    StageId.SAMPLE: StageIO(payloads=(LOSS_MASK,), fields=("sample_id", "response_length", "total_length")),
    # the inference engine's log-probs against the trainer's old ones, and each sample's weights version; the
    # importance weights are compared when the bundle holds production's (`rollout_is_weights`); with the mask
    # before rejection (`pre_rejection_mask`) the metrics and weights are taken over it, and the rejection it
    # leads to is compared with the loss mask
    StageId.ROLLOUT_MISMATCH: StageIO(
        payloads=("rollout_log_probs", "old_log_probs", "loss_mask", "rollout_is_weights", PRE_REJECTION_MASK),
        fields=("policy_version",),
        outputs=MISMATCH_FIELDS,
        optional=("rollout_log_probs", "old_log_probs", "rollout_is_weights", PRE_REJECTION_MASK) + MISMATCH_FIELDS,
    ),
    StageId.REWARD_RAW: StageIO(
        fields=("raw_reward",), outputs=("raw_rewards",), per="sample", in_records={"raw_rewards": "raw_reward"}
    ),
    # with the KL in the score, each sample's reward less kl_coef times its masked sum of production's reward-side
    # KL (the `kl` payload; advantage.kl checks it against the log-probs)
    StageId.REWARD_POST_PROCESS: StageIO(
        payloads=("kl", "loss_mask"),
        fields=("group_index",),
        upstream=((StageId.REWARD_RAW, "raw_rewards"),),
        outputs=("rewards",),
        per="sample",
        in_records={"rewards": "reward"},
        only_when={"kl": KL_IN_SCORE, "loss_mask": KL_IN_SCORE},
    ),
    # compared on the tokens with mask 1 only: the KL of a masked-out token reaches no reward; without any KL (a
    # framework that computes none, or one whose only KL is in the loss) production's `kl` may be left out
    StageId.ADVANTAGE_KL: StageIO(
        payloads=("old_log_probs", "ref_log_probs", "loss_mask"),
        outputs=("kl",),
        per="token",
        only_when={"old_log_probs": KL_USED, "ref_log_probs": KL_USED},
        optional_when={"kl": NO_REWARD_KL},
    ),
    # the reward-side KL comes from advantage.kl when it is contracted, else from the recorded `kl` payload
    StageId.ADVANTAGE_ESTIMATE: StageIO(
        payloads=("loss_mask", "values", "kl"),
        upstream=((StageId.REWARD_POST_PROCESS, "rewards"), (StageId.ADVANTAGE_KL, "kl")),
        outputs=("advantages", "returns"),
        per="token",
        only_when={"values": NEEDS_VALUES, "returns": NEEDS_VALUES, "kl": KL_IN_REWARD},
        planned=("values",),
    ),
    # `advantages` is both: the recomputed ones when advantage.estimate is contracted, else the payload; without an
    # entropy term production may compute no entropy (verl's default), and entropy_loss is then not reported
    StageId.LOSS_POLICY: StageIO(
        payloads=(
            "old_log_probs",
            "log_probs",
            "entropy",
            "advantages",
            "loss_mask",
            "ref_log_probs",
            "rollout_log_probs",
            PRE_REJECTION_MASK,
        ),
        upstream=((StageId.ADVANTAGE_ESTIMATE, "advantages"),),
        outputs=LOSS_FIELDS + ("kl_loss",),
        only_when={
            "ref_log_probs": KL_LOSS,
            "kl_loss": KL_LOSS,
            "rollout_log_probs": CORRECTED,
            PRE_REJECTION_MASK: CORRECTED,
        },
        optional=(PRE_REJECTION_MASK,),
        optional_when={
            "entropy": NO_ENTROPY_TERM,
            "entropy_loss": NO_ENTROPY_TERM | METRICS_OVER_PROCESSES,
            "pg_clipfrac": METRICS_OVER_PROCESSES,
            "pg_loss": LOSS_TERMS_UNREPORTED,
            "ppo_kl": LOSS_TERMS_UNREPORTED,
            "kl_loss": LOSS_TERMS_UNREPORTED,
        },
        planned=("rollout_log_probs", "ref_log_probs"),
    ),
    # `returns` likewise: recomputed by an advantage.estimate whose estimator reads values when contracted, else
    # the payload
    StageId.LOSS_VALUE: StageIO(
        payloads=("values", "vpreds", "returns", "loss_mask"),
        upstream=((StageId.ADVANTAGE_ESTIMATE, "returns"),),
        outputs=VALUE_LOSS_FIELDS,
        planned=("values", "vpreds", "returns"),
    ),
}
"""Every stage's inputs and outputs, in stage order."""

RECORDED_PAYLOADS = frozenset(
    name for io in STAGE_IO.values() if io.recorded_as == "payload" for name in io.outputs if name not in io.only_when
)
"""The payloads that hold production's values of a stage output under every setting (`kl`, `advantages`): a
writer marks them `expected` whatever the contracts list."""


def payloads_of(stages: tuple[StageId, ...] | list[StageId]) -> tuple[str, ...]:
    """Every payload the stages may read under any setting, in stage order, each once."""
    return tuple(dict.fromkeys(name for stage in stages for name in STAGE_IO[stage].payloads_read))


__all__ = [
    "BUILTIN_ESTIMATOR_FLAGS",
    "EstimatorFlags",
    "kl_in_reward",
    "kl_in_score",
    "LOSS_FIELDS",
    "LOSS_MASK",
    "MISMATCH_FIELDS",
    "NO_ENTROPY_TERM",
    "NO_REWARD_KL",
    "LOSS_TERMS_UNREPORTED",
    "payloads_of",
    "PRE_REJECTION_MASK",
    "RECORDED_PAYLOADS",
    "rollout_correction",
    "OFF_POLICY_FIELDS",
    "Setting",
    "STAGE_IO",
    "StageIO",
    "VALUE_LOSS_FIELDS",
    "When",
]
