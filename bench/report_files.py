"""Where every benchmark leaves its results: ``<stem>.json`` (the whole report) and ``<stem>.md``
(its table) under the output folder."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_facts() -> dict[str, str]:
    """When, on what machine, torch and commit a report's figures were measured (its header)."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "torch": torch.__version__, "commit": commit or "?"}


def write_report(out: str | Path, stem: str, report: dict, table: str) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)
