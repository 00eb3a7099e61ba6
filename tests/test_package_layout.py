"""The package stays in modules of one concern, layered without circles.

No module over 500 lines, no class over 300, each import going down the layers (``LAYERS``) and
no module importing itself through others.

A module that grows past these has taken on a second concern (the compiler, the sharded
parameters and the calibrations were each split for that reason); split it rather than raise
the limits.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_compile"
MODULE_LINES, CLASS_LINES = 500, 300


def test_no_module_over_500_lines_and_no_class_over_300() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if len(text.splitlines()) > MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                too_long.append(f"{name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


# Each folder of the package, and its top modules, by layer: a module may import its own layer and
# those below, never above. The compile pipeline sits on the sharding and graph-rewriting layers;
# the planner may trace through the compiler, never the reverse; the user's door is on top.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "api", "runtime", "models", "network", "testing"}),
    frozenset({"sharding"}),
    frozenset({"passes", "inspection", "checks", "training"}),
    frozenset({"compilation"}),
    frozenset({"planning"}),
    frozenset({"fsdp_backend", "auto_backend", "__init__", "demo", "__main__"}),
)
# The emulated network is a testing tool beside the product: what trains never imports it (a
# process group's timeout comes from the group, whatever its class); the planner's ``compare`` and
# the user's door may offer it.
TESTING_TOOLS = frozenset({"network", "testing"})
TRAINING_LAYERS = frozenset().union(*LAYERS[:4]) - TESTING_TOOLS


def package_imports(typing_too: bool = True) -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, at any depth (inside
    functions too; inside ``if TYPE_CHECKING:`` where ``typing_too``: such an import shows a
    layer that knows another, though it never runs)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = imports.setdefault(name, set())
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if typing_too else walk_running_code(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                # ``from package import name`` imports the submodule where ``name`` is one.
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
    return imports


def walk_running_code(tree: ast.AST):
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None) if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                pending.extend(child.orelse)
                continue
            pending.append(child)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_goes_down_the_layers() -> None:
    rank = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}
    upward = []
    for module, targets in sorted(package_imports().items()):
        for target in sorted(targets):
            source_layer, target_layer = layer_of(module), layer_of(target)
            if target_layer in TESTING_TOOLS and source_layer in TRAINING_LAYERS:
                upward.append(f"{module} -> {target} (training code imports a testing tool)")
            elif source_layer in rank and target_layer in rank and rank[target_layer] > rank[source_layer]:
                upward.append(f"{module} -> {target} ({source_layer} is below {target_layer})")
    unplaced = {layer_of(m) for m in package_imports()} - set(rank)
    assert not unplaced, f"folders without a layer: {sorted(unplaced)}; add each to LAYERS"
    assert not upward, "\n".join(upward)


def test_no_module_imports_itself_through_others() -> None:
    graph = package_imports(typing_too=False)
    circles = [sorted(component) for component in strongly_connected(graph) if len(component) > 1]
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components, iteratively (the package is deeper than Python's recursion wants)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def test_no_two_modules_share_a_file_name() -> None:
    # A name used twice (regions, report, memory) makes a reader open the wrong one: each module's
    # name says what it holds, wherever it sits.
    folders_of: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            folders_of.setdefault(path.name, []).append(str(path.parent.relative_to(PACKAGE.parent)))
    shared = {name: sorted(folders) for name, folders in folders_of.items() if len(folders) > 1}
    assert not shared, shared


def test_benchmarks_import_public_names_only() -> None:
    # A benchmark is a user of the package: what it needs from it is public, so a change of a
    # private name cannot quietly break the figures the results page cites.
    private = []
    for path in sorted((PACKAGE.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_compile"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private
