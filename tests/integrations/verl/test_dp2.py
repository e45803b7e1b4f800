"""dp = 2 as verl 0.9.1 runs it, across a real process boundary: two ranks joined by torch.distributed (gloo).

The step (steps.py) is reordered by verl's own `RayPPOTrainer._balance_batch` (`get_seqlen_balanced_partitions`
over `calculate_workload`), which splits prompt groups across the two ranks, and dispatched as verl dispatches it
(rank r takes chunk r). Each rank does what verl's FSDP engine does with its share of the mini-batch
(`forward_backward_batch`): the no-padding layout (`left_right_2_no_padding`), `batch_num_tokens` all-reduced over
the ranks, `dp_size` 2, and the dynamic-batch-size split into micro-batches (`prepare_micro_batches` ->
`rearrange_micro_batches`), with the micro-batch count agreed over the ranks (verl all-reduces it on the
accelerator; on CPU the same MAX all-reduce runs over gloo and the count is handed in as `min_num_micro_batch`).
Each micro-batch goes through verl's `ppo_loss` wrapped by `capture_loss`, each rank a producer rank of its own
capture manager; the two ranks write one step-level bundle, which replays clean, in token-mean and in
seq-mean-token-mean. The rollout-level bundle of the balanced batch (groups split across ranks) replays clean too.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from tests.integrations.verl.steps import (
    PROMPTS,
    SAMPLES,
    StepOptions,
    VerlStep,
    _flat_model_output,
    actor_config,
    balanced,
    build_step,
)
from trajectory_replay import capture
from trajectory_replay.bundle import open_sources
from trajectory_replay.capture import CaptureManager
from trajectory_replay.integrations.verl import write_rollout_bundle
from trajectory_replay.integrations.verl_loss import capture_loss
from trajectory_replay.outcome import Status
from trajectory_replay.replay import replay

DP = 2
MAX_TOKEN_LEN = 640
"""verl's `max_token_len_per_gpu`: each rank's half of the mini-batch takes a few micro-batches."""
MODES = {1: "token-mean", 2: "seq-mean-token-mean"}
"""Rollout id -> the loss aggregation of the step captured under it."""
SEED = 5


def _step(mode: str) -> VerlStep:
    return build_step(StepOptions(loss_agg_mode=mode, seed=SEED))


def _rank(rank: int, port: int, root: str) -> None:
    """One dp rank: its share of every step, through the engine's micro-batching and the wrapped ppo_loss."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=DP)
    try:
        for rollout, mode in MODES.items():
            step = _step(mode)
            share = balanced(step.batch, DP).chunk(DP)[rank]
            data = left_right_2_no_padding(share.to_tensordict())
            tokens = data["loss_mask"].sum()
            dist.all_reduce(tokens)
            count = torch.tensor([-(-int(share.batch["attention_mask"].sum()) // MAX_TOKEN_LEN)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            tu.assign_non_tensor(
                data,
                batch_num_tokens=int(tokens),
                dp_size=DP,
                global_batch_size=PROMPTS * SAMPLES,
                global_steps=rollout,
                use_dynamic_bsz=True,
                max_token_len_per_gpu=MAX_TOKEN_LEN,
            )
            micro_batches, _ = prepare_micro_batches(data, min_num_micro_batch=int(count))
            manager = CaptureManager(root, rank=rank, expected_ranks=list(range(DP)), writer="thread")
            capture.set_manager(manager)
            wrapped = capture_loss(ppo_loss)
            config = actor_config(step.options)
            for micro in micro_batches:
                rows = micro["row"].tolist()
                output = {"log_probs": _flat_model_output(step.log_probs, step.batch, rows)}
                assert step.entropy is not None
                output["entropy"] = _flat_model_output(step.entropy, step.batch, rows)
                wrapped(config, output, micro)
            assert manager.flush() and manager.stats()["errors"] == 0, manager.stats()
            capture.shutdown()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp2")
    mp.start_processes(_rank, args=(_free_port(), str(root)), nprocs=DP, start_method="spawn", join=True)
    return root


def test_verls_balancing_splits_prompt_groups_across_the_ranks() -> None:
    batch = balanced(_step("token-mean").batch, DP)
    ranks = [set(part.non_tensor_batch["uid"].tolist()) for part in batch.chunk(DP)]
    assert ranks[0] & ranks[1], "no prompt group has samples on both ranks"


@pytest.mark.parametrize("rollout", list(MODES), ids=list(MODES.values()))
def test_two_dp_ranks_in_two_processes_replay_clean(captured: Path, rollout: int) -> None:
    sources = open_sources(str(captured / f"step-{rollout}-0"))
    assert len(sources) == DP
    micro = [s.index.identity.micro_batch_ids for s in sources]
    assert all(len(ids) >= 2 for ids in micro) and micro[1][0].startswith("mb-1-")
    assert sum(len(s.index.samples) for s in sources) == PROMPTS * SAMPLES
    config = sources[0].index.config
    assert config.loss_scale == DP
    step = _step(MODES[rollout])
    tokens = int(step.batch.batch["response_mask"].sum())
    assert config.loss_denominator == (tokens if MODES[rollout] == "token-mean" else PROMPTS * SAMPLES)
    report = replay(sources)
    assert report.status is Status.PASS, [(s.stage, s.rank, s.message) for s in report.stages if s.status != "pass"]
    assert len([s for s in report.stages if s.stage == "loss.policy" and s.status == "pass"]) == DP


def test_the_rollout_bundle_of_the_balanced_batch_replays_clean(tmp_path: Path) -> None:
    from tests.integrations.verl.bundles import recompute_config

    step = _step("token-mean")
    batch = balanced(step.batch, DP)
    url = write_rollout_bundle(batch, recompute_config(step), tmp_path, 1)
    (source,) = open_sources(url)
    groups = [r.group_index for r in source.index.samples]
    assert groups != sorted(groups)  # members of a group are apart in the balanced order
    report = replay([source])
    assert report.status is Status.PASS, report.render_text()
    assert report.stage("reward.post_process").compared > 0
