"""Bundle addresses: `<root>/<bundle>` and `<root>/<bundle>/rank-<r>`, as local paths or URLs; and how a local
directory of the older (V1) format is told apart, without loading that format's reader."""

from __future__ import annotations

import os
import re
from pathlib import Path

from trajectory_replay.errors import BundleError, NoSuchTargetError

RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]*)")


def split_bundle_path(path_or_url: str) -> tuple[str, str, int | None]:
    """(store root, bundle name, addressed rank or None) of a bundle path or URL."""
    text = os.fspath(path_or_url)
    scheme = ""
    if "://" in text:
        scheme, text = text.split("://", 1)
        scheme += "://"
    elif text:
        text = os.path.abspath(os.path.expanduser(text))
    parts = [p for p in text.rstrip("/").split("/")]
    rank = None
    if parts and RANK_DIR.fullmatch(parts[-1]):
        rank = int(parts.pop()[5:])
    if len(parts) < 2 or not parts[-1]:
        raise BundleError(f"{path_or_url}: not a bundle path (expected <root>/<bundle_id>)")
    name = parts.pop()
    root = "/".join(parts) or "/"
    return scheme + root, name, rank


def rank_of_dir(directory: Path) -> int | None:
    """r when `directory` is `<bundle>/rank-<r>`, else None."""
    match = RANK_DIR.fullmatch(directory.name)
    return int(match.group(1)) if match else None


def is_v1_bundle(path: str | os.PathLike) -> bool:
    """True when `path` looks like a V1 bundle: it holds manifest.json, or rank-<r> bundle directories."""
    directory = Path(path)
    if not directory.is_dir():
        return False
    if (directory / "manifest.json").is_file():
        return True
    return any(
        rank_of_dir(child) is not None and (child / "manifest.json").is_file()
        for child in directory.iterdir()
        if child.is_dir()
    )


def check_directory(path: Path) -> None:
    """NoSuchTargetError when `path` does not exist, BundleError when it is not a directory."""
    if not path.exists():
        raise NoSuchTargetError(f"{path}: no such bundle directory")
    if not path.is_dir():
        raise BundleError(f"{path}: not a directory")


def find_v1_bundles(capture_dir: str | os.PathLike) -> list[Path]:
    """The children of `capture_dir` that are V1 bundles, sorted by name."""
    directory = Path(capture_dir)
    check_directory(directory)
    return sorted(child for child in directory.iterdir() if is_v1_bundle(child))
