"""The writer side's conversions of captured values into what bundle documents hold: per-sample scalars as lists,
loss masks as per-sample lists, reported scalars as floats.

They run in the capture writer (a thread of the training process, or the writer process, which never imports
torch): a captured value is a number, a list, or a tensor, either a torch tensor or the writer process's
`codec.RawTensor`. Both have `reshape`, `tolist` and `numel`, which is all these use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "numel") and hasattr(value, "tolist") and hasattr(value, "reshape")


def materialize_list(value: Any, what: str, n: int | None = None) -> list | None:
    """Per-sample scalars as a Python list."""
    if value is None:
        return None
    if _is_tensor(value):
        out = value.reshape(-1).tolist()
    else:
        out = [v.item() if _is_tensor(v) else v for v in value]
    if n is not None and len(out) != n:
        raise ValueError(f"{what} has {len(out)} entries for {n} samples")
    return out


def required_list(value: Any, what: str, n: int | None = None) -> list:
    """`materialize_list` of a value every bundle needs: ValueError naming it when it was not given."""
    out = materialize_list(value, what, n)
    if out is None:
        raise ValueError(f"{what} is missing")
    return out


def materialize_masks(value: Any, lengths: Sequence[int], what: str = "loss_masks") -> list[list[int]]:
    """Per-sample loss masks: a list of per-sample lists/tensors, or one flat tensor split by response length."""
    if _is_tensor(value):
        flat = [int(v) for v in value.reshape(-1).tolist()]
        if len(flat) != sum(max(n, 0) for n in lengths):
            raise ValueError(f"{what}: a flat mask of {len(flat)} tokens for {sum(lengths)} response tokens")
        out, pos = [], 0
        for n in lengths:
            out.append(flat[pos : pos + max(n, 0)])
            pos += max(n, 0)
        return out
    if value is None:
        raise ValueError(f"{what} is missing")
    if len(value) != len(lengths):
        raise ValueError(f"{what} has {len(value)} entries for {len(lengths)} samples")
    return [[int(x) for x in (m.reshape(-1).tolist() if _is_tensor(m) else m)] for m in value]


def materialize_float(value: Any) -> float | None:
    """A reported scalar (a number or a 0-d/1-element tensor) as a float."""
    if value is None:
        return None
    if _is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"a reported scalar is a tensor of {value.numel()} elements, not one")
        return float(value.reshape(-1).tolist()[0])
    return float(value)


__all__ = ["materialize_float", "materialize_list", "materialize_masks"]
