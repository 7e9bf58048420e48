"""Where every benchmark's results go: one JSON file (with the markdown table inside), and the table on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: str | Path, result: dict[str, Any], table: str) -> None:
    """Write `result` as JSON to `out` (folders made as needed), print `table` and the wall time."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(table)
    print(f"wall {result['wall_s']:.0f}s; written to {out}")
