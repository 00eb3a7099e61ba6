"""Where every benchmark leaves its results: ``<stem>.json`` (the whole report) and ``<stem>.md``
(its table) under the output folder."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path, stem: str, report: dict, table: str) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)
