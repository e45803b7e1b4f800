"""What each stage reads from a bundle and what it produces: the one table of stage inputs and outputs.

Capture declares it in the stage contracts it writes, `validate` checks that a bundle holds it, and replay
loads it and hands outputs downstream by it; all three read it here, so a stage's inputs or outputs change in
one place. Pure data (no torch): the commands that only look at bundles import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trajectory_replay.bundle.schema import RecomputeConfig, StageId


@dataclass(frozen=True)
class StageIO:
    """The inputs and outputs of one stage."""

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
    unless_kl_free: tuple[str, ...] = ()
    """Input payloads not needed when the config's kl_coef is 0 (the KL term is then zero by definition)."""

    @property
    def upstream_stages(self) -> tuple[StageId, ...]:
        """The earlier stages whose outputs this one consumes, each once."""
        return tuple(dict.fromkeys(stage for stage, _ in self.upstream))

    @property
    def payloads_read(self) -> tuple[str, ...]:
        """Every payload the stage may load: its inputs, then the recorded values it compares with."""
        recorded = self.outputs if self.recorded_as == "payload" else ()
        return tuple(dict.fromkeys(self.payloads + recorded))

    @property
    def declared_inputs(self) -> tuple[str, ...]:
        """The `inputs` of the stage's contract: its payloads, the upstream outputs it consumes, its fields."""
        return tuple(dict.fromkeys(self.payloads + tuple(name for _, name in self.upstream) + self.fields))

    def needed_payloads(self, config: RecomputeConfig) -> tuple[str, ...]:
        """The payloads a bundle must hold for the stage to be replayed under `config`."""
        kl_free = config.kl_coef == 0
        return tuple(p for p in self.payloads_read if not (kl_free and p in self.unless_kl_free))

    def needed_expected(self, stage: StageId) -> tuple[tuple[str, str], ...]:
        """The (stage entry, field) pairs of the expected document the stage compares with."""
        if self.recorded_as != "expected":
            return ()
        return tuple((stage.value, name) for name in self.outputs)


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")
"""The loss.policy scalars production reports."""

STAGE_IO: dict[StageId, StageIO] = {
    StageId.SAMPLE: StageIO(payloads=("loss_mask",), fields=("sample_id", "response_length", "total_length")),
    StageId.REWARD_RAW: StageIO(fields=("raw_reward",), outputs=("raw_rewards",)),
    StageId.REWARD_POST_PROCESS: StageIO(fields=("group_index",), upstream=((StageId.REWARD_RAW, "raw_rewards"),),
                                         outputs=("rewards",)),
    StageId.ADVANTAGE_KL: StageIO(payloads=("old_log_probs", "ref_log_probs"), outputs=("kl",),
                                  recorded_as="payload", unless_kl_free=("ref_log_probs",)),
    StageId.ADVANTAGE_ESTIMATE: StageIO(upstream=((StageId.REWARD_POST_PROCESS, "rewards"),),
                                        outputs=("advantages",), recorded_as="payload"),
    # `advantages` is both: the recomputed ones when advantage.estimate is contracted, else the payload
    StageId.LOSS_POLICY: StageIO(payloads=("old_log_probs", "log_probs", "entropy", "advantages", "loss_mask"),
                                 upstream=((StageId.ADVANTAGE_ESTIMATE, "advantages"),), outputs=LOSS_FIELDS),
    StageId.LOSS_VALUE: StageIO(),
}
"""Every stage's inputs and outputs, in stage order."""


__all__ = ["LOSS_FIELDS", "STAGE_IO", "StageIO"]
