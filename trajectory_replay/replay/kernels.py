"""The shared pieces of replay's algorithm kernels: pure, vectorised torch functions over flat tensors.

Per-token tensors are flat concatenations of the samples' responses; per-sample reductions are
segment reductions over the response lengths (per-group ones `index_add_` over a sample -> group
vector), never a Python loop per token. They run on millions of tokens, so intermediates are updated
in place. The estimators live in `replay.estimators`, the losses and aggregations in `replay.losses`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy
import torch

from trajectory_replay.errors import UnsupportedError

KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")
LOW_VAR_KL_CLAMP = 10.0
"""low_var_kl is clamped to [-10, 10] whatever the config says (the older tool's behaviour)."""
WHITEN_EPS = 1e-8


def dense_group_ids(group_index: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """Each sample's group as a dense id (groups numbered in order of first appearance) and the group keys."""
    keys: dict[int, int] = {}
    ids = [keys.setdefault(g, len(keys)) for g in group_index]
    return torch.tensor(ids, dtype=torch.int64), list(keys)


def segment_sum(
    values: torch.Tensor, segment: torch.Tensor, num_segments: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Sum of `values` per segment id (`segment[i]` is the segment of `values[i]`)."""
    return torch.zeros(num_segments, dtype=dtype).index_add_(0, segment, values.to(dtype))


def kl_estimate(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_type: str,
    log_ratio_clamp: float | None = None,
    output_clamp: float | None = None,
    clamped: Collection[str] | None = None,
) -> torch.Tensor:
    """Per-token KL estimate of a policy against the reference from d = log_probs - ref_log_probs:
    k1 d, k2 d^2/2, k3 = low_var_kl exp(-d) - 1 + d, abs |d|; d clamped to [-c, c] first and the estimate
    to [-c', c'] last when the clamps are set and `clamped` (None: every estimator) lists `kl_type`
    (low_var_kl always to [-10, 10])."""
    check_kl_type(kl_type)
    if clamped is not None and kl_type not in clamped:
        log_ratio_clamp = output_clamp = None
    d = log_probs.to(torch.float32) - ref_log_probs.to(torch.float32)
    if log_ratio_clamp is not None:
        d.clamp_(-log_ratio_clamp, log_ratio_clamp)
    if kl_type == "k1":
        kl = d
    elif kl_type == "k2":
        kl = d.square_().mul_(0.5)
    elif kl_type == "abs":
        kl = d.abs_()
    else:
        # exp(-d) - 1 + d written as production writes it (not expm1) so rounding matches
        kl = torch.exp(-d).sub_(1.0).add_(d)
        if kl_type == "low_var_kl":
            kl.clamp_(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    if output_clamp is not None:
        kl.clamp_(-output_clamp, output_clamp)
    return kl


def check_kl_type(kl_type: str, field: str = "kl_loss_type") -> None:
    """Raise UnsupportedError for a KL estimator replay does not know, naming the config field."""
    if kl_type not in KL_TYPES:
        raise UnsupportedError(f"unsupported {field} {kl_type!r}: replay knows {', '.join(KL_TYPES)}")


def token_counts(mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """T_i = sum_t m_it per sample, in float64."""
    return torch.segment_reduce(mask.to(torch.float64), "sum", lengths=lengths.to(torch.int64))


def masked_sample_sums(values: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sample sums of values * mask, accumulated in float64 so our own rounding stays far below the
    comparison tolerance (callers summing several tensors convert the mask to float64 once)."""
    weighted = values.to(torch.float64).mul_(mask)  # a float64 mask is used as is
    return torch.segment_reduce(weighted, "sum", lengths=lengths.to(torch.int64))


class Workspace:
    """Buffers reused by the blocks of one pass: a fresh block-sized buffer each time would be mapped and faulted in
    anew by the allocator, which costs about as much as the arithmetic done in it."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A (rows, cols) view of the buffer of `dtype` (grown when too small); its content is unspecified."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] < cols:
            buffer = self._buffers[dtype] = torch.empty((rows, cols), dtype=dtype)
        return buffer[:rows, :cols]


_NARROW = (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.int8)
"""Dtypes whose products with a 0/1 float32 mask are exact in float32."""


def stacked_sample_sums(
    rows: Sequence[torch.Tensor],
    mask: torch.Tensor,
    lengths: torch.Tensor,
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    counts: Sequence[int] = (),
) -> torch.Tensor:
    """Per-sample sums of each of `rows` times the mask, and of the mask itself (the last row): a (k + 1, n) float64
    tensor. The products of float32 (or narrower) rows are taken in float32 (a 0/1 mask makes them exact: nothing
    is rounded before the sum), the stack is widened to float64 in one copy and summed in float64; a wider row is
    multiplied in float64. Each sample's sums depend on its own tokens only, so they are the same whatever block
    it is summed in. A bool row is read as 0/1 bytes (torch multiplies bytes by floats several times faster).
    `out`: where to write the sums (see `segment_sums`).

    `counts`: the positions of rows whose values are all 0 or 1 (clip indicators). Such a row times an integer mask
    is an integer, and so is the mask itself: their sums are summed in float32 where every partial sum is an integer
    float32 holds exactly (below 2^24), which gives the float64 sum bit for bit without widening those rows."""
    k, n = len(rows), mask.numel()
    integral = [i for i in counts if rows[i].dtype in _NARROW] if _counts_exact_in_float32(mask, lengths) else None
    # the rows summed in float64 first, then those summed in float32 (the counts and the mask, when exact)
    order = [i for i in range(k) if i not in (integral or ())] + (integral or []) + [k]
    widened = k + 1 if integral is None else k - len(integral)
    if workspace is not None:
        narrow, wide = workspace.take(k + 1, n, dtype=torch.float32), workspace.take(widened, n)
    else:
        narrow, wide = torch.empty((k + 1, n), dtype=torch.float32), torch.empty((widened, n), dtype=torch.float64)
    m = narrow[-1]
    m.copy_(mask)
    for slot, i in enumerate(order[:-1]):
        if rows[i].dtype in _NARROW:
            torch.mul(rows[i].view(torch.uint8) if rows[i].dtype == torch.bool else rows[i], m, out=narrow[slot])
    wide.copy_(narrow[:widened])
    for slot, i in enumerate(order[:widened]):
        if i < k and rows[i].dtype not in _NARROW:  # its float32 slot above was left as it was: multiplied here
            torch.mul(rows[i].to(torch.float64), m, out=wide[slot])
    sums = torch.empty((k + 1, lengths.numel()), dtype=torch.float64)
    segment_sums(wide, lengths, sums[:widened])
    if widened <= k:
        segment_sums(narrow[widened:], lengths, sums[widened:])
    if out is None:
        return sums[torch.argsort(torch.tensor(order))]
    out[torch.tensor(order, dtype=torch.int64)] = sums
    return out


_FLOAT32_INTEGERS = 1 << 24
"""Every integer of magnitude up to 2^24 is a float32; a sum of integers that never leaves that range is exact."""


def _counts_exact_in_float32(mask: torch.Tensor, lengths: torch.Tensor) -> bool:
    """True when a per-sample sum of the mask, or of a 0/1 row times it, cannot leave float32's exact integers: an
    integer mask (bool or uint8) whose largest value times the longest sample stays below 2^24."""
    if lengths.numel() == 0 or mask.numel() == 0:
        return False
    if mask.dtype == torch.bool:
        largest = 1
    elif mask.dtype == torch.uint8:
        largest = int(mask.max())
    else:
        return False
    return largest * int(lengths.max()) < _FLOAT32_INTEGERS


def segment_sums(values: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-segment sums along the last axis of a (k, T) tensor, segments of `lengths` (0 allowed): (k, n) float64,
    written into `out` when given (a float64 (k, n) tensor, a view of a larger one allowed). A float64 tensor is
    summed in float64; a float32 one in float32 (for values whose sums float32 holds exactly: see
    `stacked_sample_sums`).

    numpy's `add.reduceat` sums each segment pairwise, several times faster than torch's segment reduction on a
    CPU and at least as accurate; its segments are given by their starts, so empty ones are left out of the call
    and stay 0."""
    # the bookkeeping runs on numpy arrays: on a block's few dozen lengths each torch call costs more than its work
    lens = lengths.numpy() if lengths.dtype == torch.int64 else lengths.to(torch.int64).numpy()
    if out is None:
        out = torch.zeros((values.shape[0], lens.size), dtype=torch.float64)
    target = out.numpy()
    present = lens > 0
    if values.shape[-1] == 0 or not present.any():
        target[...] = 0.0
        return out
    starts = numpy.cumsum(lens) - lens
    if present.all() and values.dtype == torch.float64:
        numpy.add.reduceat(values.numpy(), starts, axis=-1, out=target)
    elif present.all():  # summed in the values' own dtype, then widened
        target[...] = numpy.add.reduceat(values.numpy(), starts, axis=-1)
    else:
        target[...] = 0.0
        target[:, present] = numpy.add.reduceat(values.numpy(), starts[present], axis=-1)
    return out


def sample_ends(lengths: torch.Tensor) -> torch.Tensor:
    """Where each sample's tokens end in the flat layout (exclusive)."""
    return torch.cumsum(lengths.to(torch.int64), 0)


@dataclass(frozen=True)
class Moments:
    """Per-sample masked moments of a per-token tensor, in float64: the count of masked-in tokens, their sum and
    their sum of squared deviations from the sample's own mean. Whitening statistics over any set of samples
    combine from these exactly (the same numbers whatever blocks the samples were computed in)."""

    count: torch.Tensor
    total: torch.Tensor
    m2: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[Moments]) -> Moments:
        return Moments(*(torch.cat([getattr(p, f) for p in parts]) for f in ("count", "total", "m2")))


def sample_moments(
    values: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, block_tokens: int = 1 << 20
) -> Moments:
    """The `Moments` of each sample of `values` over its masked-in tokens, block by block of whole samples (no
    float64 copy of a cohort-sized tensor)."""
    lengths = lengths.to(torch.int64)
    parts = []
    for first, last, start, end in sample_blocks(lengths, block_tokens):
        block_lengths = lengths[first:last]
        m = mask[start:end].to(torch.float64)
        x = values[start:end].to(torch.float64)
        count = torch.segment_reduce(m, "sum", lengths=block_lengths)
        total = torch.segment_reduce(x * m, "sum", lengths=block_lengths)
        mean = torch.where(count > 0, total / count.clamp(min=1.0), torch.zeros((), dtype=torch.float64))
        deviation = x.sub_(torch.repeat_interleave(mean, block_lengths)).square_().mul_(m)
        parts.append(Moments(count, total, torch.segment_reduce(deviation, "sum", lengths=block_lengths)))
    if not parts:
        empty = torch.zeros(0, dtype=torch.float64)
        return Moments(empty, empty, empty)
    return Moments.cat(parts)


def whitening_stats(moments: Moments) -> tuple[float, float]:
    """(mean, unbiased variance) of every masked-in token of the samples, from their per-sample moments (the
    parallel-variance combination: within-sample deviations plus each sample's mean's deviation). NaN both when
    at most one token is masked in (no variance to divide by)."""
    count = float(moments.count.sum())
    if count <= 1:
        return math.nan, math.nan
    mean = float(moments.total.sum()) / count
    own = torch.where(
        moments.count > 0, moments.total / moments.count.clamp(min=1.0), torch.zeros((), dtype=torch.float64)
    )
    m2 = float(moments.m2.sum()) + float((own - mean).square_().mul_(moments.count).sum())
    return mean, m2 / (count - 1)


def whiten(values: torch.Tensor, mean: float, var: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) on every token, elementwise in float32 as production computes it (NaN
    everywhere when the statistics are NaN)."""
    x = values.to(torch.float32)
    if not (math.isfinite(mean) and math.isfinite(var)):
        return torch.full_like(x, math.nan)
    return (x - mean).mul_(1.0 / math.sqrt(var + WHITEN_EPS))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and variance over the tokens where mask is 1, the variance
    unbiased (times M / (M - 1), M the masked token count); every token is whitened, masked or not.

    The statistics are combined from per-sample moments (`lengths`: the samples; one sample when omitted), so
    whitening a cohort in one piece or block by block gives the same bits."""
    if lengths is None:
        lengths = torch.tensor([values.numel()])
    return whiten(values, *whitening_stats(sample_moments(values, mask, lengths)))


def reverse_scan_order(lengths: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """For a scan from each sample's last token backwards: the samples' last-token positions, longest sample
    first, and how many samples still have a token k places before their end, for k = 0, 1, ...

    At step k the active samples are a prefix of that order, so a scan keeps its running state per sample in
    one tensor and updates a prefix of it: a loop over token positions, never over samples.
    """
    lengths = lengths.to(torch.int64)
    order = torch.argsort(lengths, descending=True, stable=True)
    last = (sample_ends(lengths) - 1)[order]
    longest = int(lengths.max()) if lengths.numel() else 0
    shorter_or_equal = torch.cumsum(torch.bincount(lengths, minlength=longest + 1), 0)
    active = (lengths.numel() - shorter_or_equal[:longest]).tolist()
    return last, active


def sample_blocks(lengths: torch.Tensor, block_tokens: int) -> Iterator[tuple[int, int, int, int]]:
    """(first sample, end sample, first token, end token) of consecutive blocks of whole samples of about
    `block_tokens` tokens each, so that per-token temporaries stay a small fraction of the inputs."""
    first, start = 0, 0
    ends = sample_ends(lengths).tolist()  # non-decreasing: a block ends at the first sample that fills it
    while first < len(ends):
        last = min(bisect.bisect_left(ends, start + block_tokens, lo=first), len(ends) - 1)
        yield first, last + 1, start, ends[last]
        first, start = last + 1, ends[last]


__all__ = [
    "KL_TYPES",
    "LOW_VAR_KL_CLAMP",
    "Moments",
    "WHITEN_EPS",
    "Workspace",
    "check_kl_type",
    "dense_group_ids",
    "kl_estimate",
    "masked_sample_sums",
    "masked_whiten",
    "reverse_scan_order",
    "sample_blocks",
    "sample_ends",
    "sample_moments",
    "segment_sum",
    "segment_sums",
    "stacked_sample_sums",
    "token_counts",
    "whiten",
    "whitening_stats",
]
