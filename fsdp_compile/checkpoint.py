"""Checkpoints of sharded models: distributed (sharded) and full state dicts.

A sharded model's ``state_dict()`` holds its DTensor shards under the usual names, without
communication. :func:`save_checkpoint` / :func:`load_checkpoint` write and read them (and the
optimizer's state) with ``torch.distributed.checkpoint``, which records global shapes and
placements, so a checkpoint loads into another world size or another strategy. Saving is
atomic: the checkpoint is written next to its destination and renamed into place only when
every rank has written its part, so a failed save leaves the previous checkpoint intact.

:func:`full_state_dict` gathers whole tensors (on rank 0 only, by default on the CPU) for
export to a single-device model; :func:`load_full_state_dict` takes such a dict back into a
sharded model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from .groups import current_device

EXTRA_FILE = "extra.pt"
_SHOWN = 5  # mismatches named in an error


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (so all ranks raise together instead of one hanging)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def _model_and_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": model.state_dict()}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``; collective over all ranks.

    ``extra`` (plain Python values and tensors: step, data position, RNG state) is saved by
    rank 0 and returned by :func:`load_checkpoint`. ``path`` is replaced only after every rank
    has written: on failure the previous checkpoint there is intact.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    previous = path.with_name(f".{path.name}.previous")
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    error: BaseException | None = None
    try:
        dcp.save(_model_and_optim_state(model, optimizer), checkpoint_id=str(partial))
        if _rank() == 0 and extra is not None:
            torch.save(dict(extra), partial / EXTRA_FILE)
    except BaseException as exc:  # reported on every rank below, never half-renamed
        error = exc
    if not _all_ok(error is None):
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(
            f"saving checkpoint {str(path)!r} failed"
            + (f" on this rank: {type(error).__name__}: {error}" if error else " on another rank")
            + "; the previous checkpoint there (if any) is unchanged"
        ) from error
    if _rank() == 0:
        shutil.rmtree(previous, ignore_errors=True)
        if path.exists():
            os.replace(path, previous)
        os.replace(partial, path)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        out[key] = tuple(item.size) if hasattr(item, "size") else None
    return out


def _mismatches(expected: Mapping[str, tuple | None], found: Mapping[str, tuple | None], what: str) -> str | None:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [f"{k}: {what} has {list(found[k])}, model has {list(expected[k])}"
              for k in expected if k in found and expected[k] is not None and found[k] != expected[k]]
    parts = []
    if missing:
        parts.append(f"missing from the {what}: {_listed(missing)}")
    if unexpected:
        parts.append(f"in the {what} but not in the model: {_listed(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch: {_listed(shapes, '; ')}")
    return "; ".join(parts) if parts else None


def _listed(items: list[str], sep: str = ", ") -> str:
    """The first few items, and how many more there are."""
    more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return sep.join(items[:_SHOWN]) + more


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    Any world size and strategy may have written it. The names and shapes of the model's
    parameters and buffers must match the checkpoint's; otherwise a ``ValueError`` names the
    first mismatches. Returns the ``extra`` dict that was saved (empty if none).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (expected a directory written by save_checkpoint)")
    saved = _saved_shapes(path)
    model_saved = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    state = _model_and_optim_state(model, optimizer)
    expected = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state["model"].items()}
    problem = _mismatches(expected, model_saved, "checkpoint")
    if problem:
        raise ValueError(f"checkpoint {str(path)!r} does not match the model: {problem}")
    if optimizer is not None and not any(k.startswith("optim.") for k in saved):
        raise ValueError(f"checkpoint {str(path)!r} has no optimizer state; load it with optimizer=None")
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra_file = path / EXTRA_FILE
    return torch.load(extra_file, weights_only=True) if extra_file.is_file() else {}


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
    elif not _all_ok(problem is None):
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
