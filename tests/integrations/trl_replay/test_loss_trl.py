"""Replay's loss.policy against TRL 1.16's own loss: GRPOTrainer._compute_loss run on the same tensors, for every
loss type the profile models, with and without the KL term (weighted by the ratio or not), an entropy bonus, GSPO,
two-sided clipping and CISPO's cap; and the settings that explain TRL's numbers found necessary (replay without
them diverges at loss.policy).

`_compute_loss` is TRL's method itself, called on a trainer whose attributes are set as GRPOTrainer.__init__ sets
them from a real GRPOConfig; only the model's forward pass is replaced by the log-probs and entropies the test
chose, which is what the loss reads of the model."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from trl import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from tests.replay.conftest import MemorySource
from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.replay.runner import replay

ROWS, WIDTH, GROUP = 8, 6, 4


class _OneProcess:
    """accelerate's Accelerator as one process sees itself: gathers and reductions are the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _trainer(args: GRPOConfig, forward: tuple[torch.Tensor, torch.Tensor]) -> GRPOTrainer:
    """A GRPOTrainer whose loss settings are those GRPOTrainer.__init__ takes from `args`, and whose model returns
    `forward` (per-token log-probs, entropies)."""
    trainer = object.__new__(GRPOTrainer)
    attrs: dict[str, Any] = {
        "args": args,
        "model": torch.nn.Linear(1, 1),
        "accelerator": _OneProcess(),
        "loss_type": args.loss_type,
        "beta": args.beta,
        "epsilon_low": args.epsilon,
        "epsilon_high": args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        "importance_sampling_level": args.importance_sampling_level,
        "top_entropy_quantile": args.top_entropy_quantile,
        "off_policy_mask_threshold": args.off_policy_mask_threshold,
        "use_vllm": args.use_vllm,
        "vllm_importance_sampling_correction": args.vllm_importance_sampling_correction,
        "max_completion_length": args.max_completion_length,
        "entropy_coef": args.entropy_coef,
        "use_adaptive_entropy": args.use_adaptive_entropy,
        "_entropy_bonus_enabled": args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        "_last_world_entropy": float("inf"),
        "_entropy_window_stats": None,
        "aux_loss_enabled": False,
        "current_gradient_accumulation_steps": args.gradient_accumulation_steps,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "_get_per_token_logps_and_entropies": lambda *a, **k: (forward[0], forward[1], None),
    }
    for name, value in attrs.items():
        object.__setattr__(trainer, name, value)
    trainer.model.train()
    return trainer


def _tensors(seed: int, empty_row: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, WIDTH + 1, (ROWS,), generator=g)
    if empty_row:
        lengths[3] = 0
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(ROWS, WIDTH, generator=g) * 3.0
    cur = old + torch.randn(ROWS, WIDTH, generator=g) * 0.4
    return {
        "mask": mask,
        "old": old,
        "cur": cur,
        "ref": old + torch.randn(ROWS, WIDTH, generator=g) * 0.3,
        "entropy": torch.rand(ROWS, WIDTH, generator=g) * 2.0,
        "advantages": torch.randn(ROWS, generator=g),
    }


def _trl_step(options: dict[str, Any], t: dict[str, torch.Tensor], tmp_path) -> dict[str, float]:
    """TRL's loss of one micro-batch (one process, no accumulation) and the metrics it logs."""
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=ROWS,
        num_generations=GROUP,
        max_completion_length=WIDTH,
        report_to=[],
        use_cpu=True,
        **options,
    )
    trainer = _trainer(args, (t["cur"], t["entropy"]))
    inputs = {
        "prompt_ids": torch.zeros(ROWS, 1, dtype=torch.int64),
        "prompt_mask": torch.ones(ROWS, 1, dtype=torch.int64),
        "completion_ids": torch.zeros(ROWS, WIDTH, dtype=torch.int64),
        "completion_mask": t["mask"],
        "advantages": t["advantages"],
        "old_per_token_logps": t["old"],
        "ref_per_token_logps": t["ref"],
        "num_items_in_batch": t["mask"].sum(),
    }
    loss = float(GRPOTrainer._compute_loss(trainer, trainer.model, inputs))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    clipfrac = metrics.get("clip_ratio/region_mean", metrics.get("cispo_clip_ratio"))
    return {"loss": loss, "pg_clipfrac": clipfrac, "entropy_loss": metrics["entropy"]}


def _denominators(options: dict[str, Any], t: dict[str, torch.Tensor]) -> dict[str, float]:
    """The denominators of TRL's loss types for one micro-batch of one process: grpo's rows (empty ones included),
    dr_grpo's rows x max_completion_length, dapo's and cispo's tokens of the accumulated batch."""
    loss_type = options.get("loss_type", "dapo")
    if loss_type == "grpo":
        return {"loss_denominator": float(ROWS)}
    if loss_type == "dr_grpo":
        return {"loss_scale_factor": float(ROWS * WIDTH)}
    if loss_type in ("dapo", "cispo"):
        return {"loss_denominator": float(t["mask"].sum())}
    return {}


def _bundle(config: RecomputeConfig, t: dict[str, torch.Tensor], expected: dict[str, float]) -> MemorySource:
    """A step-level bundle of the micro-batch: every row padded to the width, the padding masked out."""
    records = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=i // GROUP,
            response_length=WIDTH,
            total_length=WIDTH + 1,
            loss_mask=t["mask"][i].tolist(),
            raw_reward=0.0,
            reward=0.0,
            micro_batch_id="mb-0",
        )
        for i in range(ROWS)
    ]
    index = BundleIndex(
        bundle_id="step-0-0",
        identity=Identity(actor_step_id=ActorStepId(rollout_id=0, step_id=0)),
        samples=records,
        config=config,
    )
    stages = (StageId.SAMPLE, StageId.LOSS_POLICY)
    manifest = Manifest(bundle_id="step-0-0", stage_contracts={s: StageContract(stage=s) for s in stages})
    payloads = {
        "old_log_probs": t["old"].reshape(-1),
        "log_probs": t["cur"].reshape(-1),
        "ref_log_probs": t["ref"].reshape(-1),
        "entropy": t["entropy"].reshape(-1),
        "advantages": t["advantages"][:, None].expand(ROWS, WIDTH).reshape(-1).contiguous(),
    }
    return MemorySource(manifest, index, {"loss.policy": expected}, payloads)


CASES = [
    {},
    {"beta": 0.04},
    {"beta": 0.04, "use_bias_correction_kl": False},
    {"loss_type": "bnpo", "beta": 0.04},
    {"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01},
    {"loss_type": "dr_grpo", "entropy_coef": 0.01},
    {"loss_type": "cispo", "epsilon_high": 1.1, "beta": 0.04},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},
    {"epsilon": 0.1, "delta": 1.3},
    {"epsilon": 0.1, "entropy_coef": 0.02},
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_replay_reproduces_trls_loss(options, tmp_path):
    t = _tensors(seed=len(options), empty_row=options.get("loss_type") in ("grpo", "dr_grpo"))
    expected = _trl_step(options, t, tmp_path)
    config = RecomputeConfig.from_profile("trl", **options, **_denominators(options, t))
    report = replay([_bundle(config, t, expected)])
    assert report.passed, report.render_text()


@pytest.mark.parametrize(
    "options, wrong",
    [
        ({"beta": 0.04}, {"kl_loss_ratio_weighted": False}),
        ({"loss_type": "cispo", "epsilon_high": 1.1}, {"cispo_clip": "window"}),
        ({"loss_type": "grpo", "entropy_coef": 0.05}, {"entropy_agg": "loss_agg_mode"}),
        ({"loss_type": "grpo"}, {"loss_denominator": None}),
    ],
)
def test_without_the_setting_that_explains_trls_loss_replay_diverges_at_loss_policy(options, wrong, tmp_path):
    t = _tensors(seed=11, empty_row=True)
    expected = _trl_step(options, t, tmp_path)
    right = RecomputeConfig.from_profile("trl", **options, **_denominators(options, t))
    assert replay([_bundle(right, t, expected)]).passed
    config = RecomputeConfig.model_validate({**right.model_dump(), **wrong})
    report = replay([_bundle(config, t, expected)])
    assert not report.passed
    assert report.first_divergent_stage == "loss.policy"
