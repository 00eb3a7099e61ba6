"""The backend's options are declared once (fsdp_compile.api.BackendOptions), and the signature
users and IDEs see, the documentation help() shows and the checks all follow from that one
declaration; the options' module sits at the bottom of the package."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from distributed import run_workers

import fsdp_compile
from fsdp_compile.api import OPTIONAL_PASSES, BackendOptions

API = Path(fsdp_compile.__file__).parent / "api"


def test_the_signature_the_docs_and_the_declarations_agree() -> None:
    fields = dataclasses.fields(BackendOptions)
    for door in (fsdp_compile.FSDPBackend, fsdp_compile.backend):
        parameters = inspect.signature(door).parameters
        for spec in fields:
            assert spec.name in parameters, (door, spec.name)
            assert parameters[spec.name].default == spec.default, (door, spec.name)
        assert next(iter(parameters)) == "strategy"
        assert all(p.kind is p.KEYWORD_ONLY for p in list(parameters.values())[1:]), door
    doc = inspect.cleandoc(fsdp_compile.FSDPBackend.__doc__)
    words = " ".join(doc.split())
    for spec in fields:
        assert f"\n    {spec.name}: " in doc, spec.name
        assert f"{spec.name}: {' '.join(spec.metadata['doc'].split())}" in words, spec.name
    # The auto-only options are the planner's; backend() shows them after the backend's own.
    assert {"example_inputs", "loss_fn", "plan_options"} <= set(inspect.signature(fsdp_compile.backend).parameters)


def test_defaults_are_the_declared_ones_checked() -> None:
    options = fsdp_compile.backend().options
    assert options.strategy is fsdp_compile.ShardingStrategy.FULL_SHARD
    assert (options.compiler, options.bucket, options.prefetch, options.verify) == ("inductor", "module", 1, True)
    assert options.bucket_policy.kind == "module" and options.disable_passes == () and options.passes == {}
    assert isinstance(options.strict, bool)  # None: the environment decided


def test_every_option_is_checked_again_when_replaced() -> None:
    options = BackendOptions.validate("full_shard", prefetch=2, disable_passes="lower_markers")
    assert options.disable_passes == ("lower_markers",)
    changed = dataclasses.replace(options, bucket=1 << 20)
    assert changed.bucket_policy.kind == "bytes" and options.bucket_policy.kind == "module"
    with pytest.raises(ValueError, match="prefetch=-1 must be an int >= 0"):
        dataclasses.replace(options, prefetch=-1)
    with pytest.raises(ValueError, match="forward_prefetch= names bucket units, which bucket=1024 does not have"):
        dataclasses.replace(options, bucket=1024, forward_prefetch={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.prefetch = 3  # type: ignore[misc]


def test_an_unknown_keyword_names_the_nearest_option() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'prefetch_depth'; did you mean prefetch=\?"):
        fsdp_compile.backend(prefetch_depth=2)


def test_the_optional_passes_moved_with_a_deprecation_warning() -> None:
    from fsdp_compile.passes import context

    with pytest.warns(DeprecationWarning, match="fsdp_compile.api.OPTIONAL_PASSES"):
        assert context.OPTIONAL_PASSES == OPTIONAL_PASSES


def test_the_options_vocabulary_imports_nothing_of_the_package_but_errors() -> None:
    found = []
    for path in sorted(API.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module != "errors":
                found.append(f"{path.name}: from {'.' * node.level}{node.module or ''}")
            if isinstance(node, ast.Import | ast.ImportFrom) and (getattr(node, "module", None) or "").startswith(
                    "fsdp_compile"):
                found.append(f"{path.name}: {ast.unparse(node)}")
    assert not found, found


def _checked_options(rank: int, world: int) -> dict[str, list[str]]:
    """The options the shard() agreement and the compile-cache key use, read off what they build."""
    from fsdp_compile.checks.agreement import sharding_items

    backend = fsdp_compile.backend(compiler="aot_eager")
    model = backend.shard(torch.nn.Linear(4, 4))
    items = sharding_items(backend.options, backend._state.topology, model)
    names = {spec.name for spec in dataclasses.fields(BackendOptions)}
    return {"agree": [label[:-1] for label, _ in items if label[:-1] in names],
            "cache": [key for key in backend.cache_key_parts() if key in names]}


def test_each_option_declares_whether_ranks_agree_on_it_and_whether_it_keys_the_cache() -> None:
    fields = dataclasses.fields(BackendOptions)
    lacking = [spec.name for spec in fields
               if not isinstance(spec.metadata.get("agree"), bool) or not isinstance(spec.metadata.get("cache"), bool)]
    assert not lacking, f"declare agree= and cache= in option(...) for {lacking}"
    checked = run_workers(_checked_options, 1)[0]
    for flag in ("agree", "cache"):
        assert checked[flag] == [spec.name for spec in fields if spec.metadata[flag]], flag
