"""Every operation of the API's OpenAPI schema, fed requests that schemathesis generates from that schema.

No request may get a server error (5xx), and every answer must match the schema (status code documented,
body valid against the declared response model). The database is a small SQLite run log written through the
run log itself, with what tends to break serialisers: NaN and infinite metrics, a run whose process died, a
plain-string event detail, an async run's updates. Half of the generated run ids are swapped for stored ones so
the 200 answers get checked too, not only the 404s. The write endpoints are fuzzed with no token (every answer must be
401, or 400/422 for a malformed body: nothing written) and with an admin token, against a real authenticating SuperLink
(which also stands behind run submission: a generated config is refused with 422, a stop of a run it never ran with 409).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from conftest import authenticating_superlink
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks
from sqlalchemy import update

from crossdc.dashboard.app import create_app
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.models import RUNS
from crossdc.db.records import TimelineSpanRecord
from crossdc.db.runlog import RunLog
from crossdc.db.security import create_token
from crossdc.deployment.superlink_control import SuperLinkControl
from crossdc.orchestration.submission import StandingFederation

RUN_IDS = ("fuzz-sync", "fuzz-async", "fuzz-dead")
MAX_EXAMPLES = 20  # per operation and mode: a few seconds in all


def seed(db_url: str) -> None:
    """A few small runs with awkward values, written the way the platform writes them."""
    upgrade(db_url)
    with RunLog(db_url) as log:
        for run_id in RUN_IDS:
            log.start_run(run_id=run_id, name=run_id, strategy="fedavg" if run_id != "fuzz-async" else "fedasync",
                          config={"datacenters": [{"name": "us-east"}, {"name": "eu-west"}], "odd": float("nan")},
                          rounds_planned=5)
            for r in range(1, 5):
                for dc in ("eu-west", "us-east"):
                    log.log_datacenter_round(run_id=run_id, round=r, datacenter=dc, status="ok" if r != 3 else "rejected",
                                             reason=None if r != 3 else "NaN in update", compute_s=1.0, comm_s=float("inf"),
                                             overhead_s=float("nan"), train_loss=float("nan"), num_examples=10, staleness=r % 2)
                log.log_round(run_id=run_id, round=r, tau=2, val_loss=float("nan") if r == 4 else 1.0 / r,
                              val_accuracy=float("-inf") if r == 4 else 0.5, bytes_up=1, bytes_down=2, bytes_up_raw=4,
                              wall_s=float("nan") if r == 2 else 1.0)
                log.heartbeat(run_id=run_id)
            log.log_timeline_spans(run_id=run_id, spans=[
                TimelineSpanRecord(round=r, datacenter=dc, kind=kind, start_s=2.0 * r, end_s=2.0 * r + 1.5,
                                   fragment=0 if kind in ("up", "down") else None, exchange=r if kind == "up" else None)
                for r in range(1, 5) for dc in ("eu-west", "us-east") for kind in ("compute", "wait", "up", "down")])
            log.log_event(run_id=run_id, kind="rejected", round=3, datacenter="us-east", detail="a plain message")
            log.log_event(run_id=run_id, kind="checkpoint", round=4, detail={"uri": "file:///x", "nested": {"v": [1, 2]}})
        for seq in range(6):
            log.log_async_update(run_id="fuzz-async", seq=seq, datacenter="us-east", base_version=seq, applied_version=None,
                                 staleness=seq, scale=float("nan") if seq == 2 else 0.5, status="applied" if seq % 2 else "discarded")
        log.touch_datacenter(name="us-east", region="us", gpus=8, link_bandwidth_mbps=float("inf"), link_rtt_ms=80.0)
        log.touch_datacenter(name="eu-west")
        log.finish_run(run_id="fuzz-sync", status="finished", result={"val_loss": float("nan")})
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(update(RUNS).where(RUNS.c.id == "fuzz-dead")
                         .values(last_heartbeat=datetime.now(UTC) - timedelta(days=2)))
    finally:
        engine.dispose()


AUTH: dict[str, str] = {}  # "admin" → the admin token's Authorization header, once the schema fixture made it


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = Path(tmp_path_factory.mktemp("fuzz"))
    db_url = f"sqlite:///{tmp / 'crossdc.db'}"
    seed(db_url)
    AUTH["admin"] = "Bearer " + create_token(make_engine(db_url), "fuzz-admin", "admin")
    with authenticating_superlink(tmp) as (address, certs):
        control = SuperLinkControl(address, certs.ca_cert)
        try:
            federation = StandingFederation(address, certs.ca_cert, tmp / "runs")
            yield schemathesis.openapi.from_asgi("/openapi.json", create_app(db_url, superlink_control=control,
                                                                               standing_federation=federation))
        finally:
            control.close()


def _is_write(operation: Any) -> bool:
    return operation.method.upper() != "GET" or operation.path == "/api/audit"


def _operations(api_schema: Any) -> list[Any]:
    """The API's operations (the pages' HTML routes are not in the schema's /api and /metrics set)."""
    found = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if operation.path.startswith("/api/") or operation.path == "/metrics":
            found.append(operation)
    return found


def test_the_schema_lists_every_operation(api_schema: Any) -> None:
    paths = {op.path for op in _operations(api_schema)}
    assert {"/api/health", "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/rounds",
            "/api/runs/{run_id}/datacenter-rounds", "/api/runs/{run_id}/events", "/api/runs/{run_id}/async-updates",
            "/api/runs/{run_id}/timeline", "/api/datacenters", "/api/strategies", "/api/codecs", "/metrics"} <= paths


@pytest.mark.parametrize("token", ["none", "admin"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_generated_request_gets_a_server_error(api_schema: Any, mode: GenerationMode, token: str) -> None:
    """Valid requests (schema-conforming parameters) and invalid ones (422 expected), for every operation; without a
    token every write is refused (401, or 400/422 for a body that does not parse), with the admin token none gets a server error."""
    exercised = []
    headers = {"Authorization": AUTH["admin"]} if token == "admin" else {}
    for operation in _operations(api_schema):
        if mode is GenerationMode.NEGATIVE and not list(operation.query) and not operation.body:
            continue  # no parameter to get wrong (a free-text run id in the path is never invalid)
        if token == "admin" and not _is_write(operation):
            continue  # reads do not look at tokens: fuzzed once, without one

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:  # called right below, in the same iteration: `operation` is this one
            run_id = (case.path_parameters or {}).get("run_id")
            if mode is GenerationMode.POSITIVE and isinstance(run_id, str) and zlib.crc32(run_id.encode("utf-8", "surrogatepass")) % 2 == 0:
                case.path_parameters["run_id"] = RUN_IDS[len(run_id) % len(RUN_IDS)]
            response = case.call(headers=headers)
            if _is_write(operation) and token == "none":  # noqa: B023
                # refused: 401, or 400/422 for a body that does not parse as JSON of the right shape (read before the token)
                assert response.status_code in (400, 401, 422), f"{case.method} {case.formatted_path}: {response.status_code}"
            # a strategy plug-in that is installed but does not import is the installation's fault, not the input's:
            # /api/strategies then answers 503 naming it (as `crossdc strategies list` does); nothing else may be 5xx
            broken_plugin = operation.path == "/api/strategies" and response.status_code == 503 and "failed to load" in response.text  # noqa: B023
            assert response.status_code < 500 or broken_plugin, (
                f"{case.method} {case.formatted_path} {case.query}: {response.status_code} {response.text[:300]}")
            # a public key's content (a real EC key) and a config's (TOML crossdc can run) are more than JSON Schema can
            # say: a schema-valid string is not necessarily either, and 422 is the right answer to one that is not
            excluded = ([checks.positive_data_acceptance] if operation.path in ("/api/datacenters", "/api/runs")  # noqa: B023
                        and operation.method.upper() == "POST" else [])  # noqa: B023
            if token == "admin":  # a negative case may drop the Authorization header, which this mode puts back:
                excluded.append(checks.negative_data_rejection)  # no 5xx is what is checked here

            case.validate_response(response, excluded_checks=excluded)

        check()
        exercised.append(operation.path)
    if token == "none":
        assert "/api/runs/{run_id}/datacenter-rounds" in exercised and "/api/runs" in exercised
    assert "/api/datacenters/{name}" in exercised or mode is GenerationMode.NEGATIVE


EDGE_INTEGERS = (-1, 0, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1)
EDGE_STRINGS = ("", "\x00", "a\x00b", "'; DROP TABLE runs; --", "é" * 300, "%", "fuzz-sync")


def test_edge_values_of_every_query_parameter(api_schema: Any) -> None:
    """Integers past every bound a column or a driver has, and awkward text, in each query parameter of each
    operation, against stored runs: answers are 2xx or 4xx, and match the schema."""
    for operation in _operations(api_schema):
        run_ids = RUN_IDS if list(operation.path_parameters) else (None,)
        for parameter in operation.query:
            kind = parameter.definition.get("schema", {})
            types = {kind.get("type")} | {s.get("type") for s in kind.get("anyOf", [])}
            values = EDGE_INTEGERS if "integer" in types else EDGE_STRINGS
            for run_id in run_ids:
                for value in values:
                    case = operation.Case(path_parameters={"run_id": run_id} if run_id else None, query={parameter.name: value})
                    response = case.call()
                    assert response.status_code < 500, f"{operation.path} {parameter.name}={value!r}: {response.text[:300]}"
                    case.validate_response(response)
