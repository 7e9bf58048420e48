"""Where every benchmark's results go: one JSON file (with the markdown table inside), and the table on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any


def merge_rows(out: str | Path, fresh: list[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable]) -> list[dict[str, Any]]:
    """The rows of the results already at `out` that `fresh` does not replace (same `key`), then `fresh`: so a
    benchmark may rerun some of its rows and keep the others."""
    kept = json.loads(Path(out).read_text())["rows"] if Path(out).exists() else []
    replaced = {key(r) for r in fresh}
    return [r for r in kept if key(r) not in replaced] + fresh


def write_results(out: str | Path, result: dict[str, Any], table: str) -> None:
    """Write `result` as JSON to `out` (folders made as needed), print `table` and the wall time."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(table)
    print(f"wall {result['wall_s']:.0f}s; written to {out}")
