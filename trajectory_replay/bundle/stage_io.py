"""What each stage reads from a bundle and what it produces: the one table of stage inputs and outputs.

Capture declares it in the stage contracts it writes, `validate` checks that a bundle holds it, and replay
loads it and hands outputs downstream by it; all three read it here, so a stage's inputs or outputs change in
one place. Pure data (no torch): the commands that only look at bundles import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Optional

from trajectory_replay.bundle.schema import RecomputeConfig, StageId


Needed = Callable[[RecomputeConfig], bool]
"""When a conditional input or output exists, as a predicate of the recompute config."""


def _kl_used(config: RecomputeConfig) -> bool:
    return config.kl_coef != 0


def _gae(config: RecomputeConfig) -> bool:
    return config.advantage_estimator == "gae"


def kl_in_reward(config: RecomputeConfig) -> bool:
    """True when the config puts the reward-side KL into the token rewards of its estimator."""
    return config.kl_in_reward and config.kl_coef != 0 and config.advantage_estimator in KL_REWARD_ESTIMATORS


def _kl_loss(config: RecomputeConfig) -> bool:
    return config.kl_loss_coef != 0


def rollout_correction(config: RecomputeConfig) -> bool:
    """True when the policy loss corrects for the training-inference mismatch (importance weights or rejection)."""
    return config.rollout_is != "none" or config.rollout_rs != "none"


KL_REWARD_ESTIMATORS = ("reinforce_plus_plus", "gae")
"""The estimators whose token rewards take the reward-side KL penalty when kl_in_reward is set."""


@dataclass(frozen=True)
class StageIO:
    """The inputs and outputs of one stage. A name listed in `only_when` exists only under configs for which its
    predicate holds (the reference log-probs when kl_coef is 0, the returns of an estimator that has none)."""

    payloads: tuple[str, ...] = ()
    """Per-token payloads the stage reads as inputs."""
    fields: tuple[str, ...] = ()
    """Sample-record fields the stage reads."""
    upstream: tuple[tuple[StageId, str], ...] = ()
    """Outputs of earlier stages the stage consumes, as (stage, output name)."""
    outputs: tuple[str, ...] = ()
    """What the stage produces, named as production's recorded values of it are."""
    recorded_as: Literal["payload", "expected"] = "expected"
    """Where production's values of `outputs` are stored: per-token payloads of the same names, or fields of
    the stage's entry in the expected document."""
    only_when: Mapping[str, Needed] = field(default_factory=dict)
    """Conditional payloads, upstream outputs and outputs, with the configs under which they exist."""
    optional: tuple[str, ...] = ()
    """Payloads and outputs a bundle may leave out: the stage uses or compares each one that is there."""

    def _present(self, names: tuple[str, ...], config: Optional[RecomputeConfig]) -> tuple[str, ...]:
        if config is None:
            return names
        return tuple(n for n in names if n not in self.only_when or self.only_when[n](config))

    @property
    def upstream_stages(self) -> tuple[StageId, ...]:
        """The earlier stages whose outputs this one may consume, each once."""
        return tuple(dict.fromkeys(stage for stage, _ in self.upstream))

    def consumes(self, config: RecomputeConfig) -> tuple[tuple[StageId, str], ...]:
        """The upstream outputs the stage consumes under `config`."""
        return tuple((s, n) for s, n in self.upstream if n in self._present((n,), config))

    def outputs_for(self, config: Optional[RecomputeConfig] = None) -> tuple[str, ...]:
        """What the stage produces under `config` (every output it may produce when None)."""
        return self._present(self.outputs, config)

    @property
    def payloads_read(self) -> tuple[str, ...]:
        """Every payload the stage may load: its inputs, then the recorded values it compares with."""
        recorded = self.outputs if self.recorded_as == "payload" else ()
        return tuple(dict.fromkeys(self.payloads + recorded))

    def payloads_read_under(self, config: RecomputeConfig) -> tuple[str, ...]:
        """The payloads the stage may load under `config`: `payloads_read` without those the config rules out (the
        optional ones stay: the stage reads each one the bundle holds)."""
        return self._present(self.payloads_read, config)

    def declared_inputs(self, config: Optional[RecomputeConfig] = None) -> tuple[str, ...]:
        """The `inputs` of the stage's contract: its payloads, the upstream outputs it consumes, its fields."""
        names = self.payloads + tuple(name for _, name in self.upstream) + self.fields
        return tuple(dict.fromkeys(self._present(names, config)))

    def needed_payloads(self, config: RecomputeConfig) -> tuple[str, ...]:
        """The payloads a bundle must hold for the stage to be replayed under `config`."""
        return tuple(n for n in self._present(self.payloads_read, config) if n not in self.optional)

    def needed_expected(self, stage: StageId, config: Optional[RecomputeConfig] = None) -> tuple[tuple[str, str], ...]:
        """The (stage entry, field) pairs of the expected document the stage compares with."""
        if self.recorded_as != "expected":
            return ()
        return tuple((stage.value, name) for name in self.outputs_for(config) if name not in self.optional)


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")
"""The loss.policy scalars production reports (plus `kl_loss` when the config has a KL loss)."""

VALUE_LOSS_FIELDS = ("vf_loss", "vf_clipfrac")
"""The loss.value scalars production reports."""

MISMATCH_FIELDS = ("kl_k1", "kl_k3", "log_ratio_max_abs", "seq_log_ratio_max_abs", "staleness_max")
"""The rollout.mismatch metrics; production's values of any of them are compared when recorded."""

STAGE_IO: dict[StageId, StageIO] = {
    StageId.SAMPLE: StageIO(payloads=("loss_mask",), fields=("sample_id", "response_length", "total_length")),
    # the inference engine's log-probs against the trainer's old ones, and each sample's weights version; the
    # importance weights are compared when the bundle holds production's (`rollout_is_weights`)
    StageId.ROLLOUT_MISMATCH: StageIO(payloads=("rollout_log_probs", "old_log_probs", "loss_mask",
                                                "rollout_is_weights"),
                                      fields=("policy_version",), outputs=MISMATCH_FIELDS,
                                      optional=("rollout_log_probs", "old_log_probs", "rollout_is_weights")
                                      + MISMATCH_FIELDS),
    StageId.REWARD_RAW: StageIO(fields=("raw_reward",), outputs=("raw_rewards",)),
    StageId.REWARD_POST_PROCESS: StageIO(fields=("group_index",), upstream=((StageId.REWARD_RAW, "raw_rewards"),),
                                         outputs=("rewards",)),
    StageId.ADVANTAGE_KL: StageIO(payloads=("old_log_probs", "ref_log_probs"), outputs=("kl",),
                                  recorded_as="payload",
                                  only_when={"old_log_probs": _kl_used, "ref_log_probs": _kl_used}),
    # the reward-side KL comes from advantage.kl when it is contracted, else from the recorded `kl` payload
    StageId.ADVANTAGE_ESTIMATE: StageIO(payloads=("loss_mask", "values", "kl"),
                                        upstream=((StageId.REWARD_POST_PROCESS, "rewards"),
                                                  (StageId.ADVANTAGE_KL, "kl")),
                                        outputs=("advantages", "returns"), recorded_as="payload",
                                        only_when={"values": _gae, "returns": _gae, "kl": kl_in_reward}),
    # `advantages` is both: the recomputed ones when advantage.estimate is contracted, else the payload
    StageId.LOSS_POLICY: StageIO(payloads=("old_log_probs", "log_probs", "entropy", "advantages", "loss_mask",
                                           "ref_log_probs", "rollout_log_probs"),
                                 upstream=((StageId.ADVANTAGE_ESTIMATE, "advantages"),),
                                 outputs=LOSS_FIELDS + ("kl_loss",),
                                 only_when={"ref_log_probs": _kl_loss, "kl_loss": _kl_loss,
                                            "rollout_log_probs": rollout_correction}),
    # `returns` likewise: recomputed by a gae advantage.estimate when contracted, else the payload
    StageId.LOSS_VALUE: StageIO(payloads=("values", "vpreds", "returns", "loss_mask"),
                                upstream=((StageId.ADVANTAGE_ESTIMATE, "returns"),), outputs=VALUE_LOSS_FIELDS),
}
"""Every stage's inputs and outputs, in stage order."""


__all__ = ["KL_REWARD_ESTIMATORS", "kl_in_reward", "LOSS_FIELDS", "MISMATCH_FIELDS", "rollout_correction", "STAGE_IO", "StageIO", "VALUE_LOSS_FIELDS"]
