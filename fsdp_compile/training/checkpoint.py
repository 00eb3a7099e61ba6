"""Checkpoints of sharded models: distributed (sharded) and full state dicts.

:func:`save_checkpoint` / :func:`load_checkpoint` write and read the DTensor shards (and the
optimizer's state) with ``torch.distributed.checkpoint``, so a checkpoint loads into another world
size or strategy. A save is renamed into place only once every rank has written, so a failed
save leaves the previous checkpoint intact; a load checks files, names and shapes before it
touches the model, so a damaged checkpoint raises a named error and changes nothing.
:func:`full_state_dict` / :func:`load_full_state_dict` move whole tensors for single-device models.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from ..runtime.faults import reraise_named
from ..sharding.groups import current_device

EXTRA_FILE = "extra.pt"
_SHOWN = 5  # mismatches named in an error


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _all_ok(ok: bool, operation: str) -> bool:
    """Whether ``ok`` holds on every rank (so all ranks raise together instead of one hanging); with
    ``ok=True`` the save's barrier."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1])
    try:
        dist.all_reduce(flag)
    except Exception as exc:
        reraise_named(exc, operation, None)
    return int(flag.item()) == 0


def _model_and_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": model.state_dict()}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: Mapping[str, Any] | None = None) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``; collective over all ranks.

    ``extra`` (plain Python values and tensors: step, data position, RNG state) is saved by
    rank 0 and returned by :func:`load_checkpoint`. ``path`` is replaced only after every rank
    has written: on failure the previous checkpoint there is intact.
    """
    path = Path(path)
    operation = f"save_checkpoint({str(path)!r})"
    partial, previous = _beside(path, "partial"), _beside(path, "previous")
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _all_ok(True, operation)
    error: BaseException | None = None
    try:
        dcp.save(_model_and_optim_state(model, optimizer), checkpoint_id=str(partial))
        if _rank() == 0 and extra is not None:
            torch.save(dict(extra), partial / EXTRA_FILE)
    except BaseException as exc:  # reported on every rank below, never half-renamed
        error = exc
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt and the like: stop now, the previous checkpoint is intact
    if not _all_ok(error is None, operation):
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        where = f" on this rank: {type(error).__name__}: {error}" if error else " on another rank"
        raise RuntimeError(f"saving checkpoint {str(path)!r} failed{where}; the previous checkpoint there "
                           "(if any) is unchanged") from error
    if _rank() == 0:
        shutil.rmtree(previous, ignore_errors=True)
        if path.exists():
            os.replace(path, previous)
        # Between the renames the checkpoint is only at ``previous``, where loading looks too.
        os.replace(partial, path)
        shutil.rmtree(previous, ignore_errors=True)
    _all_ok(True, operation)


def _beside(path: Path, state: str) -> Path:
    """Where a save keeps ``path``'s checkpoint while it is "partial" or the "previous" one."""
    return path.with_name(f".{path.name}.{state}")


def _complete(path: Path) -> Path | None:
    """``path``, or its previous version when a save died between its renames; None if neither."""
    for candidate in (path, _beside(path, "previous")):
        if (candidate / ".metadata").is_file():
            return candidate
    return None


class CheckpointError(ValueError):
    """A checkpoint that is missing parts, damaged, or written for another model."""


def _read_metadata(path: Path) -> Any:
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: its index {str(path / '.metadata')!r} cannot be read "
                              f"({type(exc).__name__}: {exc}); the checkpoint is damaged: load an older one") from exc


def _missing_or_short_files(path: Path, metadata: Any) -> str | None:
    """The first data file the index names that is absent or shorter than the index says."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    for relative in sorted(needed):
        file = path / relative
        if not file.is_file():
            return f"file {str(file)!r} is missing"
        size = file.stat().st_size
        if size < needed[relative]:
            return f"file {str(file)!r} is truncated ({size} bytes, the index needs {needed[relative]})"
    return None


def _saved_shapes(metadata: Any) -> dict[str, tuple[int, ...] | None]:
    return {key: tuple(item.size) if hasattr(item, "size") else None
            for key, item in metadata.state_dict_metadata.items()}


def _mismatches(expected: Mapping[str, tuple | None], found: Mapping[str, tuple | None], what: str) -> str | None:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [f"{k}: {what} has {list(found[k])}, model has {list(expected[k])}"
              for k in expected if k in found and expected[k] is not None and found[k] != expected[k]]
    parts = [f"{label}: {_listed(items, sep)}" for label, items, sep in (
        (f"missing from the {what}", missing, ", "), (f"in the {what} but not in the model", unexpected, ", "),
        ("shape mismatch", shapes, "; ")) if items]
    return "; ".join(parts) if parts else None


def _listed(items: list[str], sep: str = ", ") -> str:
    more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return sep.join(items[:_SHOWN]) + more


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    Any world size and strategy may have written it. A checkpoint that is not whole (files its
    index names missing or short) or does not match the model (names, shapes) raises a
    :class:`CheckpointError` (a ``ValueError``) on every rank before anything is loaded; if
    reading fails anyway, model and optimizer are restored. Returns the saved ``extra`` ({} if none).
    """
    path = Path(path)
    operation = f"load_checkpoint({str(path)!r})"
    found = _complete(path)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (expected a directory written by save_checkpoint)")
    state = _model_and_optim_state(model, optimizer)
    problem: str | None = None
    try:
        metadata = _read_metadata(found)
        problem = _missing_or_short_files(found, metadata)
        if problem is None:
            saved = _saved_shapes(metadata)
            model_saved = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
            expected = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state["model"].items()}
            mismatch = _mismatches(expected, model_saved, "checkpoint")
            if mismatch:
                problem = f"does not match the model: {mismatch}"
            elif optimizer is not None and not any(k.startswith("optim.") for k in saved):
                problem = "has no optimizer state; load it with optimizer=None"
    except CheckpointError as exc:
        problem = str(exc)
    # Every rank looks at the same files; agreeing anyway means no rank loads while another raises.
    if not _all_ok(problem is None, operation):
        detail = problem or "another rank found it damaged or not matching the model (see its error)"
        if not detail.startswith("checkpoint"):
            detail = f"checkpoint {str(found)!r}: {detail}"
        raise CheckpointError(f"{detail}; nothing was loaded")
    backup = _snapshot(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(found))
        if optimizer is None:
            model.load_state_dict(state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_file = found / EXTRA_FILE
        extra = torch.load(extra_file, weights_only=True) if extra_file.is_file() else {}
    except Exception as exc:
        _restore(model, optimizer, backup)
        reraise_named(exc, operation, None)  # a communication failure: another rank is gone
        raise CheckpointError(f"reading checkpoint {str(found)!r} failed ({type(exc).__name__}: {exc}); the model "
                              "and optimizer are as they were before the call") from exc
    return extra


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple:
    tensors = {name: _local(t).detach().clone() for name, t in model.state_dict().items()
               if isinstance(t, torch.Tensor)}
    if optimizer is None:
        return tensors, None, None
    state = {p: {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in s.items()}
             for p, s in optimizer.state.items()}
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return tensors, state, groups


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer | None, backup: tuple) -> None:
    tensors, state, groups = backup
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if name in tensors:
                _local(target).copy_(tensors[name])
    if optimizer is not None:
        optimizer.state.clear()
        optimizer.state.update(state)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Whole tensors of ``model``'s state dict, for a single-device model; collective.

    Gathers one tensor at a time (no rank holds more than one full tensor beyond what it
    keeps). With ``rank0_only`` other ranks get an empty dict; with ``cpu_offload`` the kept
    tensors are copied to the CPU.
    """
    keep = not rank0_only or _rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            value = value.detach()
            out[name] = value.to("cpu", copy=True) if cpu_offload else value.clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, from_rank0: bool = False) -> None:
    """Copy whole tensors (e.g. a single-device checkpoint) into a sharded ``model``; collective.

    Every rank passes the full dict, or with ``from_rank0`` only rank 0 does (others pass
    ``{}``) and the values are sent from it. Names and shapes must match the model's; the
    error names the first mismatches, on every rank.
    """
    targets = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in targets.items()}
    problem = None
    if not from_rank0 or _rank() == 0:
        given = {k: tuple(v.shape) for k, v in state_dict.items()}
        problem = _mismatches(expected, given, "state dict")
    if from_rank0 and dist.is_initialized():
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    elif not _all_ok(problem is None, "load_full_state_dict()"):
        problem = problem or "mismatch on another rank"
    if problem:
        raise ValueError(f"state dict does not match the model: {problem}")
    with torch.no_grad():
        for name, target in targets.items():
            # Collectives run on the mesh's device (CPU-offloaded shards are copied back after).
            device = _comm_device(target)
            if from_rank0 and _rank() != 0:
                source = torch.empty(target.shape, dtype=target.dtype, device=device)
            else:
                source = state_dict[name].detach().to(device=device, dtype=target.dtype)
            if isinstance(target, DTensor):
                # Cut as the target is placed; sent from rank 0 only when only it has the values.
                placed = distribute_tensor(source, target.device_mesh, target.placements,
                                           src_data_rank=0 if from_rank0 else None)
                target.to_local().copy_(placed.to_local())
            else:
                if from_rank0 and dist.is_initialized():
                    dist.broadcast(source, src=0)
                target.copy_(source)


def _comm_device(t: torch.Tensor) -> torch.device:
    return current_device(t.device_mesh.device_type) if isinstance(t, DTensor) else t.device
