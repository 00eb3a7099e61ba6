"""Plan in a child process, for processes that already have a real default process group.

The fake world must be the default group of the process that traces, so inside a ``torchrun`` job the planning runs in a
fresh ``subprocess`` (which, unlike ``multiprocessing``, works from daemonic processes), handed a meta-device copy of
the model and meta inputs.

``loss_fn`` and the model's classes travel by reference: the child imports their module, or, for the training script
itself, prepares it as ``spawn`` does (``multiprocessing.spawn.prepare``): the script runs as ``__mp_main__`` standing
in for ``__main__``, whole if it guards its entry point with ``if __name__ == "__main__":``, else its definitions only
(imports, functions, classes, assignments that call nothing), so that it does not train again.
"""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .vocabulary import PlanError
from .world import copy_with


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure with every parameter and buffer on the meta device (no data copied)."""
    return copy_with(model, _meta)


def _meta_inputs(inputs: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda v: _meta(v) if isinstance(v, torch.Tensor) else v, inputs)


# Where objects defined by the main script say they come from: "__main__" in the process that ran it, "__mp_main__" in a
# spawned process or in the planning child.
_MAIN_NAMES = ("__main__", "__mp_main__")


def main_script() -> dict[str, str | None] | None:
    """This process's main script's path and, run with ``-m``, module name; None without one."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not os.path.isfile(path):
        return None
    spec = getattr(main, "__spec__", None)
    return {"path": os.path.abspath(path), "module": getattr(spec, "name", None)}


def _guards_entry_point(tree: ast.Module) -> bool:
    """Whether the script runs its program under ``if __name__ == "__main__":``."""
    for stmt in tree.body:
        test = stmt.test if isinstance(stmt, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)):
            return True
    return False


def _defines_only(stmt: ast.stmt) -> bool:
    """A top-level statement that only defines names (see the module docstring)."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                         ast.Pass)):
        return True
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return stmt.value is None or not any(isinstance(node, ast.Call) for node in ast.walk(stmt.value))
    if isinstance(stmt, ast.Expr):  # a docstring
        return isinstance(stmt.value, ast.Constant)
    if isinstance(stmt, ast.Try):  # try: import x / except ImportError: ...
        return all(_defines_only(s) for block in (stmt.body, stmt.orelse, stmt.finalbody,
                                                   *(h.body for h in stmt.handlers)) for s in block)
    return False


def prepare_main(script: dict[str, str | None]) -> types.ModuleType:
    """Run the parent's main script as ``__mp_main__`` (whole if it guards its entry point, else its definitions only)
    and make it this process's ``__main__``."""
    path, name = script["path"], script["module"]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    if not _guards_entry_point(tree):
        tree.body = [stmt for stmt in tree.body if _defines_only(stmt)]
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    if name is not None:  # run with -m: its relative imports resolve against its package
        module.__package__ = name.rpartition(".")[0]
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    exec(compile(tree, path, "exec"), module.__dict__)
    return module


class _Unpickler(pickle.Unpickler):
    """Finds what the main script defined: in the child by preparing it on first use."""

    def __init__(self, file: Any, script: dict[str, str | None] | None = None) -> None:
        super().__init__(file)
        self.script = script
        self.main: types.ModuleType | None = None

    def find_class(self, module: str, name: str) -> Any:
        if module not in _MAIN_NAMES:
            return super().find_class(module, name)
        if self.script is None:
            found: Any = sys.modules["__main__"]
        else:
            if self.main is None:
                self.main = prepare_main(self.script)
            found = self.main
        for part in name.split("."):  # a nested class comes by its qualified name
            found = getattr(found, part)
        return found


def run_in_subprocess(planner: Callable[..., Any], model: nn.Module, example_inputs: tuple, **kwargs: Any):
    """``planner(model's meta copy, meta inputs, **kwargs)`` in a fresh Python process (``planner``: a module-level
    function, which travels by reference)."""
    request = {"planner": planner, "model": meta_copy(model), "inputs": _meta_inputs(example_inputs),
               "kwargs": kwargs}
    script = main_script()
    with tempfile.TemporaryDirectory(prefix="fsdp_compile_plan_") as tmp:
        request_path = os.path.join(tmp, "request.pkl")
        result_path = os.path.join(tmp, "result.pkl")
        try:
            with open(request_path, "wb") as f:
                pickle.dump(request, f)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise PlanError(
                "planning runs in a subprocess here (a real process group exists), so the model, inputs and "
                f"loss_fn must be picklable: {exc}; define loss_fn and the model's classes at the top level of "
                "a module or of the training script (not inside a function, not as a lambda)"
            ) from exc
        script_path = os.path.join(tmp, "script.pkl")
        with open(script_path, "wb") as f:
            pickle.dump(script, f)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
            env.pop(key, None)  # the child is no member of the job
        done = subprocess.run([sys.executable, "-m", "fsdp_compile.planning.child_process", request_path, result_path,
                               script_path], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not os.path.exists(result_path):
            raise PlanError(f"the planning subprocess failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        with open(result_path, "rb") as f:
            status, payload = _Unpickler(f).load()
    if status == "error":
        raise payload
    if kwargs.get("verbose") and done.stdout:
        sys.stdout.write(done.stdout)
    return payload


def _main(request_path: str, result_path: str, script_path: str) -> None:
    with open(script_path, "rb") as f:
        script = pickle.load(f)
    with open(request_path, "rb") as f:
        request = _Unpickler(f, script).load()
    try:
        result = ("ok", request["planner"](request["model"], request["inputs"], **request["kwargs"]))
    except Exception as exc:  # any error goes back to the parent, which raises it
        result = ("error", exc)
    with open(result_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3])
