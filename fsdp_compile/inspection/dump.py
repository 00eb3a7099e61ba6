"""Writing what the backend did to disk: graphs as Python, per pass, plus JSON summaries.

A dump holds ``manifest.json`` (versions, strategy, world, options) and per ``rank<R>/graph<G>/``:
``dynamo.py``, ``joint_before.py`` / ``joint_after.py`` (recompute tags at the end),
``forward/NN_<pass>.py`` and ``backward/NN_<pass>.py`` (00_partitioned: as the partitioner left
it) and ``summary.json``. Files are written to a temporary name and renamed (never half a file).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .. import api

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class DumpError(ValueError):
    """A dump directory that cannot be written or read as asked."""


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=2, default=str) + "\n")


def manifest_for(strategy: str, world: int, options: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "fsdp_compile": api.__version__, "torch": torch.__version__,
            "strategy": strategy, "world_size": world, "options": options}


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a dump, or a clear error (missing, unreadable, another format)."""
    path = root / MANIFEST
    if not root.is_dir():
        raise DumpError(f"{root} is not a directory; pass the dump_dir a run wrote into")
    if not path.exists():
        if not any(root.iterdir()):
            raise DumpError(f"{root} is empty: no fsdp_compile dump there (run with dump_dir= or FSDP_COMPILE_DUMP=)")
        raise DumpError(f"{root} has no {MANIFEST}: it is not an fsdp_compile dump")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DumpError(f"{path} is not readable JSON ({exc})") from exc
    if manifest.get("format") != FORMAT_VERSION:
        raise DumpError(f"{root} holds a dump in format {manifest.get('format')!r} (fsdp_compile "
                        f"{manifest.get('fsdp_compile')}); this fsdp_compile reads format {FORMAT_VERSION}: "
                        "inspect it with the version that wrote it")
    return manifest


class Dumper:
    """Writes one rank's dump files under ``root``; creating it checks the directory."""

    def __init__(self, root: str | os.PathLike, rank: int, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.rank = rank
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe.", delete=True):
                pass
        except OSError as exc:
            raise DumpError(f"dump_dir={str(root)!r} is not writable ({exc.strerror or exc}); "
                            "pass a directory this process can create files in") from exc
        existing = self.root / MANIFEST
        if existing.exists():
            old = read_manifest(self.root)
            for key in ("fsdp_compile", "strategy", "world_size"):
                if old.get(key) != manifest[key]:
                    raise DumpError(f"dump_dir={str(root)!r} already holds a dump with {key}={old.get(key)!r}, "
                                    f"this run has {key}={manifest[key]!r}; use an empty directory (dumps of "
                                    "different runs do not mix)")
        write_json(existing, manifest)

    def graph_dir(self, index: int) -> Path:
        return self.root / f"rank{self.rank}" / f"graph{index}"

    def write_graph(self, index: int, name: str, code: str) -> None:
        write_atomic(self.graph_dir(index) / name, code)

    def write_summary(self, index: int, summary: dict[str, Any]) -> None:
        write_json(self.graph_dir(index) / "summary.json", summary)


def graph_code(gm: torch.fx.GraphModule | torch.fx.Graph, tags: bool = False) -> str:
    """Readable Python for a graph; with ``tags``, the partitioner's recompute decisions too."""
    if isinstance(gm, torch.fx.GraphModule):
        code, graph = gm.print_readable(print_output=False), gm.graph
    else:
        code, graph = gm.python_code(root_module="self").src, gm
    if tags:
        lines = [f"#   {n.name}: {n.meta['recompute'].name}" for n in graph.nodes if "recompute" in n.meta]
        if lines:
            code += "\n# Recompute tags for the partitioner:\n" + "\n".join(lines) + "\n"
    return code
