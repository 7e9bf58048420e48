"""The configuration reference (docs/configuration.md) documents exactly the keys the parser accepts.

The parser's one list of accepted keys is ``CONFIG_KEYS`` in crossdc/experiment/config.py (its own key checks use
it). Each key has a row in one of the page's tables, its first cell the key with its table in backticks
(``run.rounds``, ``datacenters.link.rtt_ms``; a top-level section as ``[run]`` / ``[[datacenters]]``), and every
cell of the row filled: type, default, meaning, the error a bad value gets. A key the parser accepts without a row
fails here, and so does a row for a key the parser does not accept. The checks are shown to fail on a parser with
one more key.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from crossdc.experiment import config as config_module
from crossdc.experiment.config import CONFIG_KEYS, LIMITS, ConfigError, parse_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")
COLUMNS = ["key", "type", "default", "meaning", "a bad value gets"]


def documented_rows(text: str) -> dict[str, list[str]]:
    """Key → the other cells of its row, for every table row whose first cell is a code span."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        key = match.group(1)
        assert key not in rows, f"docs/configuration.md documents {key!r} twice"
        rows[key] = [cell.strip() for cell in re.split(r"(?<!\\)\|", match.group(2))]
    return rows


def spelled(table: str, key: str) -> str:
    """How the page names a key of a table of CONFIG_KEYS: the section ``[key]`` at the top level, else dotted."""
    if table == "":
        return f"[[{key}]]" if key in ("datacenters", "links", "link_faults") else f"[{key}]"
    return f"{table}.{key}"


def drift(accepted: Mapping[str, frozenset[str]], text: str) -> tuple[list[str], list[str]]:
    """(keys the parser accepts that the page does not document, keys the page documents that the parser refuses)."""
    expected = {spelled(table, key) for table, keys in accepted.items() for key in keys}
    documented = set(documented_rows(text))
    return sorted(expected - documented), sorted(documented - expected)


def test_every_accepted_key_is_documented_and_nothing_else() -> None:
    undocumented, unknown = drift(CONFIG_KEYS, PAGE.read_text(encoding="utf-8"))
    assert not undocumented, f"keys the parser accepts with no row in docs/configuration.md: {undocumented}"
    assert not unknown, f"rows in docs/configuration.md for keys the parser does not accept: {unknown}"


def test_every_limit_is_documented_with_its_value() -> None:
    """The page's "Limits" list states each bound of ``LIMITS`` (what a config may ask for), and no other."""
    section = PAGE.read_text(encoding="utf-8").split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^- `([^`]+)`: at most ([0-9,]+)", section, flags=re.MULTILINE))
    assert listed == {key: f"{most:,}" for key, most in LIMITS.items()}


def test_every_row_says_type_default_meaning_and_error() -> None:
    header = "| " + " | ".join(COLUMNS) + " |"
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(header) >= len({t.split(".")[0] for t in CONFIG_KEYS if t}), "a table without the columns"
    for key, cells in documented_rows(text).items():
        assert len(cells) == len(COLUMNS) - 1, f"{key}: {len(cells) + 1} cells, want {len(COLUMNS)}"
        assert all(cells), f"{key}: an empty cell ({dict(zip(COLUMNS[1:], cells, strict=False))})"


def test_a_key_added_to_the_parser_without_a_row_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """What happens when someone adds a key: the parser takes it at once (CONFIG_KEYS is its only list), and the
    reference check reports it until the page has a row for it."""
    grown = {**CONFIG_KEYS, "run": CONFIG_KEYS["run"] | {"max_wall_s"}}
    monkeypatch.setattr(config_module, "CONFIG_KEYS", grown)
    doc = {"run": {"rounds": 1, "max_wall_s": 60}, "workload": {"dataset": "synthetic"}, "strategy": {"name": "fedavg"},
           "datacenters": [{"name": "a"}]}
    parse_config(doc)  # accepted: no second list of keys to update
    text = PAGE.read_text(encoding="utf-8")
    assert "run.max_wall_s" in drift(grown, text)[0]  # undocumented: the check fails
    row = "| `run.max_wall_s` | number | none | stop after this long | `'run.max_wall_s' must be > 0, got 0.0` |"
    documented = text.replace("## `[workload]`", row + "\n\n## `[workload]`")
    assert "run.max_wall_s" not in drift(grown, documented)[0]  # documented: it passes
    assert "run.max_wall_s" in drift(CONFIG_KEYS, documented)[1]  # documented but not accepted: it fails


def test_the_parser_refuses_what_config_keys_does_not_list(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = {"run": {"rounds": 1, "seed": 3}, "workload": {"dataset": "synthetic"}, "strategy": {"name": "fedavg"},
           "datacenters": [{"name": "a"}]}
    assert parse_config(copy.deepcopy(doc)).run.seed == 3
    monkeypatch.setattr(config_module, "CONFIG_KEYS", {**CONFIG_KEYS, "run": CONFIG_KEYS["run"] - {"seed"}})
    with pytest.raises(ConfigError, match=r"unknown key 'run.seed'"):
        parse_config(doc)


def test_a_not_yet_key_is_accepted_only_at_its_neutral_value(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(set(keys) <= CONFIG_KEYS[table] for table, keys in config_module.NOT_YET.items())
    monkeypatch.setattr(config_module, "NOT_YET", {"run": {"seed": 0}})
    doc = {"run": {"rounds": 1, "seed": 0}, "workload": {"dataset": "synthetic"}, "strategy": {"name": "fedavg"},
           "datacenters": [{"name": "a"}]}
    assert parse_config(copy.deepcopy(doc)).run.seed == 0
    doc["run"]["seed"] = 3
    with pytest.raises(ConfigError, match=r"^'run.seed' is not implemented yet$"):
        parse_config(doc)
