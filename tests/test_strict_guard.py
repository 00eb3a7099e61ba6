"""The suite's guards (tests/conftest.py) hold in this process and in the ranks it spawns.

``FSDP_COMPILE_STRICT=1`` is forced, whatever the shell exported, so every backend a test builds
without ``strict=`` raises where it would fall back. Dynamo's recompile limit, once reached,
raises instead of running the frame uncompiled: past it, a test of a compiled path would pass
on eager code.
"""

from __future__ import annotations

import os

import torch
from distributed import run_workers

import fsdp_compile


def _strict_settings() -> dict:
    return {"environment": os.environ.get("FSDP_COMPILE_STRICT"),
            "backend": fsdp_compile.backend("FULL_SHARD", compiler="aot_eager").options.strict}


def _past_the_recompile_limit() -> str:
    """What a function compiled once more than the recompile limit allows does."""

    def tagged(x: torch.Tensor, tag: str) -> torch.Tensor:
        return x + len(tag)

    torch._dynamo.reset()
    compiled = torch.compile(tagged, backend="eager")
    try:
        with torch.compiler.config.patch(recompile_limit=1):
            compiled(torch.ones(2), "a")
            compiled(torch.ones(2), "bb")  # a string is guarded by value: a second entry
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        return "raised"
    finally:
        torch._dynamo.reset()
    return "ran uncompiled"


def strict_worker(rank: int, world: int) -> dict:
    return _strict_settings()


def recompile_worker(rank: int, world: int) -> str:
    return _past_the_recompile_limit()


def test_strict_is_on_whatever_the_shell_exported() -> None:
    expected = {"environment": "1", "backend": True}
    assert _strict_settings() == expected
    assert run_workers(strict_worker, 2) == [expected, expected]


def test_a_backend_given_strict_false_falls_back() -> None:
    # What a test that expects a fallback says, and the only way it gets one.
    assert fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", strict=False).options.strict is False


def test_reaching_the_recompile_limit_raises() -> None:
    assert _past_the_recompile_limit() == "raised"


def test_reaching_the_recompile_limit_raises_in_the_ranks() -> None:
    assert run_workers(recompile_worker, 2) == ["raised", "raised"]
