"""Training-inference mismatch: the rollout.mismatch metrics and the corrections the policy loss applies.

d = old_log_probs - rollout_log_probs per token, the log of the trainer's probability over the inference
engine's. Metrics are over the tokens with mask 1 before rejection (the `pre_rejection_mask` payload where a
bundle holds it, else the loss mask): kl_k1 = mean(-d), kl_k3 = mean(exp(d) - 1 - d),
log_ratio_max_abs = max |d|, seq_log_ratio_max_abs = max over samples of |sum_t m d|. Where production recorded any
of verl's rollout-correction metrics (`OFF_POLICY_FIELDS`: log-perplexities and their differences, chi2, importance
weight mean/max/min, the rejected fraction), they are recomputed over the same mask as verl defines them
(`off_policy_sums`, `off_policy_metrics`).

Corrections (`rollout_is`, `rollout_rs`): the log ratio, per token or summed per sample over its masked
tokens, is clamped to [-20, 20] before exp. Importance weights are min(ratio, rollout_is_threshold), on every
token of the sample for `sequence`; with rollout_is_threshold_lower set, a weight whose ratio lies outside
[rollout_is_threshold_lower, rollout_is_threshold] is 0 instead and the others are not truncated (IcePop).
Rejection keeps a token (a sample, for `sequence`) whose ratio lies in [rollout_rs_lower, rollout_rs_upper] (both
inclusive, on the clamped ratio) and sets the loss mask of the others to 0; or it chains the divergence criteria
rollout_rs lists (`DIVERGENCE_CRITERIA`), each with its own bounds, and keeps a token that passes all of them.
Weights and rejection are taken over the loss mask before rejection (the `pre_rejection_mask` payload where a bundle
holds it), as verl's `compute_rollout_correction_and_add_to_batch` takes them; the weights production records are the
weights times that mask. Weights are constants of the loss (no gradient flows in them); they scale the per-token
policy loss only, not the clip fraction or ppo_kl, and every term of loss.policy is aggregated over the mask after
rejection.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy
import torch

from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.replay.kernels import masked_sample_sums, sample_blocks

LOG_RATIO_CLAMP = 20.0
"""Log ratios are clamped to +-20 before exp (a correction's weight stays finite), as verl does."""

WORST_TOKENS = 10
"""Tokens the report lists by |d|, pass or fail."""

CORRECTION_MODES = ("none", "token", "sequence")


def log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor) -> torch.Tensor:
    """d = old - rollout, in float32."""
    return old_log_probs.to(torch.float32) - rollout_log_probs.to(torch.float32)


@dataclass(frozen=True)
class MismatchMetrics:
    """The rollout.mismatch metrics (None where the cohort has nothing to measure)."""

    kl_k1: float | None
    kl_k3: float | None
    log_ratio_max_abs: float | None
    seq_log_ratio_max_abs: float | None

    def as_dict(self) -> dict[str, float | None]:
        return {
            "kl_k1": self.kl_k1,
            "kl_k3": self.kl_k3,
            "log_ratio_max_abs": self.log_ratio_max_abs,
            "seq_log_ratio_max_abs": self.seq_log_ratio_max_abs,
        }


def token_scores(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|d| on the masked-in tokens and -1 elsewhere (float32; a NaN stays NaN): what the maxima and the worst
    tokens are taken over."""
    inside = mask if mask.dtype == torch.bool else mask.to(torch.bool)
    scores = d.to(torch.float32).abs()
    return scores.masked_fill_(~inside, -1.0)


@dataclass(frozen=True)
class MismatchSums:
    """What the metrics are made of, per sample: the sum of d over its masked-in tokens (`seq`) and of
    exp(d) - 1 - d (`k3`), float32; with the count of masked-in tokens and the largest token score. Samples summed
    apart are put together by position, so the metrics do not depend on how the cohort was split."""

    seq: torch.Tensor
    k3: torch.Tensor
    tokens: int
    max_score: float

    @staticmethod
    def combine(parts: list[tuple[torch.Tensor, MismatchSums]], n: int) -> MismatchSums:
        """The sums of `n` samples from parts, each (the samples' positions, its sums)."""
        seq, k3 = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
        for at, part in parts:
            seq[at], k3[at] = part.seq, part.k3
        scores = [p.max_score for _, p in parts]
        top = math.nan if any(math.isnan(v) for v in scores) else max(scores, default=-1.0)
        return MismatchSums(seq, k3, sum(p.tokens for _, p in parts), top)


def mismatch_sums(d: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> MismatchSums:
    """The per-sample sums of the log ratios `d` over the masked-in tokens (a masked-out token counts as d = 0
    whatever it holds, NaN included), by one selection over the whole cohort: what `mismatch_pass` computes in
    chunks."""
    inside = mask if mask.dtype == torch.bool else mask.to(torch.bool)
    scores = token_scores(d, inside)
    seq, k3 = _sample_sums(torch.where(inside, d.to(torch.float32), 0.0), lengths)
    # torch's max keeps a NaN
    return MismatchSums(seq, k3, int(torch.count_nonzero(inside)), float(scores.max()) if scores.numel() else -1.0)


CHUNK_TOKENS = 1 << 18
"""The pass goes over chunks of whole samples of about this many tokens (1 MiB of float32), in two buffers it
reuses, which stay in the CPU's cache; a temporary of the cohort's size is slower to write and read back and,
where large buffers are mapped afresh for each allocation (the command line), faulted in page by page as well.
On 4M tokens under the command line's allocator settings the pass takes half the time of a whole-cohort one."""

WINDOW = 1024
"""Tokens per window whose largest score the pass keeps: the worst tokens are searched in the best windows only."""

MAX_THREADS = 2
"""Threads the pass runs its chunks on, at most (and never more than torch's own thread count)."""


@dataclass(frozen=True)
class MismatchPass:
    """What rollout.mismatch takes from the tokens in one pass (`mismatch_pass`)."""

    sums: MismatchSums
    worst: torch.Tensor
    """Flat positions of the (up to) WORST_TOKENS masked-in tokens with the largest |d|, largest first (NaN first,
    ties in flat order); tokens whose d is 0 are no one's worst."""
    over: int
    """Masked-in tokens whose |d| exceeds the ceiling, or is NaN (0 without a ceiling)."""
    nonfinite: tuple[int, int] | None
    """(flat position of the first masked-in token whose d is NaN or infinite, how many are), or None."""


def mismatch_pass(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    ceiling: float | None = None,
    k: int = WORST_TOKENS,
    chunk_tokens: int = CHUNK_TOKENS,
) -> MismatchPass:
    """The per-sample sums, worst tokens, tokens over `ceiling` and first non-finite token of the log ratios
    d = old - rollout over the masked-in tokens, in one pass over chunks of whole samples; nothing of the cohort's
    size is allocated. Every result reads d on the masked-in tokens only: a masked-out token counts as d = 0
    whatever it holds, NaN included.

    Where a chunk's d is finite the mask is applied by multiplying with it, in place (selecting with a bool mask
    costs several times more). A non-finite d in a chunk (a sample's sum then is not finite) takes the chunk again
    by selection, so that a masked-out NaN or infinity still counts as 0; the sums of every finite sample are the
    same either way, and each sample is summed over its own tokens alone (`_sample_sums`), so they do not depend on
    how the cohort is split into chunks or blocks."""
    n = int(lengths.numel())
    seq, k3 = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
    weights = mask if mask.dtype in (torch.float32, torch.uint8, torch.bool) else mask.to(torch.float32)
    chunks = [c for c in sample_blocks(lengths, chunk_tokens) if c[3] > c[2]]
    buffers = threading.local()

    def one(chunk: tuple[int, int, int, int]) -> _Chunk:
        return _chunk(old_log_probs, rollout_log_probs, weights, lengths, chunk, ceiling, buffers)

    workers = min(torch.get_num_threads(), len(chunks), MAX_THREADS)
    if workers > 1:  # numpy and torch release the GIL in their loops: the chunks run side by side
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mismatch") as pool:
            done = list(pool.map(one, chunks))
    else:
        done = [one(c) for c in chunks]
    for (first, last, _, _), part in zip(chunks, done):
        seq[first:last], k3[first:last] = part.seq, part.k3
    tokens = sum(p.tokens for p in done)
    top = torch.cat([p.maxima for p in done]) if done else torch.zeros(0, dtype=torch.float32)
    max_score = float(top.max()) if tokens and top.numel() else -1.0  # torch's max keeps a NaN
    firsts = torch.cat([p.starts for p in done]) if done else torch.zeros(0, dtype=torch.int64)
    worst = _worst(old_log_probs, rollout_log_probs, weights, top, firsts, lengths, min(k, tokens))
    bad = [p.bad for p in done if p.bad is not None]
    nonfinite = (bad[0][0], sum(b[1] for b in bad)) if bad else None  # chunks in flat order: the first is first
    return MismatchPass(MismatchSums(seq, k3, tokens, max_score), worst, sum(p.over for p in done), nonfinite)


class _Chunk(NamedTuple):
    """One chunk's part of a `MismatchPass`: its samples' sums, its masked-in tokens, its windows' largest scores
    and first tokens, its tokens over the ceiling, and (first position, count) of its masked-in non-finite d, or
    None."""

    seq: torch.Tensor
    k3: torch.Tensor
    tokens: int
    maxima: torch.Tensor
    starts: torch.Tensor
    over: int
    bad: tuple[int, int] | None


def _chunk(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    weights: torch.Tensor,
    lengths: torch.Tensor,
    chunk: tuple[int, int, int, int],
    ceiling: float | None,
    buffers: threading.local,
) -> _Chunk:
    """`mismatch_pass` over one chunk of whole samples, in the calling thread's two buffers."""
    first, last, start, end = chunk
    size = end - start
    if getattr(buffers, "z", None) is None or buffers.z.numel() < size:
        buffers.z, buffers.scratch = torch.empty(size, dtype=torch.float32), torch.empty(size, dtype=torch.float32)
    z, scratch = buffers.z[:size], buffers.scratch[:size]
    old, rollout, inside = old_log_probs[start:end], rollout_log_probs[start:end], weights[start:end]
    torch.sub(old.to(torch.float32), rollout.to(torch.float32), out=z)  # d, as `log_ratio` computes it
    with numpy.errstate(invalid="ignore"):  # inf * 0 on a masked-out token: caught below
        numpy.multiply(z.numpy(), inside.numpy(), out=z.numpy())
    seq, k3 = _sample_sums(z, lengths[first:last], scratch)
    over, bad = 0, None
    if numpy.isfinite(seq.numpy()).all() and numpy.isfinite(k3.numpy()).all():
        scores = torch.abs(z, out=scratch)  # 0 where masked out: below every masked-in |d| that counts
        if ceiling is not None:
            beyond = scores > ceiling
            over = int(torch.count_nonzero(beyond.logical_and_(inside.to(torch.bool)) if ceiling < 0 else beyond))
    else:
        d, selected = log_ratio(old, rollout), inside.to(torch.bool)
        torch.where(selected, d, torch.zeros((), dtype=torch.float32), out=z)
        seq, k3 = _sample_sums(z, lengths[first:last], scratch)
        scores = token_scores(d, selected)
        found = (~torch.isfinite(d)).logical_and_(selected).nonzero().flatten()
        if found.numel():
            bad = (start + int(found[0]), int(found.numel()))
        if ceiling is not None:
            over = int(torch.count_nonzero(((d.abs() > ceiling) | d.isnan()).logical_and_(selected)))
    whole = size // WINDOW * WINDOW
    maxima = [scores[:whole].view(-1, WINDOW).amax(dim=1)] if whole else []
    if whole < size:
        maxima.append(scores[whole:].max().reshape(1))
    # the last window ends with the chunk
    return _Chunk(
        seq, k3, int(torch.count_nonzero(inside)), torch.cat(maxima), torch.arange(start, end, WINDOW), over, bad
    )


def _worst(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    top: torch.Tensor,
    firsts: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """The worst tokens (see `MismatchPass.worst`), from the windows' largest scores `top` (window w starts at token
    `firsts[w]` and ends where the next one starts, the last at the last sample's end): the k largest lie in the
    windows whose largest score is at least the k-th largest of those (every one tied with it included), so only
    those windows' |d| are taken again."""
    if k == 0 or top.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    nan = torch.isnan(top)
    kth = torch.topk(torch.where(nan, math.inf, top), min(k, top.numel())).values[-1]
    picked = (nan | ((top >= kth) & (top > 0))).nonzero().flatten().tolist()
    if not picked:
        return torch.zeros(0, dtype=torch.int64)
    ends = torch.cat([firsts[1:], lengths.to(torch.int64).sum().reshape(1)])
    chosen = torch.tensor(picked, dtype=torch.int64)
    starts, sizes = firsts[chosen], ends[chosen] - firsts[chosen]
    candidates = torch.repeat_interleave(starts, sizes) + (
        torch.arange(int(sizes.sum())) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
    )
    d = log_ratio(old_log_probs[candidates], rollout_log_probs[candidates])
    scores = token_scores(d, mask[candidates])
    best = torch.topk(scores, min(k, scores.numel()))
    keep = ~(best.values <= 0)  # a NaN is kept
    values, positions = best.values[keep].tolist(), candidates[best.indices[keep]]
    # equal |d| in flat order: the order of ties is not topk's to choose
    order = sorted(range(len(values)), key=lambda i: worst_first(values[i], int(positions[i])))
    return positions[order]


def worst_first(score: float, position: int) -> tuple[bool, float, int]:
    """Sort key of the worst tokens: a NaN |d| first, then the largest |d|, ties in flat order."""
    nan = math.isnan(score)
    return not nan, 0.0 if nan else -score, position


def _sample_sums(
    z: torch.Tensor, lengths: torch.Tensor, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sums of `z` (float32, 0 where masked out) and of exp(z) - 1 - z, in float32, each sample summed
    pairwise over its own tokens (numpy's `add.reduceat`, several times faster than torch's segment reduction
    on a CPU): a sample's sums do not depend on the samples around it. `scratch`: a float32 tensor like `z` to
    compute exp(z) - 1 - z in (its content is left unspecified)."""
    lens = lengths.to(torch.int64).numpy()
    seq, k3 = numpy.zeros(lens.size, dtype=numpy.float32), numpy.zeros(lens.size, dtype=numpy.float32)
    present = lens > 0
    if present.any():
        starts = (numpy.cumsum(lens) - lens)[present]
        values = z.numpy()
        with numpy.errstate(all="ignore"):  # a non-finite or huge d gives a non-finite sum, as torch's would
            seq[present] = numpy.add.reduceat(values, starts)
            excess = numpy.expm1(values, out=None if scratch is None else scratch.numpy())
            excess -= values  # exp(d) - 1 - d, 0 where masked out
            k3[present] = numpy.add.reduceat(excess, starts)
    return torch.from_numpy(seq), torch.from_numpy(k3)


def metrics_of(sums: MismatchSums) -> MismatchMetrics:
    """The metrics of a whole cohort from its per-sample sums (the sample sums added in float64)."""
    if sums.tokens == 0:
        return MismatchMetrics(None, None, None, None)
    k1 = 0.0 - float(sums.seq.sum(dtype=torch.float64)) / sums.tokens  # 0.0 - x: no -0.0 when nothing differs
    k3 = float(sums.k3.sum(dtype=torch.float64)) / sums.tokens
    return MismatchMetrics(k1, k3, sums.max_score, float(sums.seq.abs().max()))


def mismatch_metrics(d: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> MismatchMetrics:
    """The metrics of the log ratios `d` over the masked-in tokens of one whole cohort (see `mismatch_sums`)."""
    return metrics_of(mismatch_sums(d, mask, lengths))


@dataclass(frozen=True)
class OffPolicySums:
    """What verl's off-policy, importance-weight and rejection metrics (`off_policy_metrics`) are made of: per
    sample, the sums of the old and rollout log-probs and of rho^2 = exp(2 clamp(d)) over its masked-in tokens (float64)
    and its count of them; over the tokens, the importance weights' sum, max and min (None without weights) and the
    tokens rejection kept (None without rejection). Samples summed apart are put together by position."""

    old: torch.Tensor
    rollout: torch.Tensor
    rho2: torch.Tensor
    counts: torch.Tensor
    weights: tuple[float, float, float] | None
    kept: int | None

    @staticmethod
    def combine(parts: list[tuple[torch.Tensor, OffPolicySums]], n: int) -> OffPolicySums:
        """The sums of `n` samples from parts, each (the samples' positions, its sums)."""
        old, rollout, rho2, counts = (torch.zeros(n, dtype=torch.float64) for _ in range(4))
        for at, part in parts:
            old[at], rollout[at], rho2[at], counts[at] = part.old, part.rollout, part.rho2, part.counts
        weighted = [p.weights for _, p in parts if p.weights is not None]
        weights = (
            (sum(w[0] for w in weighted), max(w[1] for w in weighted), min(w[2] for w in weighted))
            if weighted and len(weighted) == len(parts)
            else None
        )
        kept = [p.kept for _, p in parts]
        return OffPolicySums(
            old, rollout, rho2, counts, weights, None if any(k is None for k in kept) else sum(k or 0 for k in kept)
        )


def off_policy_sums(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> OffPolicySums:
    """The `OffPolicySums` of whole samples over `mask` (the loss mask before rejection); `weights`: the importance
    weights replay recomputed, `kept`: the loss mask its rejection leaves (each None when there is none)."""
    inside = mask.to(torch.bool)
    lengths = lengths.to(torch.int64)
    m = inside.to(torch.float64)
    d = torch.where(inside, log_ratio(old_log_probs, rollout_log_probs), 0.0)
    rho2 = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).square()
    sums = [
        masked_sample_sums(torch.where(inside, v.to(torch.float32), 0.0), m, lengths)
        for v in (old_log_probs, rollout_log_probs, rho2, torch.ones_like(d))
    ]
    stats = None
    if weights is not None:
        w = weights.to(torch.float64)[inside]
        stats = (float(w.sum()), float(w.max()), float(w.min())) if w.numel() else (0.0, -math.inf, math.inf)
    count = None if kept is None else int(torch.count_nonzero(kept.to(torch.bool) & inside))
    return OffPolicySums(sums[0], sums[1], sums[2], sums[3], stats, count)


def off_policy_metrics(sums: MismatchSums, off: OffPolicySums, config: RecomputeConfig) -> dict[str, float]:
    """verl's `rollout_corr/<name>` metrics of `OFF_POLICY_FIELDS` (as verl 0.9.1's `compute_offpolicy_metrics`,
    `compute_is_metrics` and `compute_rollout_rejection_mask` define them), those the sums hold: per-sample means
    over the masked-in tokens (count + 1e-8 below, a sample without any has mean 0), averaged over the samples;
    token means over all masked-in tokens. Sequence-level importance weights report exp of the largest (capped at
    20) and smallest per-sample log-ratio sum."""
    if sums.tokens == 0:
        return {}
    tokens = float(sums.tokens)
    train = off.old / (off.counts + 1e-8)
    roll = off.rollout / (off.counts + 1e-8)
    diff = roll - train
    seq = sums.seq.to(torch.float64)
    out = {
        "training_ppl": float(torch.exp(-train).mean()),
        "training_log_ppl": float((-train).mean()),
        "rollout_ppl": float(torch.exp(-roll).mean()),
        "rollout_log_ppl": float((-roll).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(off.rho2.sum()) / tokens - 1.0,
        "chi2_seq": float(torch.exp(2.0 * seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).mean()) - 1.0,
    }
    if off.weights is not None:
        total, top, bottom = off.weights
        out["rollout_is_mean"] = total / tokens
        if config.rollout_is == "sequence":
            out["rollout_is_max"] = math.exp(min(float(seq.max()), LOG_RATIO_CLAMP))
            out["rollout_is_min"] = math.exp(float(seq.min()))
        else:
            out["rollout_is_max"], out["rollout_is_min"] = top, bottom
    if off.kept is not None and config.rollout_rs != "none":
        out["rollout_rs_masked_fraction"] = 1.0 - off.kept / tokens
    return out


def rs_bounds(config: RecomputeConfig) -> tuple[float, float]:
    """(lower, upper) ratio bounds rejection keeps: upper defaults to rollout_is_threshold, lower to 1/upper."""
    upper = config.rollout_rs_upper if config.rollout_rs_upper is not None else config.rollout_is_threshold
    lower = config.rollout_rs_lower if config.rollout_rs_lower is not None else 1.0 / upper
    return lower, upper


DIVERGENCE_CRITERIA: dict[str, tuple[str, str]] = {
    f"{level}_{k}": (level, k)
    for level in ("token", "seq_sum", "seq_mean", "seq_max")
    for k in ("k1", "k2", "k3")
    if (level, k) != ("seq_max", "k1")
}
"""The divergence criteria rejection may chain (`rollout_rs`), by name: (where the statistic is taken, which
estimator). Per token x = d clamped to [-20, 20]; k1 is x itself, k2 = x^2 / 2, k3 = exp(x) - 1 - x. `token` takes
each token's own value, `seq_sum` / `seq_mean` / `seq_max` the sum / mean / max over its sample's masked-in tokens
(a sample with none: 0), and a sample's verdict holds for each of its tokens. A k1 criterion keeps a value whose exp
lies within [lower, upper] (the ratio trainer / engine), k2 and k3 one at most upper."""


def rejection_criteria(config: RecomputeConfig) -> tuple[str, ...]:
    """The divergence criteria config.rollout_rs chains, in order, each once; () for none, token and sequence."""
    if config.rollout_rs in CORRECTION_MODES:
        return ()
    return tuple(dict.fromkeys(part.strip() for part in config.rollout_rs.split(",") if part.strip()))


def criterion_bounds(config: RecomputeConfig, name: str) -> tuple[float | None, float | None]:
    """(lower, upper) of divergence criterion `name`: its entry of rollout_rs_bounds, else rollout_rs_lower and
    rollout_rs_upper; a k1 criterion's lower defaults to 1 / upper."""
    bounds = config.rollout_rs_bounds.get(name)
    lower, upper = (
        (bounds.lower, bounds.upper) if bounds is not None else (config.rollout_rs_lower, config.rollout_rs_upper)
    )
    if name.endswith("k1") and lower is None and upper is not None:
        lower = 1.0 / upper
    return lower, upper


def _divergence_keep(
    d: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, config: RecomputeConfig
) -> torch.Tensor:
    """Per token: whether it passes every divergence criterion of config.rollout_rs, each taken over `mask`."""
    inside = mask.to(torch.bool)
    x = d.to(torch.float32).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    stats = {"k1": x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1.0 - x}
    keep = torch.ones(d.shape, dtype=torch.bool)
    counts: torch.Tensor | None = None
    for name in rejection_criteria(config):
        level, k = DIVERGENCE_CRITERIA[name]
        lower, upper = criterion_bounds(config, name)
        assert upper is not None  # the plan refuses a criterion without one
        stat = stats[k]
        if level == "token":
            value = stat
        elif level == "seq_max":
            top = torch.segment_reduce(stat.masked_fill(~inside, -math.inf), "max", lengths=lengths)
            value = torch.repeat_interleave(torch.where(top == -math.inf, 0.0, top), lengths)
        else:
            sums = torch.segment_reduce(torch.where(inside, stat.to(torch.float64), 0.0), "sum", lengths=lengths)
            if level == "seq_mean":
                if counts is None:
                    counts = torch.segment_reduce(inside.to(torch.float64), "sum", lengths=lengths)
                sums = sums / (counts + 1e-8)
            value = torch.repeat_interleave(sums, lengths)
        if k == "k1":
            assert lower is not None
            keep &= (value >= math.log(lower)) & (value <= math.log(upper))
        else:
            keep &= value <= upper
    return keep


@dataclass(frozen=True)
class Correction:
    """What the correction does to the loss: per-token importance weights (None: none) and the loss mask after
    rejection (float32)."""

    weights: torch.Tensor | None
    mask: torch.Tensor


def correction(d: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, config: RecomputeConfig) -> Correction:
    """The importance weights and rejection mask `config` asks for, from the log ratios `d` of whole samples and
    their loss mask before rejection."""
    lengths = lengths.to(torch.int64)
    m = mask.to(torch.float32)
    seq_ratio: torch.Tensor | None = None
    if "sequence" in (config.rollout_is, config.rollout_rs):
        seq_log = masked_sample_sums(d, m, lengths).to(torch.float32).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        seq_ratio = torch.repeat_interleave(torch.exp(seq_log), lengths)
    token_ratio: torch.Tensor | None = None
    if "token" in (config.rollout_is, config.rollout_rs):
        token_ratio = torch.exp(d.to(torch.float32).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = None
    if config.rollout_is != "none":
        ratio = token_ratio if config.rollout_is == "token" else seq_ratio
        assert ratio is not None
        if config.rollout_is_threshold_lower is None:
            weights = torch.clamp(ratio, max=config.rollout_is_threshold)
        else:  # IcePop: a weight outside the window is 0, the others are kept as they are
            inside = (ratio >= config.rollout_is_threshold_lower) & (ratio <= config.rollout_is_threshold)
            weights = torch.where(inside, ratio, 0.0)
    if config.rollout_rs in ("token", "sequence"):
        lower, upper = rs_bounds(config)
        ratio = token_ratio if config.rollout_rs == "token" else seq_ratio
        assert ratio is not None
        m = m * ((ratio >= lower) & (ratio <= upper)).to(torch.float32)
    elif config.rollout_rs != "none":
        m = m * _divergence_keep(d, m, lengths, config).to(torch.float32)
    return Correction(weights, m)


def recorded_weights(fix: Correction, mask: torch.Tensor) -> torch.Tensor | None:
    """The weights as production records them: times the loss mask before rejection (as verl does; a rejected
    token's weight never reaches the loss, whose mask is 0 there)."""
    return None if fix.weights is None else fix.weights * mask.to(torch.float32)


def staleness(policy_versions: list[int | None], actor_version: int | None) -> list[int | None]:
    """actor_version - policy_version per sample (None where either is unknown)."""
    return [None if v is None or actor_version is None else actor_version - v for v in policy_versions]


__all__ = [
    "CHUNK_TOKENS",
    "CORRECTION_MODES",
    "Correction",
    "DIVERGENCE_CRITERIA",
    "LOG_RATIO_CLAMP",
    "MismatchMetrics",
    "MismatchPass",
    "MismatchSums",
    "OffPolicySums",
    "WINDOW",
    "WORST_TOKENS",
    "correction",
    "criterion_bounds",
    "log_ratio",
    "metrics_of",
    "mismatch_metrics",
    "mismatch_pass",
    "mismatch_sums",
    "off_policy_metrics",
    "off_policy_sums",
    "recorded_weights",
    "rejection_criteria",
    "rs_bounds",
    "staleness",
    "token_scores",
    "worst_first",
]
