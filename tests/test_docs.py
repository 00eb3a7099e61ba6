"""The README and the manual (docs/*.md) cannot drift from the code.

Every fenced block of README.md and docs/*.md says what it is by its info string: ``python``,
``bash`` or ``text`` (output and listings, not run). Python and shell blocks run as written:

* a Python block runs in a job of two processes (``torchrun --nproc_per_node 2``), after the
  setup block of docs/index.md ("Running the examples"), each in a fresh namespace, all in one
  job to keep the test fast. The job already has its process group, so an example's own
  ``dist.init_process_group`` / ``dist.destroy_process_group`` calls do nothing there, and the
  backend compiles with ``aot_eager`` unless the example names a compiler (Inductor compiles a
  model in about a minute on 2 cores; the Inductor path has its own tests);
* a Python block marked ``<!-- one-process -->`` runs in a plain process, without the setup;
* a shell block runs with bash in the job's working directory, after the Python blocks (so it
  sees what they wrote, such as a dump).

A block that cannot run here carries a marker, an HTML comment on the line before its fence,
and is named in this file with the same reason, so every skip is visible in both places:
``<!-- skip: why -->`` (never run here: a GPU, a cluster, hours), ``<!-- slow: why -->`` (runs
with ``-m slow``), ``<!-- fragment: why -->`` (not a whole example; only parsed), and
``<!-- needs: module.attribute -->`` (runs where that attribute exists). Blocks are named
``file#heading``, with ``-2``, ``-3`` ... for later blocks under the same heading.

Besides the blocks: every relative link resolves (file and anchor), every ``bench/results/``,
``tests/`` and ``bench/`` path the pages name exists, every test they name as
``tests/file.py::test_name`` is defined in that file, the pipeline table of docs/design.md is
``PIPELINE``'s, and the README stays a front page.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = "docs/index.md#running-the-examples"

# Blocks never run here, by name, with the reason the page gives.
SKIPPED = {
    "README.md#quickstart": "the Quickstart's two commands: tests/test_demo.py runs the demo's as written, "
                            ".ci/run runs the test command (the whole suite)",
    "docs/troubleshooting.md#restartable-training-with-torchrun":
        "trains the demo for its default 40 steps with Inductor; tests/test_reliability.py kills and restarts it",
    "docs/tensor-parallel.md#usage": "needs 4 processes (dp 2 x tp 2); tests/test_tensor_parallel.py runs it",
    "docs/planning.md#the-command-line":
        "plans a 70B model for 512 GPUs: about two minutes and 1.3 GiB of memory on a CPU",
}
# Blocks that run only with -m slow.
SLOW = {
    "docs/planning.md#strategyauto": "calibrates the CPU with Cluster.measure() before planning: about a minute",
    "docs/planning.md#the-command-line-2": "plans a 6.7B-parameter GPT: about two minutes on a CPU",
    "docs/planning.md#the-command-line-3":
        "a fresh process that plans: tests/test_planning_cli.py runs the command line in the default run",
    "docs/planning.md#the-command-line-4": "compiles and runs every strategy, after calibrating the CPU",
    "docs/planning.md#choosing-the-tensor-parallel-degree": "traces a Llama at three TP degrees: about a minute on a CPU",
}
# Blocks that are not whole examples: only parsed.
FRAGMENTS = {
    "docs/overlap.md#an-emulated-network": "the network must exist before the job's default process group, which the "
                                           "docs job already has; tests/test_network_distributed.py runs this under "
                                           "torchrun",
    "docs/tensor-parallel.md#usage-2": "continues the example above, with 8 processes; "
                                       "tests/test_tensor_parallel.py runs it",
    "docs/overlap.md#an-emulated-network-2": "continues the example above, after the warm-up steps",
}
# Blocks that run only where the named attribute exists.
NEEDS = {
    "docs/troubleshooting.md#training-diverges-or-the-loss-looks-wrong": "fsdp_compile.GradientMismatch",
}
MARKED = {"skip": SKIPPED, "slow": SLOW, "fragment": FRAGMENTS, "needs": NEEDS}
LANGUAGES = ("python", "bash", "text")
JOB_TIMEOUT_S = 600


@dataclasses.dataclass
class Block:
    name: str
    page: str
    line: int
    lang: str
    code: str
    marker: str | None = None  # skip, slow, fragment, needs, one-process
    reason: str = ""


MARKER = re.compile(r"<!--\s*(skip|slow|fragment|needs|one-process)(?::\s*(.*?))?\s*-->")
FENCE = re.compile(r"^(\s*)```(.*)$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.*)", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def parse(path: Path) -> list[Block]:
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    section, per_section = "", {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"#{1,6}\s+(.*)", line):
            section = slug(m.group(1))
        fence = FENCE.match(line)
        if not fence:
            i += 1
            continue
        lang = fence.group(2).strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
        per_section[section] = per_section.get(section, 0) + 1
        n = per_section[section]
        name = f"{rel}#{section}" + (f"-{n}" if n > 1 else "")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = MARKER.fullmatch(before.strip())
        kind, reason = marked.groups() if marked else (None, None)
        blocks.append(Block(name, rel, i + 1, lang, code, kind, reason or ""))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page)]
BY_NAME = {b.name: b for b in BLOCKS}


def _available(dotted: str) -> bool:
    module, _, attr = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


def _runs_in_job(b: Block) -> bool:
    return b.lang == "python" and (b.marker is None or (b.marker == "needs" and _available(b.reason)))


def _runs_alone(b: Block) -> bool:
    return b.lang == "python" and b.marker == "one-process"


def _runs_in_shell(b: Block) -> bool:
    return b.lang == "bash" and b.marker is None


DEFAULT_RUN = [b.name for b in BLOCKS
               if b.name != SETUP and b.marker != "needs" and (_runs_in_job(b) or _runs_alone(b) or _runs_in_shell(b))]


# ------------------------------------------------------------------ what the blocks are
def test_every_block_says_what_it_is() -> None:
    unknown = [f"{b.name} (line {b.line}): {b.lang!r}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"fenced blocks must be one of {LANGUAGES}: {unknown}"
    assert SETUP in BY_NAME and BY_NAME[SETUP].marker is None


def test_every_marked_block_is_named_here_with_its_reason() -> None:
    for kind, named in MARKED.items():
        in_pages = {b.name: b.reason for b in BLOCKS if b.marker == kind}
        assert in_pages == named, f"<!-- {kind}: ... --> blocks in the pages and {kind.upper()} here differ"


def test_blocks_not_run_here_still_parse() -> None:
    for b in BLOCKS:
        if b.marker in ("skip", "slow", "fragment") or (b.marker == "needs" and not _available(b.reason)):
            if b.lang == "python":
                compile(b.code, b.name, "exec")
            elif b.lang == "bash":
                proc = subprocess.run(["bash", "-n"], input=b.code, text=True, capture_output=True, check=False)
                assert proc.returncode == 0, (b.name, proc.stderr)


# ------------------------------------------------------------------ running them
RUNNER = r'''
import datetime, json, sys, time, traceback
import torch
import torch.distributed as dist

blocks = json.load(open(sys.argv[1]))
setup = blocks.pop(0)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
# The job has its group already: the examples' own calls to these do nothing.
dist.init_process_group = lambda *args, **kwargs: None
dist.destroy_process_group = lambda *args, **kwargs: None

import fsdp_compile

_init = fsdp_compile.FSDPBackend.__init__


def _init_aot_eager(self, *args, **kwargs):
    kwargs.setdefault("compiler", "aot_eager")
    _init(self, *args, **kwargs)


fsdp_compile.FSDPBackend.__init__ = _init_aot_eager
results = {}
for block in blocks:
    torch._dynamo.reset()
    namespace = {"__name__": "__main__"}
    started = time.time()
    try:
        exec(compile(setup["code"], setup["name"], "exec"), namespace)
        exec(compile(block["code"], block["name"], "exec"), namespace)
        results[block["name"]] = {"ok": True}
    except BaseException:
        results[block["name"]] = {"ok": False, "error": traceback.format_exc()}
    results[block["name"]]["seconds"] = time.time() - started
    with open(f"{sys.argv[2]}.rank{rank}.json", "w") as f:
        json.dump(results, f)
'''

ALONE = r'''
import json, sys, time, traceback
import torch

results = {}
for block in json.load(open(sys.argv[1])):
    torch._dynamo.reset()
    started = time.time()
    try:
        exec(compile(block["code"], block["name"], "exec"), {"__name__": "__main__"})
        results[block["name"]] = {"ok": True}
    except BaseException:
        results[block["name"]] = {"ok": False, "error": traceback.format_exc()}
    results[block["name"]]["seconds"] = time.time() - started
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
'''


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _payload(blocks: list[Block]) -> list[dict]:
    return [{"name": b.name, "code": b.code} for b in blocks]


def run_in_job(blocks: list[Block], workdir: Path) -> tuple[dict, str]:
    """Run ``blocks`` in one job of two processes; returns each block's result (rank 0's, or the
    first failing rank's) and the job's output."""
    (workdir / "blocks.json").write_text(json.dumps(_payload([BY_NAME[SETUP], *blocks])))
    (workdir / "runner.py").write_text(RUNNER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "runner.py", "blocks.json", "results"]
    proc = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          check=False)
    results: dict = {}
    for rank in (1, 0):
        path = workdir / f"results.rank{rank}.json"
        for name, result in (json.loads(path.read_text()) if path.exists() else {}).items():
            if name not in results or not result["ok"]:
                results[name] = result
    return results, proc.stdout[-4000:] + proc.stderr[-4000:]


def start_alone(blocks: list[Block], workdir: Path) -> subprocess.Popen:
    """Start running ``blocks`` one after another in a plain process (see :func:`finish_alone`)."""
    (workdir / "alone.json").write_text(json.dumps(_payload(blocks)))
    (workdir / "alone.py").write_text(ALONE)
    return subprocess.Popen([sys.executable, "alone.py", "alone.json", "alone_results.json"], cwd=workdir,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_alone(proc: subprocess.Popen, workdir: Path) -> tuple[dict, str]:
    output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    path = workdir / "alone_results.json"
    return (json.loads(path.read_text()) if path.exists() else {}), output[-8000:]


def run_shell(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=workdir, env=_env(),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, dict]:
    """Every block of the default run, run once: the one-process blocks beside the job's (the
    job's two ranks leave a core idle whenever they wait on each other), then the shell blocks,
    which may read what the job wrote."""
    workdir = tmp_path_factory.mktemp("docs")
    results: dict[str, dict] = {}
    alone = [b for b in BLOCKS if _runs_alone(b)]
    running_alone = start_alone(alone, workdir)
    in_job = [b for b in BLOCKS if b.name != SETUP and _runs_in_job(b)]
    job, output = run_in_job(in_job, workdir)
    for b in in_job:
        results[b.name] = job.get(b.name, {"ok": False, "error": f"no result; the job's output:\n{output}"})
    ran_alone, output = finish_alone(running_alone, workdir)
    for b in alone:
        results[b.name] = ran_alone.get(b.name, {"ok": False, "error": f"no result; the output:\n{output}"})
    for b in (b for b in BLOCKS if _runs_in_shell(b)):
        proc = run_shell(b, workdir)
        results[b.name] = {"ok": proc.returncode == 0, "error": proc.stdout[-3000:] + proc.stderr[-3000:]}
    return results


@pytest.mark.parametrize("name", DEFAULT_RUN)
def test_block_runs(name: str, ran: dict[str, dict]) -> None:
    result = ran[name]
    assert result["ok"], f"{name} (line {BY_NAME[name].line}) failed:\n{result['error']}"


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_block_that_needs_a_newer_package(name: str, ran: dict[str, dict]) -> None:
    if not _available(NEEDS[name]):
        pytest.skip(f"{NEEDS[name]} does not exist in this checkout")
    assert ran[name]["ok"], f"{name} failed:\n{ran[name]['error']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_block_runs(name: str, tmp_path: Path) -> None:
    b = BY_NAME[name]
    if b.lang == "bash":
        proc = run_shell(b, tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return
    results, output = run_in_job([b], tmp_path)
    assert results.get(name, {}).get("ok"), results.get(name, {}).get("error", output)


# ------------------------------------------------------------------ links and named files
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# A path may name a file that left the tree as ``<commit>:<path>`` (read with ``git show``).
NAMED_PATH = re.compile(r"(?<![\w/.])((?:[0-9a-f]{7,40}:)?(?:bench|tests|fsdp_compile)/[\w./{},*-]*[\w/])")
NAMED_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def in_git_at(commit: str, path: str) -> bool:
    """Whether git holds ``path`` at ``commit``; true without a history to ask (a source tarball)."""
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode:
        return True
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True)
    return found.returncode == 0


def test_every_file_the_pages_name_exists() -> None:
    missing = []
    for page in PAGES:
        for named in NAMED_PATH.findall(page.read_text()):
            if any(c in named for c in "{}*"):
                continue
            commit, _, path = named.rpartition(":")
            if not (in_git_at(commit, path) if commit else (ROOT / path).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {named}")
    assert not missing, "\n".join(missing)


def test_every_test_the_pages_name_exists() -> None:
    # docs/limits.md names the test that shows each known defect: a renamed test must not leave
    # the page pointing at nothing.
    missing = []
    for page in PAGES:
        for path, name in NAMED_TEST.findall(page.read_text()):
            source = ROOT / path
            if not source.exists() or not re.search(rf"^(async )?def {name}\(", source.read_text(), re.M):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{name}")
    assert not missing, "\n".join(missing)


def test_the_design_notes_list_the_pipeline_as_declared() -> None:
    from fsdp_compile.api import OPTIONAL_PASSES
    from fsdp_compile.passes.stages import PIPELINE

    text = (ROOT / "docs" / "design.md").read_text().split("## The pipeline", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| (\w+) \| `(\w+)` \|", text, re.M)
    assert listed == [(p.stage, p.name) for p in PIPELINE]
    optional = text.split("`disable_passes=` may switch off", 1)[1].split(";", 1)[0]
    assert tuple(re.findall(r"`(\w+)`", optional)) == OPTIONAL_PASSES


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the manual (docs/) takes the rest"


def test_every_backend_option_is_documented_once_in_the_docstring_help_shows() -> None:
    # The manual points to help(fsdp_compile.backend) instead of copying the option list; that
    # docstring is FSDPBackend's, whose Args: must name every parameter the backend takes.
    import inspect

    import fsdp_compile

    doc = fsdp_compile.backend.__doc__
    assert doc.count("Args:") == 1
    options = [name for name in inspect.signature(fsdp_compile.FSDPBackend).parameters if name != "strategy"]
    missing = [name for name in options if f"\n    {name}: " not in doc and f"\n        {name}: " not in doc]
    assert not missing, f"options without an Args: entry: {missing}"
