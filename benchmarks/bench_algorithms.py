"""Algorithm benchmarks: the cost of replaying a GAE + value-loss bundle against today's GRPO path."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import REPO_ROOT, Context, Row, byte_compile, fmt_bytes, fmt_secs, median, run_cli_net
from benchmarks.data import BigCase, big_case

GROUP = "algorithms"
TITLE = "algorithms: gae + value loss against grpo"
HOW = """\
Two 2,048 x 2,048 bundles on local disk, the same samples, masks and log-probs: the GRPO bundle of the
replay benchmarks (six stages) and a GAE one (`advantage_estimator=gae`, `kl_in_reward` with kl_coef
0.01, gamma 1, lam 0.95) that also contracts `loss.value` and so holds three more float32 payloads
(`values`, `vpreds`, `returns`). The GAE bundle's expected values come from one run of replay's own
kernels (this measures speed, not correctness); both replays pass. Each replay (`replay PATH --json`) runs in
a fresh process that first imports `torch` and `trajectory_replay.cli`, then times the command's `main()` itself:
its time net of the interpreter and those imports (as the replay and scale benchmarks do), interleaved with a
process doing the imports alone. **time**: GAE time over GRPO time, one ratio per round of the three processes,
the median of seven rounds. **memory**: peak RSS (`VmHWM`) of the GAE replay minus that of the process doing only
the imports, against the GAE bundle's payload bytes."""

GAE_CONFIG = dict(advantage_estimator="gae", kl_in_reward=True, gamma=1.0, lam=0.95, cliprange_value=0.2)


def gae_case(base: BigCase, seed: int = 1) -> BigCase:
    """`base` recorded by a PPO trainer with a critic: gae advantages and returns, value predictions, and the
    expected values replay's own kernels compute from them."""
    from trajectory_replay.bundle.schema import StageContract, StageId
    from trajectory_replay.replay import estimators, losses
    from trajectory_replay.replay.registry import resolve_kernels

    g = torch.Generator().manual_seed(seed)
    index, payloads, mask = base.index, dict(base.payloads), base.loss_masks
    config = index.config.model_copy(update=GAE_CONFIG)
    lengths = torch.tensor([r.response_length for r in index.samples])
    raw = torch.tensor([r.raw_reward for r in index.samples], dtype=torch.float32)
    values = 0.5 * torch.randn(mask.numel(), generator=g)
    vpreds = values + 0.05 * torch.randn(mask.numel(), generator=g)
    gae = estimators.gae_advantages(
        estimators.AdvantageInputs(raw, lengths, mask, config, kl=payloads["kl"], values=values)
    )
    payloads.update(advantages=gae.advantages, returns=gae.returns, values=values, vpreds=vpreds)
    kernels = resolve_kernels(config)
    expected = {
        **base.expected,
        "reward.post_process": {"rewards": raw.tolist()},
        "loss.policy": losses.policy_loss_outputs(
            losses.PolicyLossData(
                payloads["log_probs"], payloads["old_log_probs"], gae.advantages, payloads["entropy"], mask, lengths
            ),
            config,
            kernels,
        ),
        "loss.value": losses.value_loss_outputs(
            losses.ValueLossData(values, vpreds, gae.returns, mask, lengths), config, kernels
        ),
    }
    records = [r.model_copy(update={"reward": r.raw_reward}) for r in index.samples]
    contracts = {**base.manifest.stage_contracts, StageId.LOSS_VALUE: StageContract(stage=StageId.LOSS_VALUE)}
    policy = base.manifest.comparison_policy
    tolerances = {**policy.tolerances, "loss.value": policy.tolerances["loss.policy"]}
    manifest = base.manifest.model_copy(
        update={
            "bundle_id": "gae",
            "stage_contracts": contracts,
            "comparison_policy": policy.model_copy(update={"tolerances": tolerances}),
        }
    )
    return BigCase(
        manifest,
        index.model_copy(update={"bundle_id": "gae", "samples": records, "config": config}),
        expected,
        payloads,
        mask,
    )


def payload_bytes(case: BigCase) -> int:
    """The bytes of every payload of `case`, the loss mask included."""
    return sum(t.numel() * t.element_size() for t in case.payloads.values()) + case.loss_masks.numel()


def write(case: BigCase, path: Path) -> str:
    """`case` as a bundle at `path`; the path."""
    from trajectory_replay.bundle import BundleWriter

    writer = BundleWriter(path, case.manifest, case.index, case.expected)
    for name, tensor in case.payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    return str(path)


def run(ctx: Context) -> list[Row]:
    n = ctx.size(2048, 256)
    grpo = big_case(n, 2048)
    gae = gae_case(grpo)
    local = ctx.path("algorithms")
    paths = {"grpo": write(grpo, local / "grpo"), "gae": write(gae, local / "gae")}
    gae_bytes = payload_bytes(gae)
    del grpo, gae
    byte_compile(REPO_ROOT)
    commands = {"import": []} | {name: ["replay", p, "--json"] for name, p in paths.items()}
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
    for _ in range(ctx.reps(7)):
        for name, args in commands.items():  # interleaved, so load changes hit all alike
            samples[name].append(run_cli_net("torch", args))
    net = {name: median([t for t, _ in samples[name]]) for name in paths}
    # one ratio per round, then their median: a slow moment of the machine lands on both replays of a round
    # instead of on one side of the comparison
    rounds = [gae[0] / grpo[0] for grpo, gae in zip(samples["grpo"], samples["gae"])]
    ratio = median(rounds)
    rows = [
        Row(
            GROUP,
            f"gae+value recompute time vs grpo, {n}x2048 local, net of the imports",
            f"{ratio:.2f}x",
            "<= 2x",
            ratio <= 2.0,
            f"median of {len(rounds)} per-round ratios ({min(rounds):.2f}x-{max(rounds):.2f}x); medians: "
            f"gae+value {fmt_secs(net['gae'])}, grpo {fmt_secs(net['grpo'])}, each its main() in a fresh "
            "process",
        )
    ]
    extra = median([r for _, r in samples["gae"]]) - median([r for _, r in samples["import"]])
    mem_ratio = extra / gae_bytes
    rows.append(
        Row(
            GROUP,
            "gae+value peak memory above bare import",
            f"{mem_ratio:.2f}x payload bytes",
            "<= 2x",
            mem_ratio <= 2.0,
            f"{fmt_bytes(extra)} above import, payloads {fmt_bytes(gae_bytes)}",
        )
    )
    return rows
