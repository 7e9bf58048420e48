"""The run page's gossip views: the topology (datacenters, and the links that carried exchanges coloured by bytes or
RTT) and the consensus curve, in headless Chromium (Playwright) against the real app under uvicorn.

One SQLite run log for the module, filled through `RunLog` (the platform's own writer) the way the gossip loop
(crossdc/federation/gossip_loop.py) logs a round: a finished gossip run of four datacenters on a ring over five
rounds (one failed direction, one extra exchange off the ring, links of every kind in its config: listed in
[[links]] by profile and by numbers, and through the coordinator with and without an RTT), a gossip run that is still
running, and a federated-averaging run, which must show neither view.

Screenshots land in `test-artifacts/` at the repository root.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from browser_harness import Site, Tab, browser_fixture, serve_fresh, tab_fixture  # noqa: F401

from crossdc.db.runlog import RunLog

TOPOLOGY, CONSENSUS = "fig-gossip-topology", "fig-consensus"

GOSSIP_RUN = "gossip-" + uuid.uuid4().hex[:8]
LIVE_GOSSIP_RUN = "gossip-live-" + uuid.uuid4().hex[:8]
FEDAVG_RUN = "fedavg-" + uuid.uuid4().hex[:8]
DATA_ONLY_RUN = "data-only-" + uuid.uuid4().hex[:8]
ROUNDS = 5
DATACENTERS = ("us-east", "eu-west", "ap-south", "sa-east")
RING = [("us-east", "eu-west"), ("eu-west", "ap-south"), ("ap-south", "sa-east"), ("sa-east", "us-east")]
#: the gossip run's config, as a run stores it (the parsed TOML)
CONFIG: dict[str, Any] = {
    "run": {"name": "gossip-ring", "rounds": ROUNDS},
    "workload": {"dataset": "synthetic", "model": "mlp"},
    "strategy": {"name": "gossip", "tau": 4, "params": {"topology": "ring"}},
    "datacenters": [
        {"name": "us-east", "link": "continental"},  # 40 ms
        {"name": "eu-west"},  # no link of its own: not shaped, 0 ms to the coordinator
        {"name": "ap-south", "link": {"profile": "constrained", "rtt_ms": 250.0}},
        {"name": "sa-east", "link": "metro"},  # 2 ms
    ],
    "links": [
        {"between": ["us-east", "eu-west"], "profile": "transoceanic"},  # 150 ms
        {"between": ["eu-west", "ap-south"], "bandwidth_mbps": 100.0, "rtt_ms": 120.0},
    ],
}
#: per pair (a < b): the route and RTT the config gives it
EXPECTED_PATHS: dict[tuple[str, str], tuple[str, float | None]] = {
    ("eu-west", "us-east"): ("direct", 150.0),
    ("ap-south", "eu-west"): ("direct", 120.0),
    ("ap-south", "sa-east"): ("coordinator", 252.0),  # 250 + 2: both datacenters' own links
    ("sa-east", "us-east"): ("coordinator", 42.0),
    ("eu-west", "sa-east"): ("coordinator", 2.0),  # eu-west has no link of its own
}


# ------------------------------------------------------------------- data


@dataclass(frozen=True)
class LinkRow:
    """One direction of one exchange, as a link_rounds row holds it."""

    round: int
    src: str
    dst: str
    bytes: int
    in_flight_s: float
    error: str | None = None


def link_rows(round_: int) -> list[LinkRow]:
    """What the links carried in one round: both directions of each ring pair (the second direction of the third
    pair failed in round 2), plus eu-west with sa-east, off the ring, in round 3."""
    pairs = RING + ([("eu-west", "sa-east")] if round_ == 3 else [])
    rows = []
    for k, (a, b) in enumerate(pairs):
        rows.append(LinkRow(round_, a, b, 1000 * (k + 1) + 10 * round_, 0.1 * (k + 1) + 0.01 * round_))
        if round_ == 2 and k == 2:
            rows.append(LinkRow(round_, b, a, 56, 1.5, "TimeoutError: timed out"))
        else:
            rows.append(LinkRow(round_, b, a, 1000 * (k + 1) + 10 * round_ + 1, 0.1 * (k + 1) + 0.01 * round_ + 0.005))
    return rows


def consensus(round_: int, index: int) -> float:
    """Datacenter `index`'s distance to the replicas' average after `round_`: halving every round."""
    return (1.0 + 0.25 * index) / 2**round_


def mean_consensus(round_: int) -> float:
    return sum(consensus(round_, i) for i in range(len(DATACENTERS))) / len(DATACENTERS)


def log_gossip_round(log: RunLog, run_id: str, round_: int) -> None:
    """One gossip round as the gossip loop logs it: the datacenters' rows, the link rows, the round, a heartbeat."""
    rows = link_rows(round_)
    for i, name in enumerate(DATACENTERS):
        log.log_datacenter_round(run_id=run_id, round=round_, datacenter=name, status="ok", compute_s=1.0, idle_s=0.2,
                                 bytes_up=sum(r.bytes for r in rows if r.src == name),
                                 bytes_down=sum(r.bytes for r in rows if r.dst == name),
                                 consensus_distance=consensus(round_, i))
    for row in rows:
        log.log_link_round(run_id=run_id, round=row.round, src=row.src, dst=row.dst, bytes=row.bytes,
                           in_flight_s=row.in_flight_s, error=row.error)
    log.log_round(run_id=run_id, round=round_, tau=4, val_loss=None, val_accuracy=None,
                  bytes_up=sum(r.bytes for r in rows), bytes_down=sum(r.bytes for r in rows), bytes_up_raw=0, wall_s=1.2,
                  consensus_distance=mean_consensus(round_))
    log.heartbeat(run_id=run_id)


def expected_totals(rounds: range) -> list[dict[str, Any]]:
    """The link totals of the gossip run's `rounds`, summed here from the rows the test wrote."""
    rows = [row for r in rounds for row in link_rows(r)]
    out = []
    for (a, b), (route, rtt_ms) in sorted(EXPECTED_PATHS.items()):
        mine = [row for row in rows if {row.src, row.dst} == {a, b}]
        if not mine:
            continue
        worked = sorted(row.in_flight_s for row in mine if row.error is None)
        middle = len(worked) // 2
        out.append({
            "a": a, "b": b, "bytes": sum(row.bytes for row in mine),
            "bytes_a_to_b": sum(row.bytes for row in mine if row.src == a),
            "bytes_b_to_a": sum(row.bytes for row in mine if row.src == b),
            "rounds": len({row.round for row in mine}), "failed_rounds": len({row.round for row in mine if row.error}),
            "in_flight_s_median": worked[middle] if len(worked) % 2 else (worked[middle - 1] + worked[middle]) / 2,
            "route": route, "rtt_ms": rtt_ms,
        })
    return out


def write_runs(db_url: str) -> None:
    with RunLog(db_url) as log:
        log.start_run(run_id=GOSSIP_RUN, name="gossip-ring", strategy="gossip", config=CONFIG, rounds_planned=ROUNDS)
        for r in range(1, ROUNDS + 1):
            log_gossip_round(log, GOSSIP_RUN, r)
        log.finish_run(run_id=GOSSIP_RUN, status="finished")

        log.start_run(run_id=LIVE_GOSSIP_RUN, name="gossip-live", strategy="gossip", config=CONFIG, rounds_planned=ROUNDS)
        for r in (1, 2):
            log_gossip_round(log, LIVE_GOSSIP_RUN, r)

        log.start_run(run_id=FEDAVG_RUN, name="fedavg-run", strategy="fedavg", config={}, rounds_planned=2)
        for r in (1, 2):
            for name in DATACENTERS[:2]:
                log.log_datacenter_round(run_id=FEDAVG_RUN, round=r, datacenter=name, status="ok", compute_s=1.0,
                                         comm_s=0.1, drift_l2=0.1 * r)
            log.log_round(run_id=FEDAVG_RUN, round=r, tau=2, val_loss=1.0 / r, val_accuracy=0.3 * r, bytes_up=100,
                          bytes_down=100, bytes_up_raw=400, wall_s=1.0)
        log.finish_run(run_id=FEDAVG_RUN, status="finished")

        # another strategy's run that logged what a gossip run logs: it gets the views too
        log.start_run(run_id=DATA_ONLY_RUN, name="data-only", strategy="diloco", config={}, rounds_planned=1)
        log.log_link_round(run_id=DATA_ONLY_RUN, round=1, src="dc-a", dst="dc-b", bytes=10, in_flight_s=0.1)
        log.log_round(run_id=DATA_ONLY_RUN, round=1, tau=2, val_loss=None, val_accuracy=None, bytes_up=10,
                      bytes_down=10, bytes_up_raw=10, wall_s=1.0)
        log.finish_run(run_id=DATA_ONLY_RUN, status="finished")
        log.flush(timeout=30)


# --------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with serve_fresh(tmp_path_factory, "gossip-dashboard", write_runs) as served:
        yield served


def edges(traces: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The topology's edge traces (one line of two points each) by name ("a – b")."""
    return {t["name"]: t for t in traces if t["mode"] == "lines"}


def by_name(traces: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t for t in traces if t["name"] == name)


# ------------------------------------------------------------------ tests


def test_link_totals_sum_each_pair_over_the_run_with_the_rtt_of_its_config(site: Site) -> None:
    body = site.get(f"/api/runs/{GOSSIP_RUN}/link-totals").json()
    assert body["run_id"] == GOSSIP_RUN and body["datacenters"] == list(DATACENTERS)
    expected = expected_totals(range(1, ROUNDS + 1))
    assert body["items"] == [pytest.approx(item) for item in expected]
    assert [(i["a"], i["b"], i["failed_rounds"]) for i in body["items"] if i["failed_rounds"]] == [("ap-south", "sa-east", 1)]
    # a run without link rows: its config's datacenters (none here), no pair; an unknown run: 404
    assert site.get(f"/api/runs/{FEDAVG_RUN}/link-totals").json() == {"run_id": FEDAVG_RUN, "datacenters": [], "items": []}
    assert site.get("/api/runs/no-such-run/link-totals").status_code == 404
    assert "/api/runs/{run_id}/link-totals" in site.get("/openapi.json").json()["paths"]


def test_gossip_run_page_draws_the_topology_and_the_consensus_curve(site: Site, tab: Tab) -> None:
    tab.open_run(site.base, GOSSIP_RUN)
    tab.wait_for_gossip_loads(1)
    expected = {(i["a"], i["b"]): i for i in expected_totals(range(1, ROUNDS + 1))}

    # Topology: the four datacenters in config order, one edge per pair that exchanged, labelled with its bytes.
    topology = tab.traces(TOPOLOGY)
    assert by_name(topology, "datacenters")["text"] == list(DATACENTERS)
    assert set(edges(topology)) == {f"{a} – {b}" for a, b in expected}
    assert all(len(edge["x"]) == 2 and edge["line"]["dash"] == "solid" for edge in edges(topology).values())
    links = by_name(topology, "links")
    assert {(a, b): n for a, b, n in links["customdata"]} == {pair: item["bytes"] for pair, item in expected.items()}
    assert links["marker_color"] == [expected[(a, b)]["bytes"] for a, b, _ in links["customdata"]]
    labels = {(a, b): text for (a, b, _), text in zip(links["customdata"], links["text"], strict=True)}
    assert labels[("eu-west", "sa-east")] == "10.1 kB"  # 5,030 + 5,031 bytes, in round 3
    assert [t["name"] for t in topology if "not known" in t["name"]] == []
    # the pair that carried most is drawn in the scale's darkest colour
    heaviest = max(expected.values(), key=lambda item: item["bytes"])
    assert edges(topology)[f"{heaviest['a']} – {heaviest['b']}"]["line"]["color"] == "rgb(179,0,0)"
    table = tab.page.eval_on_selector_all("#gossip-links tbody tr", "rows => rows.map(r => [r.dataset.a, r.dataset.b, "
                                          "Array.from(r.cells).map(c => c.textContent)])")
    assert [(a, b) for a, b, _ in table] == sorted(expected)
    cells = {(a, b): texts for a, b, texts in table}
    assert cells[("ap-south", "sa-east")][1:3] == ["via coordinator", "252 ms"]
    assert cells[("ap-south", "sa-east")][7] == "1"  # failed rounds
    assert cells[("eu-west", "sa-east")][1:3] == ["via coordinator", "2 ms"]

    # Coloured by RTT: every pair's RTT, as the run's config gives its path, on the scale
    tab.page.select_option("#topology-colour", "rtt_ms")
    tab.page.wait_for_function("id => document.getElementById(id).layout.title.text.includes('RTT')", arg=TOPOLOGY)
    topology = tab.traces(TOPOLOGY)
    known = by_name(topology, "links")
    assert known["marker_color"] == [EXPECTED_PATHS[(a, b)][1] for a, b, _ in known["customdata"]]
    assert len(known["customdata"]) == 5 and "252 ms" in known["text"]
    assert [t["name"] for t in topology if "not known" in t["name"]] == []

    # Consensus: the mean, then each datacenter (by name), one point per round.
    curves = tab.traces(CONSENSUS)
    assert [c["name"] for c in curves] == ["mean", *sorted(DATACENTERS)]
    assert all(c["x"] == list(range(1, ROUNDS + 1)) for c in curves)
    assert by_name(curves, "mean")["y"] == pytest.approx([mean_consensus(r) for r in range(1, ROUNDS + 1)])
    index = DATACENTERS.index("ap-south")
    assert by_name(curves, "ap-south")["y"] == pytest.approx([consensus(r, index) for r in range(1, ROUNDS + 1)])
    assert tab.page.evaluate("id => document.getElementById(id)._fullLayout.yaxis.type", CONSENSUS) == "log"
    tab.screenshot("run-gossip.png")
    assert tab.errors == []


def test_a_gossip_round_logged_while_the_page_is_open_appears_without_a_reload(site: Site, tab: Tab) -> None:
    tab.open_run(site.base, LIVE_GOSSIP_RUN)
    tab.wait_for_gossip_loads(1)
    assert by_name(tab.traces(CONSENSUS), "mean")["x"] == [1, 2]
    assert tab.page.evaluate("window.crossdc.polling") is True
    tab.page.evaluate("window.notReloaded = true")

    expected = {(i["a"], i["b"]): i["bytes"] for i in expected_totals(range(1, 4))}
    with RunLog(site.db_url) as log:
        log_gossip_round(log, LIVE_GOSSIP_RUN, 3)
        log.flush(timeout=30)
    # A poll may land while the round is half written; the views catch up on the next change (its heartbeat).
    tab.page.wait_for_function(
        """([consensus, topology, total]) => {
             const curves = document.getElementById(consensus).data, edges = document.getElementById(topology).data;
             const links = edges.find(t => t.name === "links");
             return curves.length === 5 && curves.every(t => t.x.length === 3)
               && links.customdata.reduce((sum, c) => sum + c[2], 0) === total;
           }""", arg=[CONSENSUS, TOPOLOGY, sum(expected.values())], timeout=20_000)
    curves = tab.traces(CONSENSUS)
    assert all(c["x"] == [1, 2, 3] for c in curves)
    assert {(a, b): n for a, b, n in by_name(tab.traces(TOPOLOGY), "links")["customdata"]} == expected
    assert "eu-west – sa-east" in edges(tab.traces(TOPOLOGY))  # the round-3 exchange off the ring: a new edge
    assert tab.page.evaluate("window.notReloaded") is True
    # after the first load, only the rounds after the last one read were asked for
    asked = [parse_qs(urlsplit(url).query) for url in tab.requested if "/datacenter-rounds" in url]
    assert "since_round" not in asked[0] and len(asked) > 1
    assert all(int(query["since_round"][0]) >= 2 for query in asked[1:])

    with RunLog(site.db_url) as log:
        log.finish_run(run_id=LIVE_GOSSIP_RUN, status="finished")
        log.flush(timeout=30)
    tab.page.wait_for_function("() => window.crossdc.polling === false", timeout=15_000)
    assert tab.errors == []


def test_other_runs_pages_show_neither_view(site: Site, tab: Tab) -> None:
    tab.open_run(site.base, FEDAVG_RUN)
    tab.page.wait_for_function("() => document.getElementById('fig-loss-round')._fullLayout !== undefined")
    for selector in ("#gossip", f"#{TOPOLOGY}", f"#{CONSENSUS}", "#gossip-data", "#gossip-links", "#topology-colour"):
        assert tab.page.query_selector(selector) is None, selector
    assert "Gossip" not in tab.page.inner_text("main")
    assert tab.page.evaluate("window.crossdc.gossip.config") is None
    assert not [url for url in tab.requested if "/api/" in url]  # the views' data is never asked for
    assert tab.errors == []
    # a run of another strategy that logged link rows gets them; a gossip run gets them however little it logged
    assert 'id="gossip"' in site.get(f"/runs/{DATA_ONLY_RUN}").text
    assert 'id="gossip"' not in site.get(f"/runs/{FEDAVG_RUN}").text
