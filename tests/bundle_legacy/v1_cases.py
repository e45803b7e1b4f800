"""V1 test data: the canonical case of REPLAY_SEMANTICS.md as bundle documents, and helpers to tamper with a bundle.

A plain module (not conftest) so tests can import it by a name no other test directory uses.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trajectory_replay.bundle.legacy import write_v1_bundle
from trajectory_replay.bundle.schema import (
    ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest, ProducerInfo, RecomputeConfig, SampleRecord,
    StageCapability, StageContract, StageId, Tolerance,
)

STAGES = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
          StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY)
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


def make_case(bundle_id: str = "b-1", response_lengths: Sequence[int] = (2, 2, 2, 2),
              rewards: Sequence[float] = REWARDS) -> Case:
    """The canonical case (rewards [1, 3, 10, 12], groups [0, 0, 1, 1], n = 2), response lengths adjustable."""
    tokens = sum(response_lengths)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // 2, response_length=length, total_length=length + 1,
                            loss_mask=[1] * length, raw_reward=RAW_REWARDS[i], reward=rewards[i],
                            micro_batch_id="mb-0007" if i < 2 else "mb-0008")
               for i, length in enumerate(response_lengths)]
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=Identity(actor_step_id=ActorStepId(rollout_id=120, step_id=0), rank={"cp": 1}),
        samples=samples,
        config=RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, kl_loss_type="k1", kl_coef=0.1,
                               eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.01),
    )
    manifest = Manifest(
        format_version="1.0.0", bundle_id=bundle_id,
        producer=ProducerInfo(commit="0000000", torch_version=torch.__version__),
        stage_contracts={stage: StageContract(stage=stage, version="v1", capability=StageCapability.RECOMPUTE)
                         for stage in STAGES},
        comparison_policy=ComparisonPolicy(exact_fields=["sample_id", "loss_mask", "group_index"],
                                           tolerances={"reward.post_process": Tolerance(atol=1e-5)}),
        redaction={"prompt": "hash"},
    )
    pg_loss = sum(-r for r in rewards)
    expected = {
        "reward.raw": {"raw_rewards": list(RAW_REWARDS)},
        "reward.post_process": {"rewards": list(rewards)},
        "loss.policy": {"loss": pg_loss - 0.01 * 2.0, "pg_loss": pg_loss, "entropy_loss": 2.0,
                        "pg_clipfrac": 0.0, "ppo_kl": 0.0},
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


def reseal(bundle: Path, filename: str, data: bytes) -> None:
    """Replace a JSON document and fix COMPLETE's hash of it, so only the check a test targets can fail."""
    (bundle / filename).write_bytes(data)
    complete = json.loads((bundle / "COMPLETE").read_text())
    complete["metadata"][filename] = sha256(data)
    (bundle / "COMPLETE").write_bytes(v1_json(complete))


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

    edit_json(bundle, "manifest.json", update)
