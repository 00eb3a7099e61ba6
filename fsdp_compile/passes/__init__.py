"""Graph passes: each takes a graph, rewrites one concern, and says why in its docstring."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.cache
def pass_fingerprint() -> str:
    """A hash of the passes' sources: changes whenever what the passes do may change."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
