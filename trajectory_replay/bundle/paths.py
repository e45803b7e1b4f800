"""Bundle addresses: `<root>/<bundle>` and `<root>/<bundle>/rank-<r>`, as local paths or URLs."""

from __future__ import annotations

import os
import re
from typing import Optional

from trajectory_replay.errors import BundleError

RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]*)")


def split_bundle_path(path_or_url: str) -> tuple[str, str, Optional[int]]:
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
