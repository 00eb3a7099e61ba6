"""The benchmark scripts run (tiny sizes, any device): they must not rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_copy_in_benchmark_runs(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "copy_in_kernel.py"), "--smoke", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "copy_in_smoke.json").read_text())
    assert [r["params"] for r in report["rows"]] == [16, 16, 64, 64, 256, 256]
    assert all(r["ours_us"] > 0 and r["fsdp2_us"] > 0 for r in report["rows"])
    assert "| params | dtype |" in (tmp_path / "copy_in_smoke.md").read_text()
