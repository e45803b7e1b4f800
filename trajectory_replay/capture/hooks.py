"""The hooks a training framework calls. Each is a no-op costing well under a microsecond while capture is off.

    manager = maybe_enable_for_actor(rank, is_producer, expected_ranks)   # once, at startup
    capture_rollout(R, ...)                  # rollout-level bundle rollout-<R> (this rank's shard)
    capture_microbatch(R, S, "mb-0007", ...) # once per micro-batch of actor step (R, S)
    capture_step_end(R, S, loss=..., ...)    # enqueues step-level bundle step-<R>-<S>
    capture_microbatch(R, S, "mb-0007", kind="critic", values=..., vpreds=..., returns=..., ...)
    capture_step_end(R, S, kind="critic", vf_loss=..., vf_clipfrac=..., ...)   # critic-<R>-<S>
    capture_slime_rollout(R, rollout_data, config=...)   # slime-family dict-of-lists layout
    trigger("why")                           # policy recorder:K: keep the steps up to the next one

Hooks never raise into training (a bad argument is counted in `stats()["errors"]` and logged);
only `maybe_enable_for_actor` raises, at startup, for a bad configuration.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from trajectory_replay.capture.config import (
    ENV_STEPS,
    CaptureConfigError,
    CapturePolicy,
    check_env_writer,
    choose_policy,
    load_config,
)
from trajectory_replay.capture.manager import CaptureManager
from trajectory_replay.errors import TrajectoryReplayError

log = logging.getLogger("trajectory_replay.capture")

_MANAGER: CaptureManager | None = None


def maybe_enable_for_actor(
    rank: int,
    is_producer: bool,
    expected_ranks: Sequence[int],
    *,
    environ: Mapping[str, str] | None = None,
    policy: CapturePolicy | str | None = None,
    **manager_options: Any,
) -> CaptureManager | None:
    """Start capture on this rank if the environment switches it on and the rank is a producer.

    Reads TRAJECTORY_REPLAY_CAPTURE* (or their older names; a bad value raises CaptureConfigError naming the
    variable, on every rank); TRAJECTORY_REPLAY_CAPTURE_WRITER chooses the writer unless `manager_options` has
    `writer`.
    Producer ranks (e.g. the last pipeline stage of each data-parallel replica) get a CaptureManager and its
    writer; other ranks get None and start nothing. `expected_ranks` are the producer ranks of
    one bundle: with more than one, each writes its own shard (rank `rank`) of a multi-producer bundle.
    `policy` (a `CapturePolicy` or its text: all, steps=..., every:N, recorder:K[,after=M][,max_bytes=B]) chooses
    the steps kept unless TRAJECTORY_REPLAY_CAPTURE_POLICY is set, which wins; TRAJECTORY_REPLAY_CAPTURE_SPOOL the
    recorder's spool. `manager_options` go to CaptureManager (max_queue_bytes, max_queue_records, storage_options,
    topology, producer, triggers, ...). The manager is kept module-global: the capture_* hooks use it.
    """
    global _MANAGER
    config = load_config(environ)
    if not config.enabled or not is_producer:
        return None
    assert config.capture_dir is not None  # load_config refuses capture switched on without a directory
    ranks = [int(r) for r in expected_ranks]
    if int(rank) not in ranks:
        raise ValueError(f"capture: rank {rank} is not among expected_ranks {ranks}")
    if _MANAGER is not None:
        log.warning("capture: already enabled (%r); replacing it", _MANAGER)
        shutdown()
    if config.writer is not None and "writer" not in manager_options:
        if manager_options.get("store") is not None:  # load_config checked it for a writer without a store object
            check_env_writer(
                config.writer, config.writer, config.capture_dir, store_given=True, variable=config.writer_variable
            )
        manager_options["writer"] = config.writer
    if config.run_id is not None:
        manager_options.setdefault("run_id", config.run_id)
    chosen = choose_policy(os.environ if environ is None else environ, policy)
    if chosen.kind not in ("all", "steps") and config.steps is not None:  # (load_config refuses the variable's)
        raise CaptureConfigError(f"policy {str(chosen)!r}: a step filter ({ENV_STEPS}) goes with all or steps=")
    manager_options.setdefault("policy", chosen)
    manager_options.setdefault("spool", config.spool)
    try:
        manager = CaptureManager(
            config.capture_dir,
            rank=rank,
            expected_ranks=ranks,
            steps=config.steps,
            rollouts=config.rollouts,
            **manager_options,
        )
    except TrajectoryReplayError as exc:
        raise CaptureConfigError(
            f"{config.dir_variable}={config.capture_dir!r}: cannot open the capture store: {exc}"
        ) from None
    _MANAGER = manager
    log.info("capture: enabled on rank %d of %s, writing to %s", rank, ranks, config.capture_dir)
    return manager


maybe_enable = maybe_enable_for_actor


def get_manager() -> CaptureManager | None:
    """The manager the hooks use, or None while capture is off."""
    return _MANAGER


def set_manager(manager: CaptureManager | None) -> CaptureManager | None:
    """Install `manager` for the hooks (tests, custom setups); returns the previous one (not closed)."""
    global _MANAGER
    previous, _MANAGER = _MANAGER, manager
    return previous


def disable() -> CaptureManager | None:
    """Turn the hooks into no-ops now. Records already queued are still written in the background."""
    global _MANAGER
    manager, _MANAGER = _MANAGER, None
    if manager is not None:
        manager.close(timeout=0)
    return manager


def shutdown(timeout: float | None = None) -> bool:
    """Turn the hooks off, write what is queued (up to `timeout`) and stop the writer. True if all was written."""
    global _MANAGER
    manager, _MANAGER = _MANAGER, None
    if manager is None:
        return True
    return manager.close(timeout)


def stats() -> dict[str, Any] | None:
    """The active manager's counters, or None while capture is off."""
    manager = _MANAGER
    return None if manager is None else manager.stats()


# ---- hooks ----------------------------------------------------------------------------------------


def capture_rollout(
    rollout_id: int,
    *,
    sample_ids: Sequence[str],
    group_index: Any,
    response_lengths: Any,
    total_lengths: Any,
    loss_masks: Any,
    raw_rewards: Any,
    rewards: Any,
    old_log_probs: Any,
    ref_log_probs: Any = None,
    kl: Any = None,
    advantages: Any,
    config: Any,
    weight_lineage: Any = None,
    micro_batch_ids: Any = None,
    values: Any = None,
    returns: Any = None,
    rollout_log_probs: Any = None,
    policy_versions: Any = None,
    rollout_is_weights: Any = None,
    mismatch_metrics: Mapping[str, Any] | None = None,
    payloads: Mapping[str, Any] | None = None,
) -> bool | None:
    """Rollout-level bundle `rollout-<R>` of this rank's samples. Per-token values: a flat tensor or a list of
    per-sample 1-D tensors, in sample order; `values` and `returns` are gae's old values and returns;
    `ref_log_probs` and production's reward-side `kl` may be left out where the config uses no KL.
    `rollout_log_probs` are the inference engine's log-probs of the responses, `policy_versions` the weights
    version that generated each sample: either contracts rollout.mismatch, whose metrics production reported
    (`mismatch_metrics`: any of stage_io.MISMATCH_FIELDS: kl_k1, kl_k3, log_ratio_max_abs, seq_log_ratio_max_abs,
    staleness_max, and verl's OFF_POLICY_FIELDS) and
    importance weights (`rollout_is_weights`) are then compared. `payloads` takes any other per-token payload the
    stage table declares for the stages of a rollout-level bundle, by its name there; a name it does not declare is
    refused (logged and counted, nothing written). Filtered by TRAJECTORY_REPLAY_CAPTURE_ROLLOUTS. True if
    enqueued."""
    if _MANAGER is None:
        return None
    named = dict(
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        kl=kl,
        advantages=advantages,
        values=values,
        returns=returns,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
    )
    return _MANAGER.capture_rollout(
        rollout_id,
        sample_ids=sample_ids,
        group_index=group_index,
        response_lengths=response_lengths,
        total_lengths=total_lengths,
        loss_masks=loss_masks,
        raw_rewards=raw_rewards,
        rewards=rewards,
        config=config,
        weight_lineage=weight_lineage,
        micro_batch_ids=micro_batch_ids,
        policy_versions=policy_versions,
        mismatch_metrics=mismatch_metrics,
        payloads=payloads,
        **named,
    )


def capture_microbatch(
    rollout_id: int,
    step_id: int,
    micro_batch_id: str,
    *,
    sample_ids: Sequence[str],
    group_index: Any,
    response_lengths: Any,
    total_lengths: Any,
    loss_masks: Any,
    raw_rewards: Any,
    rewards: Any,
    old_log_probs: Any,
    log_probs: Any,
    advantages: Any,
    entropy: Any = None,
    ref_log_probs: Any = None,
    values: Any = None,
    vpreds: Any = None,
    returns: Any = None,
    rollout_log_probs: Any = None,
    policy_versions: Any = None,
    payloads: Mapping[str, Any] | None = None,
    kind: str = "step",
) -> bool | None:
    """One micro-batch of actor step (R, S), snapshotted now (training may reuse its buffers). `entropy` may be
    left out when the loss has no entropy term (entropy_coef 0); `ref_log_probs` feed a KL loss
    (kl_loss_coef != 0); `values` (old), `vpreds` (current) and `returns` the value loss; `rollout_log_probs`
    (the inference engine's) a rollout correction (rollout_is / rollout_rs) and, with `policy_versions`, the
    step's rollout.mismatch. `payloads` takes any other per-token payload the stage table declares for the stages
    of a step-level bundle, by its name there (written when every micro-batch of the step gives it); a name it
    does not declare is refused (logged and counted). A repeated micro_batch_id of the same step is ignored.
    `kind="critic"`: a micro-batch of a critic's step (R, S), trained apart from the actor's: its value-loss inputs
    only (the policy's log-probs and advantages may be None), for bundle `critic-<R>-<S>`.
    Filtered by TRAJECTORY_REPLAY_CAPTURE_STEPS."""
    if _MANAGER is None:
        return None
    named = dict(
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        entropy=entropy,
        advantages=advantages,
        ref_log_probs=ref_log_probs,
        values=values,
        vpreds=vpreds,
        returns=returns,
        rollout_log_probs=rollout_log_probs,
    )
    return _MANAGER.capture_microbatch(
        rollout_id,
        step_id,
        micro_batch_id,
        sample_ids=sample_ids,
        group_index=group_index,
        response_lengths=response_lengths,
        total_lengths=total_lengths,
        loss_masks=loss_masks,
        raw_rewards=raw_rewards,
        rewards=rewards,
        policy_versions=policy_versions,
        payloads=payloads,
        kind=kind,
        **named,
    )


def capture_step_end(
    rollout_id: int,
    step_id: int,
    *,
    loss: Any = None,
    pg_loss: Any = None,
    pg_clipfrac: Any = None,
    ppo_kl: Any = None,
    config: Any,
    entropy_loss: Any = None,
    weight_lineage: Any = None,
    kl_loss: Any = None,
    vf_loss: Any = None,
    vf_clipfrac: Any = None,
    kind: str = "step",
    grad_norm: Any = None,
) -> bool | None:
    """End of actor step (R, S): enqueue step-level bundle `step-<R>-<S>` with this rank's reported loss
    scalars (numbers or 1-element tensors; CUDA tensors are copied asynchronously): `loss`, `pg_loss`,
    `pg_clipfrac`, `ppo_kl`; `entropy_loss` when the entropy was computed (required with an entropy term),
    `kl_loss` with a KL loss, `vf_loss` and `vf_clipfrac` with a value loss. With `kind="critic"`: the end of a
    critic's step, bundle `critic-<R>-<S>`, with `vf_loss` and `vf_clipfrac` only. A scalar left out is reported
    by validate and replay. `grad_norm`, the gradient norm the trainer computed, feeds the flight recorder's
    triggers (policy recorder:K). True if enqueued."""
    if _MANAGER is None:
        return None
    scalars = dict(
        loss=loss,
        pg_loss=pg_loss,
        entropy_loss=entropy_loss,
        pg_clipfrac=pg_clipfrac,
        ppo_kl=ppo_kl,
        kl_loss=kl_loss,
        vf_loss=vf_loss,
        vf_clipfrac=vf_clipfrac,
    )
    given = {name: value for name, value in scalars.items() if value is not None}
    return _MANAGER.capture_step_end(
        rollout_id, step_id, config=config, weight_lineage=weight_lineage, kind=kind, grad_norm=grad_norm, **given
    )


def trigger(reason: str) -> bool | None:
    """Fire the flight recorder's `user` trigger (policy recorder:K): the next step bundle this rank ends is kept,
    with the K before it and the M after, on every rank. None while capture is off, False under another policy."""
    if _MANAGER is None:
        return None
    return _MANAGER.trigger(reason)


def capture_slime_rollout(
    rollout_id: int,
    rollout_data: Mapping[str, Any],
    *,
    config: Any,
    sample_ids: Sequence[str] | None = None,
    group_index: Sequence[int] | None = None,
    weight_lineage: Any = None,
    kl: Any = None,
    micro_batch_ids: Any = None,
    payloads: Mapping[str, Any] | None = None,
) -> bool | None:
    """`capture_rollout` from the dict-of-lists rollout layout of slime-family frameworks (see docs/capture.md);
    `payloads` as for `capture_rollout`."""
    if _MANAGER is None:
        return None
    manager = _MANAGER
    try:
        kwargs = slime_rollout_arguments(
            rollout_id,
            rollout_data,
            sample_ids=sample_ids,
            group_index=group_index,
            kl=kl,
            micro_batch_ids=micro_batch_ids,
            multi_producer=manager.multi_producer,
        )
    except Exception as exc:
        if manager.wants_rollout(rollout_id):
            manager._hook_error(f"capture_slime_rollout({rollout_id})", exc)
        return False
    return manager.capture_rollout(
        rollout_id, config=config, weight_lineage=weight_lineage, payloads=payloads, **kwargs
    )


def slime_rollout_arguments(
    rollout_id: int,
    data: Mapping[str, Any],
    *,
    sample_ids: Sequence[str] | None = None,
    group_index: Sequence[int] | None = None,
    kl: Any = None,
    micro_batch_ids: Any = None,
    multi_producer: bool = False,
) -> dict[str, Any]:
    """The `capture_rollout` arguments for a slime-style `rollout_data` dict. Fails closed (ValueError) on
    anything replay compares that is missing; never guesses membership from positions or batch sizes."""

    def need(key: str) -> Any:
        if key not in data or data[key] is None:
            raise ValueError(f"rollout_data has no {key!r}")
        return data[key]

    n = len(need("response_lengths"))
    if sample_ids is None:
        if data.get("sample_ids") is not None:
            sample_ids = data["sample_ids"]
        elif data.get("sample_indices") is not None:
            sample_ids = [f"s-{rollout_id}-{int(i)}" for i in data["sample_indices"]]
        elif multi_producer:
            raise ValueError(
                "sample ids are required with several producer ranks (pass sample_ids= or "
                "rollout_data['sample_ids'] / ['sample_indices']): positional ids would collide "
                "across ranks"
            )
        else:
            sample_ids = [f"s-{rollout_id}-{i}" for i in range(n)]
    if group_index is None:
        group_index = data.get("group_index")
        if group_index is None:
            raise ValueError(
                "group_index is required (pass group_index= or rollout_data['group_index']); "
                "it is never guessed from positions"
            )
    rollout_log_probs = None
    if data.get("log_probs") is not None:
        old = data["log_probs"]
        rollout_log_probs = data.get("rollout_log_probs")  # the engine's, beside the trainer's: rollout.mismatch
    elif data.get("rollout_log_probs") is not None:
        old = data["rollout_log_probs"]
    else:
        raise ValueError("rollout_data has neither 'log_probs' nor 'rollout_log_probs'")
    if kl is None:
        kl = data.get("kl")
        if kl is None:
            raise ValueError(
                "the per-token KL production computed is required (pass kl= or store "
                "rollout_data['kl']); it is never recomputed at capture time"
            )
    if micro_batch_ids is None:
        micro_batch_ids = data.get("micro_batch_ids")
    return dict(
        sample_ids=sample_ids,
        group_index=group_index,
        response_lengths=data["response_lengths"],
        total_lengths=need("total_lengths"),
        loss_masks=need("loss_masks"),
        raw_rewards=need("raw_reward"),
        rewards=need("rewards"),
        old_log_probs=old,
        ref_log_probs=data.get("ref_log_probs"),
        kl=kl,
        advantages=need("advantages"),
        micro_batch_ids=micro_batch_ids,
        values=data.get("values"),
        returns=data.get("returns"),
        rollout_log_probs=rollout_log_probs,
        policy_versions=data.get("policy_versions"),
    )


__all__ = [
    "capture_microbatch",
    "capture_rollout",
    "capture_slime_rollout",
    "capture_step_end",
    "disable",
    "get_manager",
    "maybe_enable",
    "maybe_enable_for_actor",
    "set_manager",
    "shutdown",
    "slime_rollout_arguments",
    "stats",
    "trigger",
]
