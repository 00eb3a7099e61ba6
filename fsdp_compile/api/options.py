"""Every option of :func:`fsdp_compile.backend`, each declared once: name, type, default, doc, check.

An option is one field of :class:`BackendOptions`, made by :func:`option`. Everything else follows
from the fields: the backend's signature (:func:`signature_from`, so that ``help()`` and IDEs show
the keywords), the Args: of its documentation (:func:`options_doc`), and validation, which runs
each field's check in declaration order, so a check may read the options declared before its
own, already checked.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
import functools
import inspect
import os
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from torch.distributed.device_mesh import DeviceMesh

from . import values
from .buckets import BucketPolicy, Policy, parse_policy
from .policies import CPUOffload, MixedPrecision
from .strategy import ShardingStrategy
from .values import ReshardOption

if TYPE_CHECKING:
    import torch.distributed as dist
    import torch.fx as fx

# A check gets the value given and the options (those declared before it already checked), and
# returns the value to keep, parsed or normalized, or raises an error that names the option.
Check = Callable[[Any, "BackendOptions"], Any]


def option(doc: str, check: Check | None = None, *, agree: bool, cache: bool,
           describe: Callable[[Any, BackendOptions], Any] | None = None) -> dict[str, Any]:
    """What a field needs to be an option, besides its name, type and default: its Args: entry, its
    check, whether every rank must pass the same value (``agree``: compared at ``shard()``), whether
    it keys the compile cache (``cache``: the passes' result depends on it; options the backend
    resolves first, such as prefetch orders or ``reshard_after_forward``, are keyed by what they
    resolve to), and how to spell the value alike on every rank (``describe``, else :func:`described`)."""
    return {"doc": doc, "check": check, "agree": agree, "cache": cache, "describe": describe}


def described(options: BackendOptions, flag: str) -> dict[str, Any]:
    """The options declared with ``flag`` (``"agree"`` or ``"cache"``), each spelled as JSON-able
    text that is equal on ranks given equal values (enums by name, objects by repr)."""
    found = {}
    for spec in dataclasses.fields(options):
        if spec.metadata[flag]:
            value, describe = getattr(options, spec.name), spec.metadata["describe"]
            if describe is not None:
                value = describe(value, options)
            elif isinstance(value, enum.Enum):
                value = value.name
            elif isinstance(value, tuple):
                value = list(value)
            elif value is not None and not isinstance(value, (bool, int, float, str)):
                value = repr(value)
            found[spec.name] = value
    return found


def _strategy(value: Any, o: BackendOptions) -> ShardingStrategy:
    return ShardingStrategy.parse(value)


def _compiler(value: Any, o: BackendOptions) -> str:
    if value not in values.COMPILERS:
        raise ValueError(f"compiler={value!r} is not supported; use one of: {', '.join(values.COMPILERS)}")
    return value


def _instance(name: str, kind: type, what: str) -> Check:
    """A check that the value is None or a ``kind`` (``what`` names it in the error)."""
    def check(value: Any, o: BackendOptions) -> Any:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}= must be {what}, got {type(value).__name__}")
        return value
    return check


def _process_groups(value: Any, o: BackendOptions) -> Any:
    if o.mesh is not None and value is not None:
        raise ValueError("pass either mesh= or process_groups=, not both")
    return value


def _shard_size(value: Any, o: BackendOptions) -> int | None:
    if value is not None and not o.strategy.is_hybrid:
        raise ValueError(f"shard_size= only applies to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not {o.strategy.name}")
    if value is not None and (o.mesh is not None or o.process_groups is not None):
        raise ValueError("shard_size= only applies when neither mesh= nor process_groups= is given")
    return value


def _keeping(check: Callable[[Any], Any]) -> Check:
    """An option check that runs ``check`` on the value and keeps the value as given (``bucket=``:
    :attr:`BackendOptions.bucket_policy` is the parsed policy)."""
    def run(value: Any, o: BackendOptions) -> Any:
        check(value)
        return value
    return run


def _prefetch_order(name: str) -> Check:
    def check(value: Any, o: BackendOptions) -> dict | None:
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{name}= takes a dict {{unit: [units to prefetch]}}, got {type(value).__name__}")
        if value is not None and not o.bucket_policy.uses_units:
            raise ValueError(f"{name}= names bucket units, which bucket={o.bucket_policy.describe()} does not have")
        return value
    return check


def _path(value: Any, o: BackendOptions) -> str | None:
    return os.fspath(value) if value is not None else None


def _strict(value: Any, o: BackendOptions) -> bool:
    if value is None:
        return values.env_flag(values.STRICT_ENV)
    if not isinstance(value, bool):
        raise TypeError(f"strict= takes a bool (or None: {values.STRICT_ENV} decides), got {type(value).__name__}")
    return value


def _passes(value: Any, o: BackendOptions) -> dict[str, list[Callable]]:
    phases = dict(value or {})
    for phase, fns in phases.items():
        if phase not in ("forward", "backward"):
            raise ValueError(f"passes= takes the phases 'forward' and 'backward', not {phase!r}")
        if not all(callable(fn) for fn in fns):
            raise TypeError(f"passes[{phase!r}] must hold callables GraphModule -> GraphModule | None")
        phases[phase] = list(fns)
    return phases


def _verify(value: Any, o: BackendOptions) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"verify= takes a bool, got {type(value).__name__}")
    return value


def _cache_dir(value: Any, o: BackendOptions) -> str | None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"cache_dir= takes a directory path, got {type(value).__name__}")
    return _path(value, o)


def _disable_passes(value: Any, o: BackendOptions) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    unknown = [name for name in names if name not in values.OPTIONAL_PASSES]
    if unknown:
        raise ValueError(f"disable_passes= names {', '.join(map(repr, unknown))}, which is not a pass that can be "
                         f"switched off; use some of {', '.join(values.OPTIONAL_PASSES)}")
    return tuple(dict.fromkeys(names))


def _regions(value: Any, o: BackendOptions) -> bool | int:
    if not isinstance(value, int):
        raise TypeError(f"regions= takes a bool or a number of copies, got {type(value).__name__}")
    if not isinstance(value, bool) and value < 2:
        raise ValueError(f"regions={value}: a block is compiled once for all its copies from 2 copies on; "
                         "give 2 or more, True (where it pays) or False")
    return value


def _verify_gradients(value: Any, o: BackendOptions) -> bool | float:
    if not isinstance(value, bool) and (not isinstance(value, (int, float)) or not 0 < value < 1):
        raise ValueError(f"verify_gradients={value!r} takes True (the default tolerance), False, or a "
                         "tolerance between 0 and 1 (relative to each gradient's largest entry)")
    return value


def _reshard_after_forward(value: Any, o: BackendOptions) -> ReshardOption:
    values.check_reshard_option(value, o.strategy, o.bucket_policy.uses_units)
    return value


def _memory_budget(value: Any, o: BackendOptions) -> int | None:
    if value is None:
        return None
    budget = values.parse_bytes(value, "memory_budget")
    if o.strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
        raise ValueError(f"memory_budget= chooses what FULL_SHARD or HYBRID_SHARD keeps from forward to "
                         f"backward; {o.strategy.name} already decides it (for a unit-by-unit choice of "
                         "your own, pass reshard_after_forward=)")
    if o.reshard_after_forward is not None:
        raise ValueError("memory_budget= chooses reshard_after_forward itself: pass one of the two")
    if not o.bucket_policy.uses_units:
        raise ValueError("memory_budget= chooses per bucket unit, which bucket= sizes in bytes or per "
                         "parameter do not have; use bucket='module' (the default)")
    if o.cluster is None:  # declared after this option: as given
        raise ValueError("memory_budget= predicts what each choice saves on a cluster model: pass cluster= "
                         "(fsdp_compile.Cluster.measure(), or Cluster.preset(...) for a known GPU)")
    return budget


def _cluster(value: Any, o: BackendOptions) -> Any:
    if value is not None and o.memory_budget is None:
        raise ValueError("cluster= is what memory_budget= predicts with; pass memory_budget= too "
                         "(strategy='auto' takes both to plan)")
    return value


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """The options of one backend, checked: ``BackendOptions.validate(strategy, **options)``.

    Types are what a caller may pass; the stored values are the checks' results (``strategy`` a
    :class:`ShardingStrategy`, ``strict`` a bool, paths strings, ``memory_budget`` bytes).
    ``dataclasses.replace`` checks every option again.
    """

    # The one option also given by position: backend("FULL_SHARD").
    strategy: ShardingStrategy | str = field(default=ShardingStrategy.FULL_SHARD, kw_only=False, metadata=option(
        "a :class:`fsdp_compile.ShardingStrategy` or its name, in any case.", _strategy, agree=True, cache=True))
    compiler: str = field(default="inductor", metadata=option(
        "``\"inductor\"`` (default), ``\"aot_eager\"`` (no code generation; bitwise equal to the "
        "eager runtime) or ``\"eager\"`` (the captured graph as Python, every marker run by the eager "
        "runtime). ``FSDP_COMPILE_EAGER=1`` forces ``\"eager\"``.", _compiler, agree=True, cache=True))
    mesh: DeviceMesh | None = field(default=None, metadata=option(
        "a ``DeviceMesh``: 1-D, or for hybrid strategies 2-D with dims (replicate, shard). For a model "
        "whose parameters are already tensor-parallel DTensors (torch's ``parallelize_module`` on "
        "``mesh[\"tp\"]``), the data-parallel part of that same mesh (``mesh[\"dp\"]``): each parameter's "
        "TP-local tensor is sharded over it, as FSDP2's ``fully_shard(mesh=mesh[\"dp\"])`` does (see "
        "docs/tensor-parallel.md).", _instance("mesh", DeviceMesh, "a torch.distributed.device_mesh.DeviceMesh"),
        agree=False, cache=False))
    process_groups: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = field(default=None, metadata=option(
        "instead of ``mesh``: one group, or ``(shard_pg, replicate_pg)`` for hybrid strategies (any "
        "layout that tiles the world).", _process_groups, agree=False, cache=False))
    shard_size: int | None = field(default=None, metadata=option(
        "hybrid strategies without ``mesh``/``process_groups``: ranks per shard group (default "
        "``LOCAL_WORLD_SIZE``, one node).", _shard_size, agree=False, cache=False))
    timeout: datetime.timedelta | None = field(default=None, metadata=option(
        "the timeout of groups the backend creates (default: the default group's).",
        _instance("timeout", datetime.timedelta, "a datetime.timedelta"), agree=False, cache=False))
    bucket: BucketPolicy = field(default="module", metadata=option(
        "``\"module\"`` (default: one bucket per repeated block, plus the root's parameters), a set "
        "of module classes or a callable ``module -> bool`` (FSDP1's ``auto_wrap_policy``), an int (bytes "
        "of consecutive parameters), or ``\"param\"``.", _keeping(parse_policy), agree=True, cache=True,
        describe=lambda value, o: o.bucket_policy.describe()))
    mixed_precision: MixedPrecision | None = field(default=None, metadata=option(
        "a :class:`fsdp_compile.MixedPrecision` (parameter, reduce, output dtypes).",
        _instance("mixed_precision", MixedPrecision, "an fsdp_compile.MixedPrecision"), agree=True, cache=True))
    schedule: bool = field(default=True, metadata=option(
        "reorder collectives to overlap compute (default True); under Inductor it also turns off "
        "Inductor's peak-memory reordering of graphs with collectives (it would undo it).", agree=True, cache=True))
    prefetch: int = field(default=1, metadata=option(
        "how many buckets ahead a gather is issued (default 1; 0: right before use).",
        _keeping(values.check_prefetch), agree=True, cache=True))
    max_inflight_bytes: int | None = field(default=None, metadata=option(
        "most bytes of collectives issued and not yet waited (default: twice the largest bucket, plus twice the "
        "largest all-reduce across nodes if hybrid).", _keeping(values.check_inflight_budget), agree=True, cache=True))
    forward_prefetch: dict | None = field(default=None, metadata=option(
        "explicit orders ``{unit: [units to gather when it starts]}`` (units by name or module), as "
        "FSDP2's ``set_modules_to_forward_prefetch``.", _prefetch_order("forward_prefetch"), agree=False, cache=False))
    backward_prefetch: dict | None = field(default=None, metadata=option(
        "the same for backward.", _prefetch_order("backward_prefetch"), agree=False, cache=False))
    dump_dir: str | os.PathLike | None = field(default=None, metadata=option(
        "write every graph before and after each pass, and a JSON summary per graph (or "
        "``FSDP_COMPILE_DUMP=<dir>``); read with ``python -m fsdp_compile inspect``.", _path, agree=False, cache=False))
    strict: bool | None = field(default=None, metadata=option(
        "raise instead of falling back, with a warning, after an error fsdp_compile does not expect: a "
        "failed pass (that graph's markers would run in the eager runtime) or regions failing for another "
        "reason than torch's region rules, an Inductor error say (those blocks would compile inline). "
        "Default: ``FSDP_COMPILE_STRICT=1`` in the environment.", _strict, agree=False, cache=True))
    passes: dict[str, Sequence[Callable[[fx.GraphModule], Any]]] | None = field(default=None, metadata=option(
        "extra passes ``{\"forward\" | \"backward\": [fn(GraphModule)]}``, run after ours.",
        _passes, agree=False, cache=False))
    offload: CPUOffload | None = field(default=None, metadata=option(
        "a :class:`fsdp_compile.CPUOffload`: shards, gradients, optimizer step in host memory.",
        _instance("offload", CPUOffload, "an fsdp_compile.CPUOffload"), agree=True, cache=True))
    verify: bool = field(default=True, metadata=option(
        "check at ``shard()`` and on the first run of every compiled graph that all ranks will "
        "communicate alike, raising a named error on every rank otherwise (default True).",
        _verify, agree=False, cache=False))
    cache_dir: str | os.PathLike | None = field(default=None, metadata=option(
        "under Inductor, a process that compiles what an earlier one compiled with the same directory "
        "loads it from there (warm restarts).", _cache_dir, agree=False, cache=False))
    disable_passes: Sequence[str] = field(default=(), metadata=option(
        f"names of our optional passes to skip, some of {', '.join(values.OPTIONAL_PASSES)} "
        "(``fsdp_compile.api.OPTIONAL_PASSES``), to debug a pass or measure it.",
        _disable_passes, agree=True, cache=True))
    regions: bool | int = field(default=True, metadata=option(
        "compile each repeated block once (``torch.compiler.nested_compile_region``): True (default: "
        "from as many copies as pays under the compiler), False, or the number of copies from which to.",
        _regions, agree=False, cache=True))
    verify_gradients: bool | float = field(default=False, metadata=option(
        "on the first step of each compiled graph, also run it through the eager runtime and raise "
        ":class:`fsdp_compile.GradientMismatch` on every rank naming the first parameter whose gradient "
        "differs: True (default tolerance), or a tolerance relative to each gradient's largest entry (or "
        "``FSDP_COMPILE_VERIFY=1``).", _verify_gradients, agree=False, cache=False))
    reshard_after_forward: ReshardOption = field(default=None, metadata=option(
        "what each unit keeps of its gathered parameters from forward to backward (FSDP2's option of "
        "that name): True (drop to the shard; FULL_SHARD), False (keep them; SHARD_GRAD_OP), or an int n "
        "(keep a shard over groups of n consecutive ranks of the shard group, n dividing it: backward "
        "gathers inside those groups, such as a node, only). One value, or a dict ``{unit name | module | "
        "module class: value}`` for some units (the others take the strategy's).",
        _reshard_after_forward, agree=True, cache=False))
    memory_budget: int | float | str | None = field(default=None, metadata=option(
        "with FULL_SHARD or HYBRID_SHARD, bytes per rank (or a string such as ``\"12GiB\"``): the "
        "compiler chooses each unit's ``reshard_after_forward`` so that the predicted exposed communication "
        "is least while the step's predicted peak (the graphs' live memory, this rank's shards, gradients "
        "and AdamW's state) stays within it (``fsdp_compile/planning/budget.py``). Needs "
        "``cluster=``.", _memory_budget, agree=False, cache=False))
    cluster: Any = field(default=None, metadata=option(
        "the :class:`fsdp_compile.Cluster` ``memory_budget`` predicts communication on "
        "(``Cluster.measure()``, which on an emulated network fits its links, or a preset).",
        _cluster, agree=False, cache=False))

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            check = spec.metadata.get("check")
            if check is not None:
                object.__setattr__(self, spec.name, check(getattr(self, spec.name), self))

    @functools.cached_property
    def bucket_policy(self) -> Policy:
        """``bucket=`` parsed."""
        return parse_policy(self.bucket)

    @classmethod
    def validate(cls, *strategy: Any, **options: Any) -> BackendOptions:
        """Every option of :func:`fsdp_compile.backend` checked, each once: a wrong one raises an
        error that names it and says what to use; a keyword that is no option, one that names the
        nearest option."""
        names = [spec.name for spec in dataclasses.fields(cls)]
        for name in options:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {near[0]}=?" if near else ""
                raise TypeError(f"fsdp_compile.backend() got an unexpected keyword argument {name!r}{hint} "
                                f"(its options: {', '.join(names)})")
        return cls(*strategy, **options)


def options_doc(indent: str = "    ") -> str:
    """The Args: entries of every option, from the declarations."""
    return "\n".join(
        textwrap.fill(f"{spec.name}: {spec.metadata['doc']}", width=100, initial_indent=indent,
                      subsequent_indent=indent * 2, break_long_words=False, break_on_hyphens=False)
        for spec in dataclasses.fields(BackendOptions))


T = TypeVar("T", bound=type)
P = ParamSpec("P")


def documents_options(cls: T) -> T:
    """Append the options' Args: to ``cls``'s docstring (the backend's: what ``help()`` shows)."""
    cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\nArgs:\n{options_doc()}\n"
    return cls


def signature_from(options: Callable[P, Any]) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """Give an ``__init__(self, *args, **options)`` that builds ``options(*args, **options)`` the
    signature of ``options``: ``help()`` and ``inspect`` read it at run time, type checkers and
    IDEs from this decorator's type, so the keywords are declared once, by the fields."""
    def apply(init: Callable[..., None]) -> Callable[Concatenate[Any, P], None]:
        own = next(iter(inspect.signature(init).parameters.values()))  # self
        init.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [own, *inspect.signature(options).parameters.values()], return_annotation=None)
        return init
    return apply
