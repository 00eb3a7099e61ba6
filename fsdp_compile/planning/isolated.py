"""Plan in a child process, for processes that already have a real default process group.

The planner's fake world must be the default process group of the process that traces, and a
process has one default group: inside a ``torchrun`` job (``strategy="auto"``, or ``plan()``
called from a training script) the planning runs in a fresh Python process started with
``subprocess`` (which, unlike ``multiprocessing``, also works from daemonic processes). The
child gets the model as a meta-device copy (structure and shapes only, never the weights),
the inputs as meta tensors, and sends back the plan's rows.

``loss_fn`` and the model's classes must be importable by the child: module-level
functions and classes (the child's ``sys.path`` is the parent's).
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .numbers import PlanError


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure with every parameter and buffer on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(
            tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _meta_inputs(inputs: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
        if isinstance(v, torch.Tensor) else v, inputs)


def run_in_subprocess(planner: Callable[..., Any], model: nn.Module, example_inputs: tuple, **kwargs: Any):
    """``planner(model's meta copy, meta inputs, **kwargs)`` in a fresh Python process.

    ``planner`` travels by reference (a module-level function: pickle names its module, which
    the child imports), so this module needs nothing of the planner itself."""
    request = {"planner": planner, "model": meta_copy(model), "inputs": _meta_inputs(example_inputs),
               "kwargs": kwargs}
    with tempfile.TemporaryDirectory(prefix="fsdp_compile_plan_") as tmp:
        request_path = os.path.join(tmp, "request.pkl")
        result_path = os.path.join(tmp, "result.pkl")
        try:
            with open(request_path, "wb") as f:
                pickle.dump(request, f)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise PlanError(
                "planning runs in a subprocess here (a real process group exists), so the model, inputs and "
                f"loss_fn must be picklable: {exc}; define loss_fn and the model's classes at module level"
            ) from exc
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
            env.pop(key, None)  # the child is no member of the job
        done = subprocess.run([sys.executable, "-m", "fsdp_compile.planning.isolated", request_path, result_path],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not os.path.exists(result_path):
            raise PlanError(f"the planning subprocess failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        with open(result_path, "rb") as f:
            status, payload = pickle.load(f)
    if status == "error":
        raise payload
    if kwargs.get("verbose") and done.stdout:
        sys.stdout.write(done.stdout)
    return payload


def _main(request_path: str, result_path: str) -> None:
    with open(request_path, "rb") as f:
        request = pickle.load(f)
    try:
        result = ("ok", request["planner"](request["model"], request["inputs"], **request["kwargs"]))
    except Exception as exc:  # any error goes back to the parent, which raises it
        result = ("error", exc)
    with open(result_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
