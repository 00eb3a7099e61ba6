"""Dumps of every graph, the inspect command, backend.report(), and the eager fallbacks."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from helpers import (
    SEQ,
    TEST_CONFIG,
    WORLD,
    assert_bitwise,
    batches,
    expect_error,
    hybrid_options,
    lm_loss,
    local_slice,
    train,
)

import fsdp_compile
from fsdp_compile.models.gpt import GPT

STEPS = 3


def dump_worker(rank: int, world: int, dump_dir: str, via_env: bool) -> dict:
    """One compiled training step of the test GPT with dumping on; returns backend.report()."""
    import os

    if via_env:
        os.environ["FSDP_COMPILE_DUMP"] = dump_dir
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    options = {} if via_env else {"dump_dir": dump_dir}
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", **options)
    backend.shard(model)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    lm_loss(torch.compile(model, backend=backend)(x), y).backward()
    return {"report": backend.report()}


@functools.cache
def dumped(root: str, via_env: bool = False) -> list[dict]:
    return run_workers(dump_worker, 2, root, via_env)


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dump")
    dumped(str(root))
    return root


def inspect(*args: str, in_subprocess: bool = False) -> subprocess.CompletedProcess:
    """``python -m fsdp_compile inspect ARGS``. In this process by default: a new interpreter
    spends about 4 s importing torch per call, and the command is the same ``main()``;
    ``in_subprocess`` runs the real entry point."""
    command = [sys.executable, "-m", "fsdp_compile", "inspect", *args]
    if in_subprocess:
        return subprocess.run(command, capture_output=True, text=True, timeout=120)
    from fsdp_compile.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["inspect", *args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())


def test_dump_has_every_graph_before_and_after_each_pass(dump: Path) -> None:
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["strategy"] == "FULL_SHARD" and manifest["world_size"] == 2 and manifest["format"] == 1
    for rank in (0, 1):
        graph = dump / f"rank{rank}" / "graph0"
        expected = ["dynamo.py", "joint_before.py", "joint_after.py", "summary.json"]
        for phase in ("forward", "backward"):
            expected += [f"{phase}/00_partitioned.py", f"{phase}/01_unalias_region_outputs.py",
                         f"{phase}/02_elide_trivial_unshard.py", f"{phase}/03_lower_markers.py",
                         f"{phase}/04_schedule_collectives.py", f"{phase}/05_check_inflight_buffers.py"]
        for name in expected:
            assert (graph / name).is_file(), name
        for source in graph.rglob("*.py"):
            compile(source.read_text(), str(source), "exec")  # readable, valid Python
        assert "MUST_RECOMPUTE" in (graph / "joint_after.py").read_text()
        assert "fsdp_compile.unshard" in (graph / "forward/00_partitioned.py").read_text()
        assert "all_gather_into_tensor" in (graph / "forward/03_lower_markers.py").read_text()
        summary = json.loads((graph / "summary.json").read_text())
        forward, backward = summary["forward"], summary["backward"]
        # The root is read at both ends: embeddings first, final norm and head last.
        assert [b["bucket"] for b in forward["buckets"]] == ["<root>", "blocks.0", "blocks.1", "<root>:tail"]
        first = forward["buckets"][0]["params"][0]
        assert first == {"fqn": "tok_emb.weight", "shape": [67, 32], "dtype": "float32", "bytes": 67 * 32 * 4}
        assert [c["kind"] for c in forward["collectives"]] == ["all_gather"] * 4
        assert all(c["group_size"] == 2 and c["bytes"] > 0 for c in forward["collectives"])
        assert {c["kind"] for c in backward["collectives"]} == {"all_gather", "reduce_scatter"}
        assert forward["collectives"][2]["prefetch"] == 1
        assert forward["memory"]["peak_bytes"] > 0 and backward["schedule"]["budget"] > 0
    assert not list(dump.rglob("*.tmp")), "a temporary file was left behind"


def test_inspect_reports_buckets_and_collectives(dump: Path) -> None:
    proc = inspect(str(dump), "--rank", "0", in_subprocess=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "FULL_SHARD, world size 2" in out
    assert out.count("buckets: 4 gathered, 0 reduced") == 1  # forward: the root's two, the blocks
    assert "buckets: 3 gathered, 4 reduced" in out  # backward re-gathers all but the embeddings
    assert "collectives: all_gather x4\n" in out
    assert "collectives: all_gather x3, reduce_scatter x4" in out
    assert "bytes per step" in out and "reduce_scatter" in out
    assert "memory estimate: peak" in out and "schedule: budget" in out


def test_report_from_python_matches_inspect(dump: Path) -> None:
    reports = dumped(str(dump))
    proc = inspect(str(dump), "--rank", "1")
    python_report = reports[1]["report"]
    assert python_report.strip() in proc.stdout
    assert "rank 1, graph 0" in python_report


def test_inspect_graph_selects_one_graph(dump: Path, tmp_path: Path) -> None:
    import shutil

    # A second graph of rank 0: graph 0's dump again, under the next graph number.
    two = tmp_path / "two_graphs"
    shutil.copytree(dump, two)
    second = two / "rank0" / "graph1"
    shutil.copytree(two / "rank0" / "graph0", second)
    summary = json.loads((second / "summary.json").read_text())
    summary["graph"] = 1
    (second / "summary.json").write_text(json.dumps(summary))

    both = inspect(str(two), "--rank", "0")
    assert both.returncode == 0, both.stderr
    assert "rank 0, graph 0" in both.stdout and "rank 0, graph 1" in both.stdout
    only = inspect(str(two), "--rank", "0", "--graph", "1")
    assert only.returncode == 0, only.stderr
    assert "rank 0, graph 1" in only.stdout and "graph 0" not in only.stdout
    first = inspect(str(two), "--graph", "0")
    assert "rank 0, graph 0" in first.stdout and "rank 1, graph 0" in first.stdout
    assert "graph 1" not in first.stdout
    missing = inspect(str(two), "--graph", "7")
    assert missing.returncode == 2 and "no graph summaries graph 7" in missing.stderr


def test_timeline_is_a_chrome_trace(dump: Path, tmp_path: Path) -> None:
    trace = tmp_path / "timeline.json"
    assert inspect(str(dump), "--timeline", str(trace)).returncode == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "C"}
    collectives = [e for e in events if e.get("cat") == "collective"]
    assert len(collectives) == 2 * 11  # 2 ranks x (4 forward + 7 backward)
    assert all(e["dur"] >= 1 and isinstance(e["ts"], int) for e in collectives)


def test_plot_draws_the_memory_timeline(dump: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    proc = inspect(str(dump), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diff_shows_what_one_pass_changed(dump: Path) -> None:
    proc = inspect(str(dump), "--rank", "0", "--diff", "lower_markers")
    assert proc.returncode == 0
    assert "--- rank0/graph0/forward/02_elide_trivial_unshard.py" in proc.stdout
    assert "+++ rank0/graph0/forward/03_lower_markers.py" in proc.stdout
    assert "+" in proc.stdout and "all_gather_into_tensor" in proc.stdout
    bad = inspect(str(dump), "--diff", "no_such_pass")
    assert bad.returncode == 2 and "no such pass in this dump; passes: check_inflight_buffers, elide_trivial_unshard" in bad.stderr


def test_dump_via_environment_variable(tmp_path: Path) -> None:
    root = tmp_path / "env"
    run_workers(dump_worker, 2, str(root), True)
    assert (root / "rank1" / "graph0" / "summary.json").is_file()


def test_inspect_errors(tmp_path: Path, dump: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = inspect(str(empty))
    assert proc.returncode == 2 and "is empty: no fsdp_compile dump there" in proc.stderr
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("hi")
    assert "has no manifest.json: it is not an fsdp_compile dump" in inspect(str(stray)).stderr
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format": 999, "fsdp_compile": "9.9"}))
    proc = inspect(str(old))
    assert proc.returncode == 2 and "format 999" in proc.stderr and "inspect it with the version that wrote it" in proc.stderr
    assert "no graph summaries for rank 5" in inspect(str(dump), "--rank", "5").stderr


def dump_error_worker(rank: int, world: int, dump_dir: str, strategy: str) -> str:
    torch._dynamo.reset()
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend(strategy, compiler="aot_eager", dump_dir=dump_dir)
    backend.shard(model)
    x = torch.randint(0, TEST_CONFIG.vocab_size, (2, SEQ))
    return expect_error(lambda: torch.compile(model, backend=backend)(x))


def test_dump_dir_errors(tmp_path: Path, dump: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = run_workers(dump_error_worker, 1, str(blocker / "dump"), "FULL_SHARD")[0]
    assert f"dump_dir={str(blocker / 'dump')!r} is not writable" in message
    # A dump of another configuration in the same directory: refuse rather than mix.
    message = run_workers(dump_error_worker, 2, str(dump), "SHARD_GRAD_OP")[0]
    assert "already holds a dump with strategy='FULL_SHARD'" in message and "use an empty directory" in message
    # ... of another world size (the dump was written at world 2) ...
    message = run_workers(dump_error_worker, 1, str(dump), "FULL_SHARD")[0]
    assert "already holds a dump with world_size=2, this run has world_size=1" in message
    # ... or written by another version of fsdp_compile.
    import fsdp_compile

    older = tmp_path / "older"
    older.mkdir()
    manifest = json.loads((dump / "manifest.json").read_text())
    (older / "manifest.json").write_text(json.dumps({**manifest, "fsdp_compile": "0.0.1"}))
    message = run_workers(dump_error_worker, 2, str(older), "FULL_SHARD")[0]
    assert (f"already holds a dump with fsdp_compile='0.0.1', this run has fsdp_compile={fsdp_compile.__version__!r}"
            in message)


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path: Path, monkeypatch) -> None:
    from fsdp_compile.inspection import dump as dump_module

    target = tmp_path / "summary.json"
    dump_module.write_json(target, {"old": True})

    def interrupted(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(OSError):
        dump_module.write_json(target, {"new": True})
    assert json.loads(target.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def eager_fallback_worker(rank: int, world: int, strategy: str, steps: int) -> dict:
    """compiler="eager", FSDP_COMPILE_EAGER=1 and aot_eager on the same data."""
    import os

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    options = hybrid_options(strategy)  # hybrid: 2 x 2, so the shard group really reduce-scatters
    out = {}
    for mode in ("eager", "env", "aot_eager"):
        torch._dynamo.reset()
        if mode == "env":
            os.environ["FSDP_COMPILE_EAGER"] = "1"
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend(strategy, compiler="eager" if mode == "eager" else "aot_eager", **options)
        backend.shard(model)
        out[mode] = train(model, torch.compile(model, backend=backend), data, rank)
        out[mode]["compilers"] = [g.compiler for g in backend.graphs]
        out[mode]["shard_size"] = backend.topology.shard_size
        os.environ.pop("FSDP_COMPILE_EAGER", None)
    return out if rank == 0 else {}


# FULL_SHARD by default; tests/test_parity.py holds the eager runtime bitwise to aot_eager for
# every strategy.
@pytest.mark.parametrize("strategy", ["FULL_SHARD", pytest.param("SHARD_GRAD_OP", marks=pytest.mark.slow),
                                      pytest.param("NO_SHARD", marks=pytest.mark.slow),
                                      pytest.param("HYBRID_SHARD", marks=pytest.mark.slow),
                                      pytest.param("HYBRID_SHARD_ZERO2", marks=pytest.mark.slow)])
def test_eager_fallback_is_bitwise_equal_to_aot_eager(strategy: str) -> None:
    out = run_workers(eager_fallback_worker, WORLD[strategy], strategy, STEPS)[0]
    if strategy.startswith("HYBRID"):
        assert out["eager"]["shard_size"] == 2  # 2 x 2: reduce-scatter in the shard group, then across
    assert out["eager"]["compilers"] == ["eager"] and out["env"]["compilers"] == ["eager"]
    assert out["aot_eager"]["compilers"] == ["aot_eager"]
    for mode in ("eager", "env"):
        assert_bitwise(out[mode]["grads0"], out["aot_eager"]["grads0"], f"{mode} first-step gradients")
        assert_bitwise(out[mode]["params"], out["aot_eager"]["params"], f"{mode} parameters")


def double_output(gm: torch.fx.GraphModule) -> None:
    """A user pass that changes results visibly: the forward graph's first output (the
    model's output) doubled. Rewrites in place."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first, *rest = output.args[0]
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (first, 2))
    doubled.meta["val"] = first.meta["val"]
    output.args = ((doubled, *rest),)


def rebuilt(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A user pass that returns a new GraphModule instead of rewriting in place."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def user_pass_worker(rank: int, world: int, dump_dir: str) -> dict:
    """User passes on both phases, dumped; compiled output against the eager runtime's."""
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", dump_dir=dump_dir,
                                   passes={"forward": [double_output], "backward": [rebuilt]})
    backend.shard(model)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    compiled = torch.compile(model, backend=backend)(x)
    lm_loss(compiled, y).backward()
    eager = model(x)
    (record,) = backend.graphs
    output = next(n for n in record.forward.graph.nodes if n.op == "output")
    return {"doubled": torch.equal(compiled, 2 * eager), "fallbacks": record.fallbacks,
            "first_output": str(output.args[0][0].target)}


def test_user_passes_are_applied_and_dumped(tmp_path: Path) -> None:
    """passes= adds the user's passes after ours: the forward one doubles the model's output,
    so the compiled call returns twice what the eager runtime does; the backward one returns a
    new GraphModule. Both are dumped after our passes under their own names."""

    root = tmp_path / "user_passes"
    for rank, out in enumerate(run_workers(user_pass_worker, 2, str(root))):
        assert out["doubled"] and out["fallbacks"] == []
        assert out["first_output"] == "aten.mul.Tensor"
        graph = root / f"rank{rank}" / "graph0"
        assert "torch.ops.aten.mul.Tensor" in (graph / "forward/06_double_output.py").read_text()
        assert not (graph / "forward/05_double_output.py").exists()  # after ours: the check is 05
        assert (graph / "backward/06_rebuilt.py").is_file()


def failing_pass(gm):
    raise ValueError("deliberately broken pass")


def failing_pass_worker(rank: int, world: int, phase: str, strict: bool, steps: int) -> dict:
    """A user pass that raises: the graph falls back to the eager runtime, or strict raises."""
    import warnings

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", strict=strict,
                                   passes={phase: [failing_pass]})
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if strict:
            return {"error": expect_error(lambda: train(model, compiled, data, rank))}
        broken = train(model, compiled, data, rank)
    (record,) = backend.graphs
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    backend.shard(model)
    healthy = train(model, torch.compile(model, backend=backend), data, rank)
    from fsdp_compile.inspection.graphinfo import collective_counts, marker_counts

    graph = record.forward if phase == "forward" else record.backward
    return {"warnings": [str(w.message) for w in caught], "fallbacks": record.fallbacks,
            "broken": broken["params"], "healthy": healthy["params"],
            "markers": marker_counts(graph), "collectives": collective_counts(graph)}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_failing_pass_falls_back_to_the_eager_runtime(phase: str) -> None:
    out = run_workers(failing_pass_worker, 2, phase, False, STEPS)[0]
    (warning,) = [w for w in out["warnings"] if "failing_pass" in w]
    assert f"pass 'failing_pass' failed: ValueError: deliberately broken pass on graph 0 ({phase})" in warning
    assert out["fallbacks"] == [{"phase": phase, "pass": "failing_pass", "error": "deliberately broken pass"}]
    # That graph kept its markers (run by the eager runtime) and no lowered collective.
    assert out["markers"]["unshard" if phase == "forward" else "reduce_grad"] > 0
    assert out["collectives"]["all_gather"] == 0
    assert_bitwise(out["broken"], out["healthy"], "fallback vs healthy compile")


def test_failing_pass_raises_under_strict() -> None:
    out = run_workers(failing_pass_worker, 2, "forward", True, STEPS)[0]
    assert "fsdp_compile: pass 'failing_pass' failed: ValueError: deliberately broken pass on graph 0 (forward)" in out["error"]
