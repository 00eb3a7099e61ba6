"""The README's demo command trains, prints a loss per step and tokens/s, and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss (\d+\.\d+) \|\s+(\d+) tokens/s", re.M)


def run_demo(nproc: int, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "fsdp_compile_inductor")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "fsdp_compile.demo", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def check_training(stdout: str, steps: int) -> None:
    rows = [(int(s), float(loss), int(tps)) for s, loss, tps in STEP_LINE.findall(stdout)]
    assert [r[0] for r in rows] == list(range(1, steps + 1)), stdout
    assert all(tps > 0 for _, _, tps in rows)
    first, last = rows[0][1], rows[-1][1]
    assert last < 0.75 * first, f"loss did not go down: {first} -> {last}"
    assert re.search(r"tokens/s after the first step", stdout)


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [line for line in re.findall(r"```bash\n(.*?)```", quickstart, re.S)[0].splitlines()
            if line.strip() and not line.startswith("#")]


def test_readme_quickstart_has_two_commands_and_ci_runs_the_test_one() -> None:
    demo, tests = readme_commands()
    assert "fsdp_compile.demo" in demo and "pytest" in tests
    for command in (demo, tests):
        assert command.startswith('python -c "import torch" 2>/dev/null || pip install torch==2.13.0;')
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_demo_as_in_the_readme() -> None:
    demo, _ = readme_commands()
    args = demo.split("-m fsdp_compile.demo", 1)[1].split()
    steps = int(args[args.index("--steps") + 1])
    check_training(run_demo(2, *args), steps)


@pytest.mark.slow  # 20 s of four ranks; hybrid training is covered by the default parity and loop runs
def test_demo_hybrid_eager_runtime_on_four_ranks() -> None:
    stdout = run_demo(4, "--strategy", "hybrid_shard", "--shard-size", "2", "--no-compile", "--steps", "25")
    assert "HYBRID_SHARD, 4 ranks, eager runtime" in stdout
    check_training(stdout, 25)


def test_demo_rejects_an_unknown_strategy() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "fsdp_compile.demo", "--strategy", "zero3", "--steps", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "strategy='zero3' is not a sharding strategy" in proc.stdout + proc.stderr


def losses_by_step(stdout: str) -> dict[int, str]:
    return {int(step): loss for step, loss, _ in STEP_LINE.findall(stdout)}


# Three demo jobs; tests/test_training_loop.py holds saving, resuming and accumulation to the
# single-process results by default.
@pytest.mark.slow
def test_demo_saves_resumes_and_accumulates(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "checkpoint")
    common = ["--strategy", "FULL_SHARD", "--grad-accum", "2", "--layers", "1", "--seq-len", "32"]
    first = run_demo(2, *common, "--no-compile", "--steps", "3", "--save", checkpoint)
    assert f"saved checkpoint {checkpoint} at step 3" in first
    assert "2 micro-batches per step" in first
    resumed = run_demo(2, *common, "--no-compile", "--steps", "6", "--resume", checkpoint)
    assert "resumed from" in resumed and "after step 3" in resumed
    assert sorted(losses_by_step(resumed)) == [4, 5, 6]
    # Uninterrupted, and compiled: the resumed steps print the same losses (same data, model and
    # optimizer state; the eager runtime and aot_eager agree bit for bit).
    whole = run_demo(2, *common, "--compiler", "aot_eager", "--steps", "6")
    expected = losses_by_step(whole)
    assert losses_by_step(first) == {k: expected[k] for k in (1, 2, 3)}
    assert losses_by_step(resumed) == {k: expected[k] for k in (4, 5, 6)}
    assert float(expected[6]) < float(expected[1])


def test_demo_rejects_bad_training_loop_flags(capsys) -> None:
    import pytest

    from fsdp_compile.demo import parse_args

    for argv, message in ((["--grad-accum", "0"], "--grad-accum must be at least 1"),
                          (["--save-every", "2"], "--save-every needs --save DIR")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
