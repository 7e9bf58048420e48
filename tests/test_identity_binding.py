"""A datacenter's identity comes from its enrolled key, not from the name its node claims.

The rule (crossdc.federation.identity.judge_claim) on exact cases; the run log's side (last_seen follows only active
datacenters, the audit row a run writes) on SQLite and PostgreSQL; and discovery and rediscovery on a grid bound to a
standing federation's enrollments, against Flower's own SuperLink code run in process (tests/test_reply_inbox.py's
harness): a node holding one enrolled datacenter's key that claims another's name is refused, recorded (an event, an
audit row), never placed and never asked again, while the datacenter its key is enrolled as is the one seen; the
heartbeat key its hello offered it is its node's own, with which no datacenter's beats are verified (each
datacenter's are verified with its node's key, moved with it on rejoin). The same on real processes, with a revoked
name claimed: tests/test_standing_federation.py."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from sqlalchemy import insert, update
from test_reply_inbox import EXAMPLE_CONFIG, SuperLink, answer_hello, superlink  # noqa: F401 (superlink: a fixture)

from crossdc import protocol
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.models import DATACENTERS
from crossdc.db.queries import enrolled_identities, list_datacenters, list_events, utcnow
from crossdc.db.runlog import RunLog
from crossdc.db.security import audit_entries
from crossdc.deployment.heartbeat import Beat, HeartbeatOffer, NodeKeys, decode_beat, encode_beat, node_key
from crossdc.experiment.config import load_config
from crossdc.federation.grid_io import FederationError, bind_identities, discover_datacenters, rediscover
from crossdc.federation.identity import CLAIM_ACTION, REFUSED_EVENT, Enrollment, Enrollments, Refusal, judge_claim
from crossdc.protocol import CONFIG_KEY

# ------------------------------------------------------------------ the rule

ENROLLED = Enrollments((Enrollment("us-east", "active", 11), Enrollment("eu-west", "revoked", None),
                        Enrollment("ap-south", "active", 33), Enrollment("sa-east", "suspended", None),
                        Enrollment("seen-by-a-run", "active", None)))


def test_a_node_is_the_datacenter_its_key_is_enrolled_as() -> None:
    assert judge_claim(11, "us-east", ENROLLED) is None
    assert judge_claim(33, "ap-south", ENROLLED) is None
    assert ENROLLED.holder(33) == "ap-south" and ENROLLED.holder(99) is None
    assert ENROLLED.nodes_of(["us-east", "eu-west", "ap-south", "nowhere", "seen-by-a-run"]) == {11, 33}


@pytest.mark.parametrize(("node_id", "claimed", "holder", "reason"), [
    # another enrolled datacenter's key, claiming an active name, a revoked one, a suspended one, an unknown one
    (33, "us-east", "ap-south", "it claims 'us-east' but its key is enrolled as 'ap-south'"),
    (33, "eu-west", "ap-south", "it claims 'eu-west' but its key is enrolled as 'ap-south'"),
    (11, "sa-east", "us-east", "it claims 'sa-east' but its key is enrolled as 'us-east'"),
    (11, "nowhere", "us-east", "it claims 'nowhere' but its key is enrolled as 'us-east'"),
    # a key not enrolled at all: a revoked or suspended name is never taken over, an active one neither
    (99, "eu-west", None, "it claims 'eu-west', which is revoked, and its key is not enrolled"),
    (99, "sa-east", None, "it claims 'sa-east', which is suspended, and its key is not enrolled"),
    (99, "us-east", None, "it claims 'us-east' but its key is not enrolled as any datacenter"),
    (99, "seen-by-a-run", None, "it claims 'seen-by-a-run' but its key is not enrolled as any datacenter"),
    # what a node claims is shown escaped, and cut at 128 characters
    (33, "x\n" + "y" * 200, "ap-south", "it claims " + repr("x\n" + "y" * 126) + "... but its key is enrolled as 'ap-south'"),
])
def test_a_claim_the_key_does_not_hold_is_refused(node_id: int, claimed: str, holder: str | None, reason: str) -> None:
    assert judge_claim(node_id, claimed, ENROLLED) == Refusal(node_id, claimed, holder, reason)


def test_a_key_the_table_gives_two_names_is_nobodys() -> None:
    twice = Enrollments((Enrollment("a", "active", 5), Enrollment("b", "active", 5)))
    assert twice.holder(5) is None
    assert judge_claim(5, "a", twice) == Refusal(5, "a", None, "it claims 'a' but its key is enrolled under several names (a, b)")


def test_enrollments_are_read_from_the_table_rows() -> None:
    rows = [{"name": "us-east", "status": "active", "node_id": "18446744073709551615"},
            {"name": "eu-west", "status": "revoked", "node_id": None}]
    assert Enrollments.from_rows(rows) == Enrollments((Enrollment("us-east", "active", 2**64 - 1),
                                                       Enrollment("eu-west", "revoked", None)))
    for bad in ("-1", "18446744073709551616", "node-7"):
        with pytest.raises(ValueError, match=f"datacenter 'x' has node_id '{bad}', not a Flower node id"):
            Enrollments.from_rows([{"name": "x", "status": "active", "node_id": bad}])


# ------------------------------------------------------------------ the run log's side


def _enroll_rows(db_url: str, rows: list[tuple[str, str, int | None]]) -> None:
    """`datacenters` rows as enrollment leaves them: (name, status, node id) with a key."""
    with make_engine(db_url).begin() as conn:
        for name, status, node_id in rows:
            conn.execute(insert(DATACENTERS).values(name=name, status=status, enrolled_at=utcnow(), public_key=f"key of {name}",
                                                    node_id=None if node_id is None else str(node_id)))


def _start_run(log: RunLog, run_id: str) -> None:
    log.start_run(run_id=run_id, name=run_id, strategy="fedavg", config={}, rounds_planned=1, baseline="none")


def test_last_seen_follows_only_active_datacenters_and_a_run_writes_audit_rows(migrated_url: str) -> None:
    _enroll_rows(migrated_url, [("us-east", "active", 11), ("eu-west", "revoked", None), ("sa-east", "suspended", None)])
    with RunLog(migrated_url) as log:
        for name in ("us-east", "eu-west", "sa-east", "new-one"):
            log.touch_datacenter(name=name, region="somewhere")
        log.audit(action=CLAIM_ACTION, outcome="refused", target="eu-west", detail={"node_id": "33"})
        with pytest.raises(ValueError, match="outcome must be one of ok, refused, failed"):
            log.audit(action=CLAIM_ACTION, outcome="maybe")
        with pytest.raises(ValueError, match="target must be at most 128 characters"):
            log.audit(action=CLAIM_ACTION, outcome="refused", target="x" * 129)
        log.flush(timeout=30)
    engine = make_engine(migrated_url)
    try:
        rows = {row["name"]: row for row in list_datacenters(engine)}
        assert rows["us-east"]["last_seen"] is not None and rows["us-east"]["region"] == "somewhere"
        assert rows["new-one"]["last_seen"] is not None and rows["new-one"]["status"] == "active"
        for cut_off in ("eu-west", "sa-east"):  # left exactly as they were
            assert rows[cut_off]["last_seen"] is None and rows[cut_off]["region"] is None, rows[cut_off]
        assert [(r["name"], r["status"], r["node_id"]) for r in enrolled_identities(engine)] == [
            ("eu-west", "revoked", None), ("new-one", "active", None), ("sa-east", "suspended", None), ("us-east", "active", "11")]
        with engine.connect() as conn:
            [row] = audit_entries(conn)
        assert (row["action"], row["outcome"], row["actor"], row["target"], row["detail"]) == (
            CLAIM_ACTION, "refused", None, "eu-west", {"node_id": "33"})
    finally:
        engine.dispose()


# ------------------------------------------------------------------ discovery on a bound grid


def _says(name: str, offered: list[bytes] | None = None):  # type: ignore[no-untyped-def]
    """A node's hello answer claiming datacenter `name` (the heartbeat key its hello offered added to `offered`)."""

    def answer(hello: Message) -> Message:
        if offered is not None:
            offered.append(bytes.fromhex(str(hello.content[CONFIG_KEY][protocol.HELLO_HEARTBEAT_KEY])))
        return Message(RecordDict({CONFIG_KEY: ConfigRecord({protocol.DATACENTER: name})}), reply_to=hello)

    return answer


def _beats_for(keys: NodeKeys, datacenter: str, key: bytes) -> bool:
    """Whether the monitor's keys verify a beat naming `datacenter` signed with `key`."""
    return decode_beat(encode_beat(Beat("run-1", datacenter, 1), key), keys.key_of, "run-1") is not None


@pytest.fixture
def server_app_identity(superlink: SuperLink, monkeypatch: pytest.MonkeyPatch) -> SuperLink:  # noqa: F811
    """The ServerApp's identity, which Flower sets in a ServerApp's process (its messages carry the run id)."""
    for name, value in (("_run_id", superlink.run.run_id), ("_task_id", superlink.run.primary_task_id),
                        ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    return superlink


def test_a_bound_grid_refuses_a_node_claiming_a_name_its_key_is_not_enrolled_as(server_app_identity: SuperLink,
                                                                                  tmp_path: Path) -> None:
    link = server_app_identity
    config = load_config(EXAMPLE_CONFIG)  # datacenters us-east and eu-west
    db_url = f"sqlite:///{tmp_path / 'federation.db'}"
    upgrade(db_url)
    us_east, eu_west = link.add_node(b"key-us-east"), link.add_node(b"key-eu-west")
    impostor = link.add_node(b"key-ap-south")  # ap-south's node, saying it is us-east
    _enroll_rows(db_url, [("us-east", "active", us_east.node_id), ("eu-west", "active", eu_west.node_id),
                          ("ap-south", "active", impostor.node_id)])
    bind_identities(link.grid, db_url)
    secret = b"s" * 32
    heartbeat = HeartbeatOffer(9200, NodeKeys(secret))
    offered: dict[str, list[bytes]] = {"us-east": [], "eu-west": [], "impostor": [], "stranger": [], "eu-west-2": []}
    threads = [answer_hello(us_east, _says("us-east", offered["us-east"])),
               answer_hello(eu_west, _says("eu-west", offered["eu-west"])),
               answer_hello(impostor, _says("us-east", offered["impostor"]))]
    with RunLog(db_url) as runlog:
        _start_run(runlog, "run-1")
        nodes = discover_datacenters(link.grid, config, runlog, "run-1", heartbeat)
        for thread in threads:
            thread.join(timeout=30)
        assert nodes == {"us-east": us_east.node_id, "eu-west": eu_west.node_id}  # two claims of us-east: its key's wins
        # every hello offered its node's own key, never the secret; the impostor's verifies no beat of us-east
        assert offered["us-east"] == [node_key(secret, us_east.node_id)] and offered["eu-west"] == [node_key(secret, eu_west.node_id)]
        assert offered["impostor"] == [node_key(secret, impostor.node_id)]
        assert _beats_for(heartbeat.keys, "us-east", offered["us-east"][0]) and _beats_for(heartbeat.keys, "eu-west", offered["eu-west"][0])
        assert not any(_beats_for(heartbeat.keys, name, offered["impostor"][0]) for name in ("us-east", "eu-west", "ap-south"))

        # a rejoin is checked again: a node whose key is not enrolled, claiming eu-west, is refused; eu-west enrolled
        # again with a new key (as after a suspension) is moved to its new node; the refused ap-south is not asked
        # again (were it asked, it would not answer, and be logged silent)
        stranger, eu_west_again = link.add_node(b"key-nobody"), link.add_node(b"key-eu-west-2")
        with make_engine(db_url).begin() as conn:
            conn.execute(update(DATACENTERS).where(DATACENTERS.c.name == "eu-west").values(node_id=str(eu_west_again.node_id)))
        threads = [answer_hello(stranger, _says("eu-west", offered["stranger"])),
                   answer_hello(eu_west_again, _says("eu-west", offered["eu-west-2"]))]
        seen = set(nodes.values())
        moved = rediscover(link.grid, nodes, seen, config, runlog, "run-1", server_round=2, timeout_s=20, heartbeat=heartbeat)
        for thread in threads:
            thread.join(timeout=30)
        assert moved == ["eu-west"] and nodes == {"us-east": us_east.node_id, "eu-west": eu_west_again.node_id}
        # eu-west's beats now count from its new node only; the refused stranger's key counts for nobody
        assert offered["eu-west-2"] == [node_key(secret, eu_west_again.node_id)]
        assert _beats_for(heartbeat.keys, "eu-west", offered["eu-west-2"][0])
        assert not _beats_for(heartbeat.keys, "eu-west", offered["eu-west"][0])
        assert not any(_beats_for(heartbeat.keys, name, offered["stranger"][0]) for name in ("us-east", "eu-west"))
        assert stranger.node_id in seen and impostor.node_id not in seen
        with pytest.raises(AssertionError, match="no instruction"):
            impostor.receive()
        assert rediscover(link.grid, nodes, seen, config, runlog, "run-1", server_round=3, timeout_s=20) == []
        runlog.flush(timeout=30)

    engine = make_engine(db_url)
    try:
        refused = [(e["round"], e["datacenter"], e["detail"]) for e in list_events(engine, "run-1") if e["kind"] == REFUSED_EVENT]
        assert refused == [
            (None, "us-east", {"node_id": str(impostor.node_id), "claimed": "'us-east'", "key_enrolled_as": "ap-south",
                               "reason": "it claims 'us-east' but its key is enrolled as 'ap-south'"}),
            (2, "eu-west", {"node_id": str(stranger.node_id), "claimed": "'eu-west'", "key_enrolled_as": None,
                            "reason": "it claims 'eu-west' but its key is not enrolled as any datacenter"})]
        assert {e["kind"] for e in list_events(engine, "run-1")} == {REFUSED_EVENT, "datacenter-rejoined"}
        with engine.connect() as conn:
            audit = [(a["action"], a["outcome"], a["target"], a["detail"]["node_id"], a["detail"]["round"])
                     for a in audit_entries(conn)]
        assert audit == [(CLAIM_ACTION, "refused", "us-east", str(impostor.node_id), None),
                         (CLAIM_ACTION, "refused", "eu-west", str(stranger.node_id), 2)]
        # the key the impostor holds is the datacenter seen; discovery marks no other (the loops mark those placed)
        seen_at = {row["name"]: row["last_seen"] for row in list_datacenters(engine)}
        assert seen_at["ap-south"] is not None and seen_at["us-east"] is None and seen_at["eu-west"] is None
    finally:
        engine.dispose()


def test_discovery_names_the_refused_node_when_a_datacenter_is_missing(server_app_identity: SuperLink,
                                                                      tmp_path: Path) -> None:
    """us-east revoked (its key unregistered), ap-south's key claims it: the run cannot start, and says why; the
    revoked us-east is not seen (its last_seen stays that of before its revocation), ap-south is."""
    link = server_app_identity
    config = load_config(EXAMPLE_CONFIG)
    db_url = f"sqlite:///{tmp_path / 'federation.db'}"
    upgrade(db_url)
    eu_west, impostor = link.add_node(b"key-eu-west"), link.add_node(b"key-ap-south")
    _enroll_rows(db_url, [("us-east", "revoked", None), ("eu-west", "active", eu_west.node_id),
                          ("ap-south", "active", impostor.node_id)])
    before_revocation = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(DATACENTERS).where(DATACENTERS.c.name == "us-east").values(last_seen=before_revocation))
    bind_identities(link.grid, db_url)
    threads = [answer_hello(eu_west, _says("eu-west")), answer_hello(impostor, _says("us-east"))]
    with RunLog(db_url) as runlog, pytest.raises(FederationError) as raised:
        _start_run(runlog, "run-1")
        discover_datacenters(link.grid, config, runlog, "run-1")
    for thread in threads:
        thread.join(timeout=30)
    assert str(raised.value) == (f"datacenters did not answer: us-east; node {impostor.node_id} refused: it claims "
                                 "'us-east' but its key is enrolled as 'ap-south'")
    try:
        seen_at = {row["name"]: row["last_seen"] for row in list_datacenters(engine)}
        assert seen_at["us-east"] == before_revocation and seen_at["ap-south"] is not None
        assert [(e["kind"], e["datacenter"]) for e in list_events(engine, "run-1")] == [(REFUSED_EVENT, "us-east")]
    finally:
        engine.dispose()
