"""Parsing and validating JSON documents with one-line errors that name the document and the field.

Shared by the native reader and the older-format reader, so both report bad input the same way.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trajectory_replay.errors import BundleError, UsageError
from trajectory_replay.outcome import QUOTE_LIMIT, one_line
from trajectory_replay.store.jsonbound import MAX_JSON_DEPTH, nesting_exceeds

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_DOCUMENT_BYTES = 256 << 20
"""Largest JSON document (manifest, index, expected; V1 files) read unless the environment says otherwise."""
MAX_DOCUMENT_BYTES_ENV = "TRAJECTORY_REPLAY_MAX_DOCUMENT_BYTES"
"""Environment variable that replaces DEFAULT_MAX_DOCUMENT_BYTES (a positive number of bytes)."""


def validation_message(exc: ValidationError) -> str:
    """The first pydantic error as `missing required field 'a.b'` or `field 'a.b': why`."""
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        return one_line(f"missing required field '{loc}'", QUOTE_LIMIT)
    return one_line(f"field '{loc}': {msg}" if loc else msg, QUOTE_LIMIT)


def validate_document(model: type[M], raw: Any, label: str) -> M:
    """`model.model_validate(raw)`, with any schema error as a one-line BundleError naming `label`."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise BundleError(f"{label}: {validation_message(exc)}") from None


def parse_document(model: type[M], data: bytes | bytearray, label: str) -> M:
    """The document `data` (UTF-8 JSON bytes) validated as `model`, with any error as a one-line BundleError
    naming `label`.

    Validated straight from the bytes, without building the Python objects of the whole text first (a
    step's index holds thousands of records). Bad input is read again the slower way, which gives the
    error its words."""
    if nesting_exceeds(data):
        raise BundleError(f"{label}: not valid JSON (nested more than {MAX_JSON_DEPTH} levels deep)")
    try:
        return model.model_validate_json(data)
    except ValidationError:
        pass
    return validate_document(model, parse_json(data, label), label)


def max_document_bytes() -> int:
    """The document size bound in bytes: $TRAJECTORY_REPLAY_MAX_DOCUMENT_BYTES, else DEFAULT_MAX_DOCUMENT_BYTES."""
    text = os.environ.get(MAX_DOCUMENT_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_DOCUMENT_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise UsageError(f"{MAX_DOCUMENT_BYTES_ENV}={one_line(text, 40)!r}: expected a positive number of bytes")
    return value


def document_size_problem(size: int) -> str | None:
    """Why a document of `size` bytes is not read (it is over the bound), or None."""
    limit = max_document_bytes()
    if size <= limit:
        return None
    return f"document of {size} bytes is over the {limit}-byte bound (raise {MAX_DOCUMENT_BYTES_ENV} to read it)"


def check_document_size(size: int, label: str) -> None:
    """BundleError when a document of `size` bytes is over the bound; called before a byte of it is read."""
    problem = document_size_problem(size)
    if problem:
        raise BundleError(f"{label}: {problem}")


def parse_json(data: bytes | bytearray, label: str) -> dict[str, Any]:
    """Decode a UTF-8 JSON object, turning decoding errors into a one-line BundleError."""
    if nesting_exceeds(data):
        raise BundleError(f"{label}: not valid JSON (nested more than {MAX_JSON_DEPTH} levels deep)")
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BundleError(f"{label}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"{label}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise BundleError(f"{label}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's conversion limit
        raise BundleError(f"{label}: not valid JSON ({one_line(exc, QUOTE_LIMIT)})") from None
    if not isinstance(raw, dict):
        raise BundleError(f"{label}: expected a JSON object, got {type(raw).__name__}")
    return raw


def compact_json(value: Any) -> bytes:
    """The native encoding of a document: compact, sorted keys, UTF-8 (NaN kept: data replay must locate)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode("utf-8")
