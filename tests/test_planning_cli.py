"""`python -m fsdp_compile plan` and `compare`: they run and say what they must."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: int = 900, env_extra: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    # the lab (lab/fsdp_compile_lab): compare --host fsdp_compile_lab:HostCPU
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "lab")))}
    for key, value in (env_extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, check=False, **kwargs)


def test_plan_command_prints_rows_and_writes_json(tmp_path: Path, capsys) -> None:
    from fsdp_compile.__main__ import main

    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "gpt-tiny", "--seq", "32", "--batch", "2", "--cluster", "a10g", "--nodes", "2",
                 "--prefetch", "1", "--strategies", "FULL_SHARD,HYBRID_SHARD", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "Plan for 16 devices of a10g" in stdout and "chosen:" in stdout
    data = json.loads(out.read_text())
    assert {r["strategy"] for r in data["rows"]} == {"FULL_SHARD", "HYBRID_SHARD"}
    assert data["best"]["chosen"] and data["max_batch"] == {}


def test_plan_command_plans_float8_training(tmp_path: Path, capsys) -> None:
    from fsdp_compile.__main__ import main

    bytes_per_step = {}
    for flag in ([], ["--float8"]):
        out = tmp_path / f"plan{len(flag)}.json"
        code = main(["plan", "--model", "gpt-tiny", "--seq", "32", "--batch", "2", "--cluster", "h100-sxm",
                     "--prefetch", "1", "--strategies", "FULL_SHARD", "--json", str(out), *flag])
        capsys.readouterr()
        assert code == 0
        bytes_per_step[bool(flag)] = json.loads(out.read_text())["best"]["bytes_per_step"]["intra"]
    assert bytes_per_step[True] < bytes_per_step[False]  # the linears gather in float8


class TokenStack(nn.Module):
    """A model the CLI builds from ``test_planning_cli:token_stack`` (``module:factory``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(3))
        self.head = nn.Linear(32, 128)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def token_stack() -> nn.Module:
    return TokenStack()


def _plan_json(tmp_path: Path, name: str, *args: str) -> dict:
    from fsdp_compile.__main__ import main

    out = tmp_path / f"{name}.json"
    assert main(["plan", "--seq", "32", "--batch", "2", "--cluster", "a10g", "--strategies", "FULL_SHARD",
                 "--prefetch", "1", *args, "--json", str(out)]) in (0, 1)
    return json.loads(out.read_text())


def test_plan_command_flags_reach_the_plan(tmp_path: Path) -> None:
    data = _plan_json(tmp_path, "factory", "--model", "test_planning_cli:token_stack", "--bucket", "module",
                      "--bucket", "0.25", "--memory-budget", "0.5", "--optimizer", "sgd", "--world-size", "4")
    assert data["model"] == "test_planning_cli:token_stack"
    assert data["parameters"] == sum(p.numel() for p in TokenStack().parameters())
    assert data["world_size"] == 4 and data["budget_bytes"] == 0.5 * (1 << 30)
    assert sorted(r["bucket"] for r in data["rows"]) == ["0.25MiB", "module"]
    for row in data["rows"]:
        assert row["model_states"]["optimizer"] == 0  # SGD keeps no state
        assert row["model_states"]["params"] == pytest.approx(data["parameters"] * 4 / 4, rel=0.05)  # world 4


def test_plan_command_layers_and_activation_checkpointing(tmp_path: Path) -> None:
    from fsdp_compile.planning.cli import build_model

    plain = _plan_json(tmp_path, "plain", "--model", "llama-tiny", "--layers", "3")
    checkpointed = _plan_json(tmp_path, "checkpointed", "--model", "llama-tiny", "--layers", "3",
                              "--activation-checkpointing")
    assert plain["parameters"] == sum(p.numel() for p in build_model("llama-tiny", layers=3, seq=32).parameters())
    assert plain["parameters"] > sum(p.numel() for p in build_model("llama-tiny", seq=32).parameters())
    (row,), (recomputed,) = plain["rows"], checkpointed["rows"]
    # Recomputing each block in backward keeps fewer activations and costs more compute.
    assert recomputed["memory"]["activations"] < row["memory"]["activations"]
    assert recomputed["compute_seconds"] > row["compute_seconds"]


def test_plan_command_names_a_factory_it_cannot_use() -> None:
    from fsdp_compile.__main__ import main

    with pytest.raises(SystemExit, match="--model test_planning_cli:nowhere: cannot import 'nowhere'"):
        main(["plan", "--model", "test_planning_cli:nowhere"])
    with pytest.raises(SystemExit, match="the factory returned int, not an nn.Module"):
        main(["plan", "--model", "test_planning_cli:_not_a_model"])


def _not_a_model() -> int:
    return 3


def test_plan_command_rejects_unknown_model_and_cluster(capsys) -> None:
    from fsdp_compile.__main__ import main

    with pytest.raises(SystemExit, match="use one of"):
        main(["plan", "--model", "gpt-9000"])
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "tpu"]) == 2
    assert "error: unknown cluster preset 'tpu'" in capsys.readouterr().err


def test_compare_needs_torchrun(monkeypatch) -> None:
    from fsdp_compile.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="start it with torchrun"):
        main(["compare"])


PROFILER_LINES = ("USDT:", "profiler_start", "profiler_stop", "SyncActivityProfilerHandler")


# -m slow: compare end to end under torchrun calibrates the machine first (half a minute on 2 cores);
# the default run checks compare's timing and collector in-process (the tests below).
@pytest.mark.slow
def test_compare_prints_its_table_without_the_profilers_logging(tmp_path: Path) -> None:
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fsdp_compile",
                 "compare", "--model", "gpt-tiny", "--steps", "3", "--batch", "2", "--seq", "16",
                 "--strategies", "FULL_SHARD", "--gc-during-steps", "--host", "fsdp_compile_lab:HostCPU",
                 "--out", str(tmp_path)], timeout=900)
    # The reference timed beside the steps is the host model's (the lab's): --host asks for it.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step ms" in proc.stdout and "FULL_SHARD" in proc.stdout
    noise = [line for line in proc.stderr.splitlines() if any(word in line for word in PROFILER_LINES)]
    assert noise == [], noise[:4]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["gc_between_steps"] is False
    # predicted at the speed compute_scale's reference ran at beside the steps, not the calibration's
    (row,) = data["rows"]
    scales, at_calibration = row["compute_scale"], row["predicted_at_calibration"]
    assert row["measured"]["reference_seconds"] > 0
    # the reference is gpt-tiny's own forward and backward, which the step holds beside its optimizer and
    # collectives (the calibration's one-block GPT of d_model 256 takes several times this step)
    assert row["measured"]["reference_seconds"] < row["measured"]["cpu_seconds"], row["measured"]
    assert scales["beside_steps"] != scales["at_calibration"]  # two timings of a CPU never agree to the bit
    assert "predicted at the machine's speed beside each strategy's steps" in proc.stdout
    # the optimizer and runtime fits are timed beside the steps too, and the plan uses those
    outside = row["outside_graphs"]
    (adamw_beside,) = outside["beside_steps"]["optimizer_step"].values()
    adamw_at_calibration = outside["at_calibration"]["optimizer_step"]["adamw"]
    assert adamw_beside[0] > 0 and outside["beside_steps"]["runtime_per_tensor"] > 0
    assert adamw_beside != adamw_at_calibration
    moved = row["predicted"]["compute_seconds"] - at_calibration["compute_seconds"]
    assert moved != 0
    # The plan's compute holds the graphs (times compute_scale) and the optimizer and runtime
    # outside them: where every number moved the same way, so did the prediction. (gpt-tiny's
    # graphs are small beside its optimizer: a faster AdamW can outweigh a slower compute_scale.)
    changes = [scales["beside_steps"] - scales["at_calibration"],
               *(b - c for b, c in zip(adamw_beside, adamw_at_calibration)),
               outside["beside_steps"]["runtime_per_tensor"] - outside["at_calibration"]["runtime_per_tensor"]]
    if all(c > 0 for c in changes) or all(c < 0 for c in changes):
        assert (moved > 0) == (changes[0] > 0), (moved, changes)


def test_the_profiler_speaks_only_when_asked() -> None:
    # The control for the test above: the same profile prints kineto's lines when the user asks
    # for them (KINETO_LOG_LEVEL), so their absence there is the tools' doing.
    code = ("import torch\n"
            "from fsdp_compile.planning.calibration.allocator import _allocated_peak\n"
            "_allocated_peak(lambda: torch.ones(8).sum(), torch.device('cpu'))\n")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two processes, side by side
        quiet, asked = pool.map(lambda level: _run(["-c", code], timeout=300, env_extra={"KINETO_LOG_LEVEL": level}),
                                (None, "5"))
    assert quiet.returncode == asked.returncode == 0, (quiet.stderr, asked.stderr)
    assert not any(word in quiet.stderr for word in PROFILER_LINES), quiet.stderr
    assert "profiler_start" in asked.stderr


def gc_worker(rank: int, world: int) -> dict:
    """Whether Python's collector was on while each step's loss was computed, with the collector
    kept to the gaps between steps (compare's default) and left on (--gc-during-steps)."""
    import gc

    import torch.nn.functional as F

    from fsdp_compile.planning.cli import build_model
    from fsdp_compile.planning.compare import measure_strategy

    seen: dict[bool, list[bool]] = {}
    for between in (True, False):
        torch._dynamo.reset()
        seen[between] = []

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor, log: list = seen[between]) -> torch.Tensor:
            log.append(gc.isenabled())
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        def build() -> nn.Module:
            torch.manual_seed(0)
            return build_model("gpt-tiny", seq=8, device="cpu")

        data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(rank))
        batches = [((data[:, :-1],), data[:, 1:])] * 3
        measure_strategy("FULL_SHARD", build, batches, loss_fn, gc_between_steps=between)
    return {"enabled": gc.isenabled(), "seen": seen}


def test_compare_keeps_the_collector_out_of_the_timed_steps_unless_asked() -> None:
    from distributed import run_workers

    for out in run_workers(gc_worker, 2):
        assert out["enabled"]  # the caller's collector state comes back
        # 3 timed steps and the profiled one
        assert out["seen"][True] == [False, False, False, True]
        assert out["seen"][False] == [True] * 4


def _tiny_steps(rank: int, loss_fn, **kwargs):
    """``measure_strategy`` over five steps (two warm up) of a tiny GPT, this rank's batch."""
    from fsdp_compile.planning.cli import build_model
    from fsdp_compile.planning.compare import measure_strategy

    def build() -> nn.Module:
        torch.manual_seed(0)
        return build_model("gpt-tiny", seq=8, device="cpu")

    data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(rank))
    return measure_strategy("FULL_SHARD", build, [((data[:, :-1],), data[:, 1:])] * 5, loss_fn, warmup=2, **kwargs)


def network_window_worker(rank: int, world: int) -> list[str]:
    """The order of compare's steps and its calls on the network: its statistics must cover the
    timed steps alone (warm-up steps compile, and ranks drift apart by seconds there, which the
    emulation would count as gloo overrunning the link)."""
    import torch.nn.functional as F

    log: list[str] = []

    class Stats:
        def to_dict(self) -> dict:
            return {"overruns": {}}

        def overrun_summary(self) -> str:
            return "held"

    class Network:
        def reset_stats(self) -> None:
            log.append("reset")

        def stats(self) -> Stats:
            log.append("stats")
            return Stats()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log.append("step")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    measured = _tiny_steps(rank, loss_fn, network=Network())
    assert measured.network == {"overruns": {}, "summary": "held"}
    assert len(measured.steady_step_times) == 3
    return log


def test_compare_reads_the_network_over_the_timed_steps_alone() -> None:
    from distributed import run_workers

    for log in run_workers(network_window_worker, 2):
        # two warm-up steps, the window, three timed steps, the statistics, the profiled step
        assert log == ["step", "step", "reset", "step", "step", "step", "stats", "step"], log


def reference_worker(rank: int, world: int) -> dict:
    """compare times compute_scale's reference after every timed step, on the compute clock."""
    import torch.nn.functional as F

    log: list[str] = []

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log.append("step")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def reference() -> None:
        log.append("reference")
        time.sleep(0.05)  # off the compute clock: not counted
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass

    measured = _tiny_steps(rank, loss_fn, reference=reference)
    return {"log": log, "seconds": measured.reference_seconds,
            "without": _tiny_steps(rank, loss_fn).reference_seconds}


def test_compare_times_the_reference_after_every_timed_step() -> None:
    from distributed import run_workers

    for out in run_workers(reference_worker, 2):
        # two warm-up steps, three timed steps each followed by the reference, the profiled step
        assert out["log"][:9] == ["step", "step", "step", "reference", "step", "reference", "step", "reference",
                                  "step"], out["log"]
        assert 0.02 <= out["seconds"] < 0.05  # the thread's CPU, not the wall clock's sleep
        assert out["without"] is None


def unlimited_too_worker(rank: int, world: int) -> dict:
    """compare --exposed: every timed step also runs on unlimited links, alternating which comes
    first, and the network's statistics count the emulated steps alone."""
    import math
    from types import SimpleNamespace

    import torch.nn.functional as F

    from fsdp_compile.network.stats import StatsRecorder

    log: list[str] = []
    recorder = StatsRecorder()
    emulated = {"intra": SimpleNamespace(bandwidth=5e7, latency=2e-5),
                "inter": SimpleNamespace(bandwidth=5e6, latency=2e-5)}

    class Network:
        def __init__(self) -> None:
            self.links_now = dict(emulated)

        def links(self) -> dict:
            return dict(self.links_now)

        def set_links(self, intra_node: float, inter_node: float, latency: float) -> None:
            self.links_now = {"intra": SimpleNamespace(bandwidth=intra_node, latency=latency),
                              "inter": SimpleNamespace(bandwidth=inter_node, latency=latency)}

        def reset_stats(self) -> None:
            log.append("reset")
            recorder.reset()

        def stats(self):
            log.append("stats")
            return recorder.snapshot()

    network = Network()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        unlimited = math.isinf(network.links_now["intra"].bandwidth)
        log.append("unlimited" if unlimited else "emulated")
        recorder.issued("all_gather", "intra", 1.0, 1, 0.0)  # unlimited steps' would be counted too if read
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    measured = _tiny_steps(rank, loss_fn, network=network, unlimited_too=True)
    restored = {k: (v.bandwidth, v.latency) for k, v in network.links_now.items()}
    return {"log": log, "network": measured.network, "unlimited": measured.unlimited_step_times,
            "median": measured.unlimited_step_seconds, "timed": measured.steady_step_times,
            "restored": restored == {k: (v.bandwidth, v.latency) for k, v in emulated.items()},
            "as_dict": measured.as_dict()["unlimited_step_seconds"], "exposed": measured.exposed_seconds,
            "interval": measured.exposed_interval}


def test_compare_exposed_runs_each_timed_step_on_unlimited_links_too() -> None:
    from distributed import run_workers

    for out in run_workers(unlimited_too_worker, 2):
        log = [entry for entry in out["log"] if entry != "stats"]
        # warm-up on the network; then pairs, the emulated step first, second, first; the profiled
        # step on the network again: the links are put back after every pair
        assert log == ["emulated", "emulated", "reset",
                       "reset", "emulated", "unlimited",
                       "unlimited", "reset", "emulated",
                       "reset", "emulated", "unlimited",
                       "emulated"], log
        assert out["network"]["usage"]["all_gather/intra"]["count"] == 3  # the emulated steps alone
        assert len(out["unlimited"]) == len(out["timed"]) == 3 and out["restored"]
        assert out["median"] == out["as_dict"] == sorted(out["unlimited"])[1]
        differences = sorted(a - b for a, b in zip(out["timed"], out["unlimited"]))
        assert out["exposed"] == differences[1] and out["interval"] is None  # 3 pairs: too few for one


def test_unlimited_steps_need_the_network() -> None:
    from fsdp_compile.planning.compare import measure_strategy

    with pytest.raises(ValueError, match="pass the EmulatedNetwork"):
        measure_strategy("FULL_SHARD", nn.Linear, [], None, unlimited_too=True)


def test_compare_exposed_needs_an_emulated_network(monkeypatch) -> None:
    from fsdp_compile.__main__ import main

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="--exposed compares an emulated network with unlimited links: add --emulate"):
        main(["compare", "--exposed"])
    with pytest.raises(SystemExit, match=r"which a host model times \(its unlimited_links\): add --host"):
        main(["compare", "--exposed", "--emulate", "1GB/s"])


def _measured(name: str, steps_ms: list[float]):
    from fsdp_compile.planning.measured import Measured

    times = [1.0, 1.0] + [t / 1e3 for t in steps_ms]  # two warm-up steps first
    return Measured(name, sorted(times[2:])[len(steps_ms) // 2], times, 0.0, 1.0, 1.0, 1.0, {})


def test_compare_says_which_strategies_are_within_noise() -> None:
    from fsdp_compile.planning.measured import step_range, within_noise

    a = _measured("FULL_SHARD", [10, 11, 12, 13, 30])
    b = _measured("NO_SHARD", [12.5, 13, 14, 15, 16])
    c = _measured("SHARD_GRAD_OP", [20, 21, 22, 23, 24])
    assert step_range(a) == pytest.approx((0.011, 0.013))  # the middle half: the warm-up and the outlier left out
    lines = within_noise({"FULL_SHARD": a, "NO_SHARD": b, "SHARD_GRAD_OP": c})
    assert len(lines) == 1 and lines[0].startswith("FULL_SHARD and NO_SHARD are within noise"), lines


def test_exposed_communication_is_the_median_of_paired_differences() -> None:
    from fsdp_compile.planning.measured import median_interval

    # the machine's speed swings between pairs, both steps of a pair alike: 10 ms apart, except
    # the last pair, whose unlimited step was disturbed alone
    unlimited = [100, 200, 100, 200, 100, 200, 300]
    steps = [110, 210, 110, 210, 110, 210, 120]
    measured = _measured("FULL_SHARD", steps)
    measured.unlimited_step_times = [t / 1e3 for t in unlimited]
    assert measured.exposed_seconds == pytest.approx(0.010)
    # the difference of the two medians: the swing and the one disturbed step make it -80 ms
    assert measured.step_seconds - measured.unlimited_step_seconds == pytest.approx(-0.080)
    assert measured.exposed_interval == pytest.approx((-0.180, 0.010))  # 7 pairs: the smallest and largest
    assert measured.as_dict()["exposed_seconds"] == measured.exposed_seconds

    # a distribution-free interval of the median: the k-th smallest and largest, k from the binomial
    assert median_interval(range(5)) is None  # even the range holds the median with 94% only
    assert median_interval(range(10)) == (1, 8)  # P(Binomial(10, 1/2) <= 1) = 1.1%
    assert median_interval(range(30)) == (9, 20)  # P(Binomial(30, 1/2) <= 9) = 2.1%, <= 10: 4.9%
    assert median_interval(range(30), confidence=0.5) == (12, 17)


def test_compare_defaults_to_enough_steps_for_a_median() -> None:
    import argparse

    from fsdp_compile.planning.cli import add_compare_parser

    parser = argparse.ArgumentParser()
    add_compare_parser(parser.add_subparsers())
    steps = parser.parse_args(["compare"]).steps
    assert steps - 2 >= 10, steps  # two warm up; a median of at least ten steps


@pytest.mark.slow
def test_plan_command_solves_the_largest_batch(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = _run(["-m", "fsdp_compile", "plan", "--model", "gpt-tiny", "--seq", "32", "--batch", "2",
                 "--cluster", "a10g", "--prefetch", "1", "--strategies", "FULL_SHARD", "--max-batch",
                 "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "largest batch FULL_SHARD fits:" in proc.stdout
    assert json.loads(out.read_text())["max_batch"]["FULL_SHARD"] > 2


@pytest.mark.slow
def test_compare_runs_strategies_and_writes_json_and_chart(tmp_path: Path) -> None:
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fsdp_compile",
                 "compare", "--model", "gpt-tiny", "--steps", "3", "--strategies", "FULL_SHARD,NO_SHARD",
                 "--host", "fsdp_compile_lab:HostCPU", "--out", str(tmp_path)], timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [r["strategy"] for r in data["rows"]] == ["FULL_SHARD", "NO_SHARD"]
    for row in data["rows"]:
        m, p = row["measured"], row["predicted"]
        assert m["step_seconds"] > 0 and m["peak_bytes"] > m["resident_bytes"] > 0 and m["compile_seconds"] >= 0
        assert m["bytes_per_step"]["intra"] > 0 and m["backend_bytes_per_step"] > 0 and p["step_seconds"] > 0
        assert m["bytes_per_step"]["intra"] == pytest.approx(p["bytes_per_step"]["intra"], rel=0.01)
        # how much of the step the machine gave to other work is recorded beside it (Linux /proc)
        assert m["cpu_seconds"] > 0 and 0.0 <= m["cpu_wait_fraction"] <= 1.0 and m["load_average"] >= 0
        # the main thread's wait for a core, against the gloo CPU the plan charges to compute
        assert 0.0 <= m["core_wait_seconds"] <= m["step_seconds"]
        assert 0.0 < p["backend_cpu_seconds"] <= p["exposed_comm_seconds"]
    assert (tmp_path / "compare.png").stat().st_size > 1000
    assert "step ms" in proc.stdout and "pred ms" in proc.stdout and "core wait ms" in proc.stdout


@pytest.mark.slow
def test_accuracy_benchmark_runs_at_smoke_size(tmp_path: Path) -> None:
    proc = _run([str(ROOT / "bench" / "plan_accuracy.py"), "--smoke", "--steps", "3", "--out", str(tmp_path)],
                timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "plan_accuracy_smoke.json").read_text())
    assert {r["strategy"] for r in data["accuracy"]["runs"]} == {"FULL_SHARD", "NO_SHARD"}
    assert [r["strategy"] for r in data["zero"]["rows"]] == ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]
    depths = {name: r["depth"] for name, r in data["a10g"]["rows"].items()}
    assert depths["NO_SHARD"] < depths["SHARD_GRAD_OP"] <= depths["FULL_SHARD"]
    assert data["scale"]["plan_seconds"] > 0 and data["scale"]["peak_rss_bytes"] > 0
    (att,) = data["attribution"]["models"]
    assert att["by_kind"]["matmul"]["measured_s"] > 0 and att["predicted_s"] > 0
    text = (tmp_path / "plan_accuracy_smoke.md").read_text()
    assert "ZeRO paper" in text and "## Measured on the CPU (" in text
    assert "Deepest model per strategy on one G5.48xlarge" in text
    assert "Where the compute time goes" in text and "Scale: Llama-3-70B" in text


def test_thread_times_tell_a_blocked_main_thread_from_one_on_a_cpu() -> None:
    from fsdp_compile.planning.compare import thread_times

    before = thread_times()
    if before is None:
        pytest.skip("no /proc schedstat on this system")
    time.sleep(0.2)  # blocked: neither on a CPU nor waiting for one
    slept = thread_times()
    assert slept.main_on_cpu - before.main_on_cpu < 0.05 and slept.main_waiting - before.main_waiting < 0.05
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
    spun = thread_times()
    assert spun.main_on_cpu - slept.main_on_cpu >= 0.19
    # another thread's CPU (gloo's, in a step) is counted apart from the main thread's while
    # that thread lives (gloo's live as long as the process group)
    import threading

    spun_once, done = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun_once.set()
        done.wait()

    worker = threading.Thread(target=spin)
    worker.start()
    spun_once.wait()
    after = thread_times()
    done.set()
    worker.join()
    assert after.others_on_cpu - spun.others_on_cpu >= 0.19
    assert after.main_on_cpu - spun.main_on_cpu < 0.05


def test_step_split_sets_the_main_threads_time_against_the_plans() -> None:
    from fsdp_compile.planning.cli import step_split

    measured = {"step_seconds": 0.18, "cpu_seconds": 0.14, "core_wait_seconds": 0.02}
    predicted = {"compute_seconds": 0.13, "exposed_comm_seconds": 0.03, "backend_cpu_seconds": 0.02}
    split = step_split(measured, predicted)
    assert split["compute"] == (0.14, 0.13) and split["core_wait"] == (0.02, 0.02)
    assert split["blocked"] == pytest.approx((0.02, 0.01))
    assert step_split({**measured, "core_wait_seconds": None}, predicted) is None  # no /proc
    assert "backend_cpu" not in split  # the other threads were not timed
    # gloo's CPU against the plan's charge as CPU: at world 4 on 2 cores the charge is that CPU
    # stretched by the rank's half share of a core, so the like-for-like figure is half of it
    timed = {**measured, "others_cpu_seconds": 0.012}
    assert step_split(timed, predicted)["backend_cpu"] == (0.012, 0.02)
    assert step_split(timed, predicted, cpu_share=0.5)["backend_cpu"] == (0.012, 0.01)
