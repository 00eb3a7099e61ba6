"""Warm restarts: a second process compiling the same model reuses the first one's compilation.

Under ``compiler="inductor"`` torch keeps compiled graphs on disk: AOTAutograd's cache (keyed on
the Dynamo graph, its inputs and Inductor's configuration) in front of Inductor's FX graph cache.
A hit skips AOTAutograd, the partitioner, our passes and Inductor; only Dynamo runs again.

Our passes run inside Inductor's compilation, which the AOTAutograd key does not see, so
everything their result depends on goes into the key as the ``uuid()`` of the hooks the backend
installs (:func:`cache_key_parts`): the package's version and sources, the options declared
``cache=True`` (``api/options.py``), world, groups and local shards, prefetch orders and reshard
choices as resolved, and the uuids of the user's passes. The Dynamo graph already spells out
every parameter's shapes, groups and dtypes (the markers' arguments).

``cache_dir=`` points Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) at the user's directory for
the whole process; a manifest there records the versions that wrote it (entries of another
version are never used, and the backend says so). A graph loaded from the cache ran none of our
passes: its record has ``cache == "hit"`` and no graphs, buckets or schedule. The cache is off,
with a warning saying why, for a user pass without ``uuid()``, while dumping, or for a
``cache_dir`` that cannot be written; ``aot_eager`` and ``eager`` compile through no cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import api
from ..api.options import described
from ..inspection.dump import write_json
from ..passes import pass_fingerprint
from ..sharding.sharded_param import sharded_name

if TYPE_CHECKING:
    from ..api import BackendOptions
    from ..sharding.backend_state import ShardingState

MANIFEST = "fsdp_compile_cache.json"


@dataclass
class CacheState:
    """Whether this backend's compiles may use the cache, and if not, why."""

    enabled: bool
    reason: str = ""  # why it is off
    directory: str | None = None  # the cache_dir= the user chose, if any


def _versions() -> dict[str, str]:
    return {"fsdp_compile": api.__version__, "sources": pass_fingerprint(), "torch": torch.__version__}


def _callable_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def user_pass_uuids(passes: dict[str, list[Any]]) -> tuple[dict[str, list[Any]] | None, str]:
    """The uuids of the user's passes by phase, or (None, why) if one of them has none."""
    uuids: dict[str, list[Any]] = {}
    for phase, fns in sorted(passes.items()):
        for fn in fns:
            uuid = getattr(fn, "uuid", None)
            value = uuid() if callable(uuid) else None
            if value is None:
                return None, (f"user pass {_callable_name(fn)} ({phase}) has no uuid() saying what it does, "
                              "so its result cannot be keyed; give it a uuid() method (as Inductor's "
                              "CustomGraphPass) to let compiles be cached")
            uuids.setdefault(phase, []).append(value)
    return uuids, ""


def cache_key(parts: dict[str, Any]) -> str:
    """A stable hash of ``parts`` (JSON-able, with reprs for anything else) plus the versions."""
    text = json.dumps({**parts, "versions": _versions()}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key_parts(options: BackendOptions, state: ShardingState) -> dict[str, Any]:
    """Everything our passes' result depends on besides the Dynamo graph and the user's passes."""
    topo = state.topology
    groups = {}
    for name, group in (("shard", topo and topo.shard_group), ("replicate", topo and topo.replicate_group)):
        groups[name] = dist.get_process_group_ranks(group) if group is not None else None
    # AOTAutograd keys a DTensor input by its global metadata only: with uneven shards, ranks
    # whose local shards differ would share an entry, and two TP plans can leave every local
    # shard the same shape. So the rank, each local shard, its mesh and placements are keyed.
    local = sorted((name, tuple(p.to_local().shape), tuple(p.to_local().stride()), str(p.dtype), str(p.device),
                    p.device_mesh.mesh_dim_names, tuple(map(repr, p.placements)))
                   for p in state.sharded_parameters() for name in [sharded_name(p) or ""])
    tp_groups = sorted({tuple(dist.get_process_group_ranks(info.tp.mesh.get_group(dim)))
                        for info in state.params.values() if info.tp is not None for dim in range(info.tp.mesh.ndim)})
    groups["tensor_parallel"] = [list(g) for g in tp_groups] or None
    return {**described(options, "cache"), "world": dist.get_world_size() if dist.is_initialized() else 1,
            "rank": dist.get_rank() if dist.is_initialized() else 0, "local_shards": local, "groups": groups,
            "explicit_prefetch": state.explicit_prefetch, "reshard_to": dict(sorted(state.reshard_to.items())),
            "kernels": os.environ.get("FSDP_COMPILE_KERNELS", "")}


def compile_cache_key(cache: CacheState, options: BackendOptions, state: ShardingState,
                      dumping: bool) -> tuple[str | None, bool, str]:
    """(key for Inductor's caches, None to bypass them; whether AOTAutograd's cache may be read;
    why it may not)."""
    if not cache.enabled and cache.directory is not None:
        return None, False, cache.reason  # an unusable cache_dir: everything cold
    uuids, why = user_pass_uuids(options.passes)
    # Inductor's FX graph cache keys on the graph our passes produced, so it stays right
    # whatever the key; AOTAutograd's keys on the graph before them and needs all of it.
    key = cache_key({**cache_key_parts(options, state), "user_passes": uuids if uuids is not None else "unkeyed"})
    if not cache.enabled:
        return key, False, cache.reason
    if uuids is None:
        return key, False, why
    if dumping:
        # A hit would skip the passes, and the dump with them (what is stored stays right).
        return key, False, "dumping graphs (dump_dir / FSDP_COMPILE_DUMP) needs the passes to run"
    return key, True, ""


@dataclass(frozen=True)
class CacheLookup:
    """How Inductor's caches may be used for a graph (see :func:`~.cache.compile_cache_key`)."""

    key: str | None  # our key, carried by the hooks' uuids; None makes Inductor bypass its caches
    lookups: bool  # whether AOTAutograd's cache may be read
    why_off: str
    fx_graph_cache: bool = True  # False: an unusable cache_dir, nothing read or written


def record_outcome(record: Any, outcome: str, key: str | None, stats: dict[str, int], directory: str | None,
                   graph_code: str, calls: Callable[[], list[Any]]) -> None:
    """What Inductor's caches did for a graph ("hit", "miss" or "off: <why>"), on its record and in
    the counts; a miss stores its collectives beside the entry, for a later hit to check across ranks."""
    record.cache, record.cache_key = outcome, key
    stats["hits" if outcome == "hit" else "misses" if outcome == "miss" else "off"] += 1
    if outcome == "miss":
        save_collectives(directory, key, graph_code, [dataclasses.asdict(c) for c in calls()])


def prepare_directory(directory: str | os.PathLike) -> CacheState:
    """Validate ``cache_dir=`` and point Inductor's cache at it; warn and disable on bad input."""
    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".fsdp_compile_probe_"):
            pass
    except OSError as exc:
        reason = (f"cache_dir={os.fspath(directory)!r} cannot be written ({type(exc).__name__}: {exc}); "
                  "compiling without the compile cache (every compile is cold)")
        warnings.warn(f"fsdp_compile: {reason}", RuntimeWarning, stacklevel=3)
        return CacheState(False, reason, str(path))
    _check_manifest(path)
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Inductor sets the variable to its default on first use: only a user's choice is worth a word.
    if previous is not None and Path(previous).resolve() not in (path, Path(default_cache_dir()).resolve()):
        warnings.warn(f"fsdp_compile: cache_dir={str(path)!r} replaces TORCHINDUCTOR_CACHE_DIR={previous!r} "
                      "for this process", RuntimeWarning, stacklevel=3)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return CacheState(True, "", str(path))


def _check_manifest(path: Path) -> None:
    manifest = path / MANIFEST
    current = {k: v for k, v in _versions().items() if k != "sources"}
    try:
        written = json.loads(manifest.read_text()) if manifest.exists() else None
    except (OSError, ValueError):
        written = {"unreadable": True}
    if written is not None and written != current:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(written.items()))
        warnings.warn(f"fsdp_compile: cache_dir {str(path)!r} holds compilations of another version ({shown}; this "
                      f"is fsdp_compile {current['fsdp_compile']}, torch {current['torch']}); they are never reused "
                      "(versions are part of every key), so the first compile is cold", RuntimeWarning, stacklevel=4)
    if written != current:
        with contextlib.suppress(OSError):  # the manifest is advisory; the keys hold the versions
            write_json(manifest, current)


def _calls_path(directory: str, key: str, graph_code: str) -> Path:
    digest = hashlib.sha256(f"{key}\n{graph_code}".encode()).hexdigest()[:32]
    return Path(directory) / "fsdp_compile_collectives" / f"{digest}.json"


def save_collectives(directory: str, key: str, graph_code: str, calls: list[dict[str, Any]]) -> None:
    """Keep a compiled graph's collective sequence beside its cache entry: a process that loads
    the graph runs none of our passes, and its first-run agreement check compares this instead."""
    with contextlib.suppress(OSError):  # a hit without it verifies the Dynamo graph's markers instead
        write_json(_calls_path(directory, key, graph_code), calls)


def load_collectives(directory: str, key: str, graph_code: str) -> list[dict[str, Any]] | None:
    try:
        return json.loads(_calls_path(directory, key, graph_code).read_text())
    except (OSError, ValueError):
        return None
