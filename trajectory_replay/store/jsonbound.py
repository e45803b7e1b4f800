"""The nesting bound every JSON text is held to before it is parsed: blob records here, and the
bundle layer's documents, markers and safetensors headers above. It lives in the lowest layer that
parses JSON; correctly addressed bytes can still be hostile.
"""

from __future__ import annotations

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in any JSON document, marker, record or safetensors header.

The formats nest a few levels; the bound keeps every later step that walks a value recursively
(validation, comparison, serialization) far from Python's recursion limit."""

_NOT_STRUCTURE = bytes(range(256)).translate(None, b'[]{}"')
_SCAN_STEP = 1 << 24


def nesting_exceeds(data: bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text `data` nests arrays/objects more than `limit` deep, found without parsing it.

    Only brackets outside strings count. Escaped backslashes, then escaped quotes, are dropped first, so
    every quote left opens or closes a string; the rest is a few passes in C and numpy, a small fraction
    of what parsing costs. On text that is not JSON the answer is only a guess; the parser then decides."""
    if isinstance(data, memoryview):
        data = data.tobytes()
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    import numpy as np  # only a text with more brackets than the bound gets here: small commands skip the import

    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = data.translate(None, _NOT_STRUCTURE)
    depth = quotes = 0
    for start in range(0, len(text), _SCAN_STEP):
        part = np.frombuffer(text, np.uint8, min(_SCAN_STEP, len(text) - start), start)
        is_quote = part == 0x22
        in_string = (np.cumsum(is_quote, dtype=np.int64) + quotes) & 1
        quotes = (quotes + int(is_quote.sum())) & 1
        brackets = part[(in_string == 0) & ~is_quote]
        if not brackets.size:
            continue
        # '[' and '{' have bit 1 set, ']' and '}' do not: +1 for an opening bracket, -1 for a closing one
        levels = np.cumsum((brackets & 2).astype(np.int64) - 1) + depth
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
    return False


__all__ = ["MAX_JSON_DEPTH", "nesting_exceeds"]
