"""V1 test data: the canonical case as bundle documents, bundles shaped exactly as the older tool writes them
(`tool_case`, `write_capture`, `write_capture_multirank`), and helpers to tamper with a bundle.

A plain module (not conftest) so tests can import it by a name no other test directory uses.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trajectory_replay.bundle.legacy import capture_dir_name, write_v1_bundle, write_v1_multirank
from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
    Tolerance,
)

STAGES = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
    StageId.LOSS_POLICY,
)
RAW_REWARDS = [1.0, 3.0, 10.0, 12.0]
REWARDS = [-1.0, 1.0, -1.0, 1.0]


@dataclass
class Case:
    """The documents and payloads of one bundle, ready for write_v1_bundle."""

    manifest: Manifest
    index: BundleIndex
    expected: dict[str, Any]
    payloads: dict[str, torch.Tensor] = field(default_factory=dict)

    def write(self, path: Path, **kwargs: Any) -> Path:
        """Write this case as a V1 bundle at `path`."""
        return write_v1_bundle(path, self.manifest, self.index, self.expected, self.payloads, **kwargs)

    def shard(self) -> tuple[Manifest, BundleIndex, dict[str, Any], dict[str, torch.Tensor]]:
        """This case as one entry of write_v1_multirank's `shards`."""
        return self.manifest, self.index, self.expected, self.payloads


def make_case(
    bundle_id: str = "b-1", response_lengths: Sequence[int] = (2, 2, 2, 2), rewards: Sequence[float] = REWARDS
) -> Case:
    """The canonical case (rewards [1, 3, 10, 12], groups [0, 0, 1, 1], n = 2), response lengths adjustable."""
    tokens = sum(response_lengths)
    samples = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=i // 2,
            response_length=length,
            total_length=length + 1,
            loss_mask=[1] * length,
            raw_reward=RAW_REWARDS[i],
            reward=rewards[i],
            micro_batch_id="mb-0007" if i < 2 else "mb-0008",
        )
        for i, length in enumerate(response_lengths)
    ]
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=Identity(actor_step_id=ActorStepId(rollout_id=120, step_id=0), rank={"cp": 1}),
        samples=samples,
        config=RecomputeConfig(
            advantage_estimator="grpo",
            n_samples_per_prompt=2,
            kl_loss_type="k1",
            kl_coef=0.1,
            eps_clip=0.2,
            eps_clip_high=0.2,
            entropy_coef=0.01,
        ),
    )
    manifest = Manifest(
        format_version="1.0.0",
        bundle_id=bundle_id,
        producer=ProducerInfo(commit="0000000", torch_version=torch.__version__),
        stage_contracts={
            stage: StageContract(stage=stage, version="v1", capability=StageCapability.RECOMPUTE) for stage in STAGES
        },
        comparison_policy=ComparisonPolicy(
            exact_fields=["sample_id", "loss_mask", "group_index"],
            tolerances={"reward.post_process": Tolerance(atol=1e-5)},
        ),
        redaction={"prompt": "hash"},
    )
    pg_loss = sum(-r for r in rewards)
    expected = {
        "reward.raw": {"raw_rewards": list(RAW_REWARDS)},
        "reward.post_process": {"rewards": list(rewards)},
        "loss.policy": {
            "loss": pg_loss - 0.01 * 2.0,
            "pg_loss": pg_loss,
            "entropy_loss": 2.0,
            "pg_clipfrac": 0.0,
            "ppo_kl": 0.0,
        },
    }
    old = torch.zeros(tokens)
    ref = torch.full((tokens,), 0.25)
    payloads = {
        "old_log_probs": old,
        "log_probs": old.clone(),
        "ref_log_probs": ref,
        "entropy": torch.full((tokens,), 0.5),
        "kl": old - ref,
        "advantages": torch.tensor([r for r, n in zip(rewards, response_lengths) for _ in range(n)]),
    }
    return Case(manifest, index, expected, payloads)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def v1_json(value: Any) -> bytes:
    """The V1 JSON encoding, written independently of the code under test."""
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


def update_rank_markers(bundle: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Apply `mutate` to every COMPLETE.<r> inside the bundle directory (the rank's own marker)."""
    for marker_path in sorted(bundle.glob("COMPLETE.*")):
        marker = json.loads(marker_path.read_text())
        mutate(marker)
        marker_path.write_bytes(v1_json(marker))


def reseal(bundle: Path, filename: str, data: bytes) -> None:
    """Replace a JSON document and fix COMPLETE's (and the rank marker's) hash of it, so only the check a test
    targets can fail."""
    (bundle / filename).write_bytes(data)
    complete = json.loads((bundle / "COMPLETE").read_text())
    complete["metadata"][filename] = sha256(data)
    (bundle / "COMPLETE").write_bytes(v1_json(complete))
    update_rank_markers(bundle, lambda marker: marker["metadata"].update({filename: sha256(data)}))


def edit_json(bundle: Path, filename: str, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Load a JSON document, let `mutate` change it in place, write it back resealed."""
    doc = json.loads((bundle / filename).read_text())
    mutate(doc)
    reseal(bundle, filename, v1_json(doc))


def replace_payload(bundle: Path, name: str, data: bytes, **entry_updates: Any) -> None:
    """Put `data` in payloads/<name>.pt and update its manifest entry (bytes, sha256, and `entry_updates`)."""
    (bundle / "payloads" / f"{name}.pt").write_bytes(data)

    def update(manifest: dict[str, Any]) -> None:
        manifest["payloads"][name].update({"bytes": len(data), "sha256": sha256(data), **entry_updates})

    update_rank_markers(
        bundle, lambda marker: marker["payloads"].update({name: entry_updates.get("sha256", sha256(data))})
    )
    edit_json(bundle, "manifest.json", update)


# --------------------------------------------------------------------------- bundles as the older tool writes them

TOOL_REDACTION = {"prompt": "hash", "response": "truncate:64"}
ROLLOUT_STAGES = (StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL, StageId.ADVANTAGE_ESTIMATE)
LOSS_ONLY_STAGES = (StageId.SAMPLE, StageId.LOSS_POLICY)


def group_normalized(raw: Sequence[float], groups: Sequence[int]) -> list[float]:
    """Each reward minus its group's mean (no std normalization), computed independently of replay."""
    out = []
    for i, g in enumerate(groups):
        members = [raw[j] for j, h in enumerate(groups) if h == g]
        out.append(raw[i] - sum(members) / len(members))
    return out


def tool_case(
    bundle_id: str = "b-00001",
    *,
    raw_rewards: Sequence[float] = RAW_REWARDS,
    groups: Sequence[int] | None = None,
    step: int | None = 0,
    rollout_id: int = 120,
    level: str = "step",
    log_prob: float = 0.0,
    capabilities: dict[StageId, StageCapability] | None = None,
) -> Case:
    """A bundle shaped as the older tool's own capture writes it: two tokens per sample, prompt groups of two,
    every stage contracted `recompute` and loss.value declared `unsupported` (that tool declares it so in every
    bundle), its producer and redaction fields. `level` "rollout" gives its rollout-level bundle (identity
    rollout_id; reward.raw .. advantage.estimate only; no micro-batches, no loss inputs), "loss" its loss-only
    capture (sample and loss.policy; every sample in group 0; the recorded advantages are the loss input).
    Different `raw_rewards`/`log_prob` give another rank's own data under the same sample ids."""
    n = len(raw_rewards)
    groups = list(groups) if groups is not None else ([0] * n if level == "loss" else [i // 2 for i in range(n)])
    rewards = group_normalized(raw_rewards, groups) if level != "loss" else [float(r) for r in raw_rewards]
    tokens = 2 * n
    samples = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=groups[i],
            response_length=2,
            total_length=3,
            loss_mask=[1, 1],
            raw_reward=float(raw_rewards[i]),
            reward=float(rewards[i]),
            label_hash="" if level == "rollout" else "hash:label",
            micro_batch_id=None if level == "rollout" else f"mb-{7 + i // 2:04d}",
        )
        for i in range(n)
    ]
    if level == "rollout":
        identity = Identity(rollout_id=rollout_id, rank={"cp": 1, "dp": 0, "tp": 0, "pp": 0})
        stages = ROLLOUT_STAGES
    else:
        identity = Identity(
            actor_step_id=ActorStepId(rollout_id=rollout_id, step_id=step),
            rank={"cp": 1, "dp": 0, "tp": 0, "pp": 0},
            micro_batch_ids=["mb-0007"],
            consumer_batch_ids=["tq-7"],
            rollout_partition_ids=[f"rollout-{rollout_id - 1}"],
            weight_lineage={"actor_weight": f"w-{rollout_id}", "rollout_weight": f"w-{rollout_id - 1}"},
        )
        stages = LOSS_ONLY_STAGES if level == "loss" else STAGES
    contracts = {
        stage: StageContract(
            stage=stage,
            version="v1",
            capability=StageCapability.RECOMPUTE,
            implementation="reimplemented" if stage == StageId.REWARD_POST_PROCESS else "reuse",
        )
        for stage in stages
    }
    if level != "rollout":
        contracts[StageId.LOSS_VALUE] = StageContract(
            stage=StageId.LOSS_VALUE, version="v1", capability=StageCapability.UNSUPPORTED
        )
    for stage, capability in (capabilities or {}).items():
        contracts[stage] = StageContract(stage=stage, version="v1", capability=capability)
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=identity,
        samples=samples,
        config=RecomputeConfig(
            advantage_estimator="grpo",
            n_samples_per_prompt=2,
            kl_loss_type="k1",
            kl_coef=0.1,
            eps_clip=0.2,
            eps_clip_high=0.2,
            entropy_coef=0.01,
        ),
    )
    manifest = Manifest(
        format_version="1.0.0",
        bundle_id=bundle_id,
        producer=ProducerInfo(commit="test", torch_version=torch.__version__),
        stage_contracts=contracts,
        comparison_policy=ComparisonPolicy(exact_fields=["sample_id", "loss_mask", "group_index"]),
        redaction=dict(TOOL_REDACTION),
    )
    old = torch.zeros(tokens)
    advantages = torch.tensor([r for r in rewards for _ in range(2)])
    payloads = {
        "old_log_probs": old,
        "ref_log_probs": torch.full((tokens,), 0.25),
        "kl": old - 0.25,
        "advantages": advantages,
    }
    expected: dict[str, Any] = {}
    if level != "loss":
        expected["reward.raw"] = {"raw_rewards": [float(r) for r in raw_rewards]}
        expected["reward.post_process"] = {"rewards": rewards}
    if level != "rollout":
        payloads["log_probs"] = torch.full((tokens,), float(log_prob))
        payloads["entropy"] = torch.full((tokens,), 0.5)
        if level == "loss":
            del payloads["kl"], payloads["ref_log_probs"]
        expected["loss.policy"] = reference_loss(rewards, log_prob)
    return Case(manifest, index, expected, payloads)


def reference_loss(
    advantages: Sequence[float],
    log_prob: float,
    eps_clip: float = 0.2,
    entropy_coef: float = 0.01,
    entropy: float = 0.5,
) -> dict[str, float]:
    """loss.policy as the older tool reduces it (a sum over samples of per-sample masked means), for samples
    whose tokens all carry the same values; plain Python, independent of replay's kernels."""
    ratio = math.exp(log_prob)
    clipped = min(max(ratio, 1 - eps_clip), 1 + eps_clip)
    pg_loss = sum(max(-ratio * a, -clipped * a) for a in advantages)
    clipfrac = sum(1.0 for a in advantages if -clipped * a > -ratio * a)
    entropy_loss = entropy * len(advantages)
    return {
        "loss": pg_loss - entropy_coef * entropy_loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": clipfrac,
        "ppo_kl": -log_prob * len(advantages),
    }


def write_capture(capture_dir: Path, case: Case, **kwargs: Any) -> Path:
    """Write `case` into a capture directory under the name the older tool gives it (replay-<R>-<S> or
    replay-rollout-<R>)."""
    return case.write(capture_dir / capture_dir_name(case.index), **kwargs)


def write_capture_multirank(capture_dir: Path, cases: Sequence[Case], **kwargs: Any) -> Path:
    """Write one multi-rank bundle (rank r = cases[r]) into a capture directory, as the older tool does; the
    bundle id is the directory name, as in that tool's multi-rank captures."""
    name = capture_dir_name(cases[0].index)
    shards = {}
    for rank, case in enumerate(cases):
        index = case.index.model_copy(update={"bundle_id": name})
        manifest = case.manifest.model_copy(update={"bundle_id": name})
        shards[rank] = (manifest, index, case.expected, case.payloads)
    return write_v1_multirank(capture_dir / name, shards, list(range(len(cases))), **kwargs)
