"""Scale benchmarks: a bundle larger than memory should allow, streamed; and full replay against the replay of an
earlier release of this project."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from benchmarks.common import REPO_ROOT, Context, Row, byte_compile, fmt_bytes, fmt_secs, median, run_cli_net

GROUP = "scale"
TITLE = "scale: streamed replay of a large bundle; full replay against an earlier release"
BASELINE = "6c24546"
"""The release the issue measured "today's" replay time on (its replay, run side by side from a git worktree)."""
HOW = f"""\
**streamed**: a 16,384-sample x 4,096-token GRPO bundle (67M tokens: six float32 per-token payloads and the uint8
mask, 1.68 GB) on local disk, prompt groups of 8 adjacent samples. `replay PATH --json` streams it in blocks of
whole groups (the cohort is over the 32M-token threshold); `validate PATH` reads and verifies every payload. Each
command runs in a fresh process that first imports what it cannot do without (`torch` and `trajectory_replay.cli`
for replay, `trajectory_replay.cli` for validate), then times the command's `main()` itself: the time net of the
interpreter and the imports, measured where it happens instead of as the difference of two processes' wall times
(an import of torch alone varies by more than a second from one process to the next on a loaded machine). Medians
of five rounds, the two commands interleaved. Memory is the peak RSS (`VmHWM`) of the replay process minus that of
a process that only does its imports, against the payload bytes. The same bundle with each prompt group's 8
samples 2,048 rows apart (as an asynchronous trainer consumes them; a block's rows then lie in 8 runs of each
payload) is replayed in the same rounds, for reference. **full replay**: an 8,192 x 1,024 bundle of the
same kind, replayed the same way by this tree and by release `{BASELINE}` (checked out in a git worktree, run with
the same interpreter and libraries), fresh processes interleaved, medians of seven rounds. Both trees are byte-compiled
first, as an installed package is. Every process starts in an empty directory with its tree first on `PYTHONPATH` and
reports the file it imported the CLI from, which must lie in that tree (`python -c` puts its working directory first
on the import path: started in a source tree, it would run that tree's package whatever `PYTHONPATH` says)."""

GROUP_SIZE = 8


def write_case(path: Path, n: int, tokens: int, seed: int = 0, scattered: bool = False) -> int:
    """A self-consistent GRPO bundle of `n` x `tokens` at `path` (groups of 8 adjacent samples, or with `scattered`
    each group's samples n / 8 apart, as an asynchronous trainer consumes them; a masked padding tail); its
    expected loss from replay's own kernels (this measures speed, not correctness). Returns its payload bytes."""
    from trajectory_replay.bundle import BundleWriter
    from trajectory_replay.bundle.schema import (
        ActorStepId,
        BundleIndex,
        ComparisonPolicy,
        Identity,
        Manifest,
        ProducerInfo,
        RecomputeConfig,
        SampleRecord,
        StageContract,
        StageId,
    )
    from trajectory_replay.replay import losses
    from trajectory_replay.replay.registry import resolve_kernels

    g = torch.Generator().manual_seed(seed)
    groups = torch.arange(n) % (n // GROUP_SIZE) if scattered else torch.arange(n) // GROUP_SIZE
    raw = torch.rand(n, generator=g) * 10
    means = torch.zeros(n // GROUP_SIZE).index_add_(0, groups, raw) / GROUP_SIZE
    rewards = raw - means[groups]
    mask = torch.ones(n, tokens, dtype=torch.uint8)
    mask[:, tokens - tokens // 8 :] = 0
    mask = mask.reshape(-1)
    total = n * tokens
    old = torch.rand(total, generator=g).neg_()
    payloads = {
        "old_log_probs": old,
        "ref_log_probs": old + 0.01 * torch.randn(total, generator=g),
        "log_probs": old + 0.05 * torch.randn(total, generator=g),
        "entropy": torch.rand(total, generator=g),
    }
    payloads["kl"] = payloads["old_log_probs"] - payloads["ref_log_probs"]
    payloads["advantages"] = rewards.repeat_interleave(tokens)
    config = RecomputeConfig(
        n_samples_per_prompt=GROUP_SIZE,
        kl_loss_type="k1",
        kl_coef=0.01,
        eps_clip=0.2,
        eps_clip_high=0.28,
        entropy_coef=0.001,
    )
    lengths = torch.full((n,), tokens)
    loss = losses.policy_loss_outputs(
        losses.PolicyLossData(payloads["log_probs"], old, payloads["advantages"], payloads["entropy"], mask, lengths),
        config,
        resolve_kernels(config),
    )
    expected = {
        "reward.raw": {"raw_rewards": raw.tolist()},
        "reward.post_process": {"rewards": rewards.tolist()},
        "loss.policy": loss,
    }
    row = mask[:tokens].tolist()  # every sample's mask is the same: the writer moves it into the loss_mask payload
    records = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=int(groups[i]),
            response_length=tokens,
            total_length=tokens + 16,
            loss_mask=row,
            raw_reward=float(raw[i]),
            reward=float(rewards[i]),
        )
        for i in range(n)
    ]
    stages = (
        StageId.SAMPLE,
        StageId.REWARD_RAW,
        StageId.REWARD_POST_PROCESS,
        StageId.ADVANTAGE_KL,
        StageId.ADVANTAGE_ESTIMATE,
        StageId.LOSS_POLICY,
    )
    name = f"scale-{n}x{tokens}"
    index = BundleIndex(
        bundle_id=name,
        identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
        samples=records,
        config=config,
    )
    manifest = Manifest(
        bundle_id=name,
        producer=ProducerInfo(commit="bench"),
        stage_contracts={s: StageContract(stage=s) for s in stages},
        comparison_policy=ComparisonPolicy(tolerances={"loss.policy": {"atol": 1e-3, "rtol": 1e-4}}),
    )
    writer = BundleWriter(path, manifest, index, expected)
    for key, tensor in payloads.items():
        writer.write_payload(key, tensor)
    writer.finalize()
    return sum(t.numel() * t.element_size() for t in payloads.values()) + mask.numel()


def _baseline(ctx: Context) -> str:
    """A git worktree of release BASELINE (made once, byte-compiled); its root, which goes first on PYTHONPATH."""
    where = ctx.path("baseline-tree")
    if not (where / "trajectory_replay").exists():
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "--force", str(where), BASELINE],
            check=True,
            capture_output=True,
        )
    byte_compile(where)
    return str(where)


def run(ctx: Context) -> list[Row]:
    byte_compile(REPO_ROOT)
    rows = [*_streamed_rows(ctx), _baseline_row(ctx)]
    return [r for r in rows if r is not None]


def _streamed_rows(ctx: Context) -> list[Row]:
    n, tokens = ctx.size(16384, 2048), ctx.size(4096, 1024)
    path = ctx.path("scale") / "big"
    payload = write_case(path, n, tokens)
    scattered = ctx.path("scale") / "scattered"
    write_case(scattered, n, tokens, scattered=True)
    commands = {
        "import": ("torch", []),
        "replay": ("torch", ["replay", str(path), "--json"]),
        "validate": ("cli", ["validate", str(path)]),
        "scattered": ("torch", ["replay", str(scattered), "--json"]),
    }
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
    for _ in range(ctx.reps(5)):
        for name, (imports, args) in commands.items():
            samples[name].append(run_cli_net(imports, args))
    net = {name: median([t for t, _ in got]) for name, got in samples.items()}
    replay_net, validate_net = net["replay"], net["validate"]
    peak = {name: median([r for _, r in got]) for name, got in samples.items()}
    extra = peak["replay"] - peak["import"]
    ratio, mem = replay_net / validate_net, extra / payload
    rows = [
        Row(
            GROUP,
            f"streamed replay of {n}x{tokens} ({fmt_bytes(payload)} of payloads), local",
            f"{ratio:.2f}x validate, {mem:.0%} memory",
            "<= 1.2x, <= 25%",
            ratio <= 1.2 and mem <= 0.25,
            f"replay {fmt_secs(replay_net)}, validate {fmt_secs(validate_net)} net; peak {fmt_bytes(extra)} above "
            "import",
        )
    ]
    spread = (peak["scattered"] - peak["import"]) / payload
    rows.append(
        Row(
            GROUP,
            f"the same, each group's 8 samples {n // GROUP_SIZE} rows apart",
            f"{net['scattered'] / validate_net:.2f}x validate, {spread:.0%} memory",
            "-",
            None,
            f"replay {fmt_secs(net['scattered'])} net: a block's rows lie in 8 runs of each payload",
        )
    )
    return rows


def _baseline_row(ctx: Context) -> Row:
    n, tokens = ctx.size(8192, 1024), 1024
    path = ctx.path("scale") / "full"
    write_case(path, n, tokens, seed=1)
    base = _baseline(ctx)
    commands = {"replay": None, "base-replay": base}
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(ctx.reps(7)):
        for name, pythonpath in commands.items():
            samples[name].append(run_cli_net("torch", ["replay", str(path), "--json"], pythonpath)[0])
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", base], check=False, capture_output=True
    )
    now, before = median(samples["replay"]), median(samples["base-replay"])
    ratio = now / before
    return Row(
        GROUP,
        f"full replay of {n}x{tokens}, net of import, against release {BASELINE}",
        f"{ratio:.2f}x",
        "<= 0.67x",
        ratio <= 0.67,
        f"this tree {fmt_secs(now)}, {BASELINE} {fmt_secs(before)}",
    )
