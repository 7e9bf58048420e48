"""crossdc's ReplyInbox (crossdc.federation.reply_inbox) against Flower's own SuperLink code, run in process.

Flower's server side runs here for real, only without its HTTP transport: an in-memory LinkState with its object
store (made by Flower's LinkStateFactory), a run whose ServerApp task is claimed and running, SuperNodes registered and
activated through Flower's Fleet handlers. The ServerApp side is a real ``HttpGrid`` whose runtime client calls Flower's
Runtime handlers (``push_messages``, ``pull_messages``, ``pull_object``, ``confirm_message_received``) directly, with the
task its token authenticates; a SuperNode is played by calls to Flower's Fleet handlers in the order Flower's SuperNode
makes them (pull the instruction and its objects, register the reply and its object tree in a push session, push the
objects). A SuperNode that "dies in the middle of its upload" is one that registered its reply and pushed none or only
some of its objects: the SuperLink then holds those objects preregistered with empty content.

What is checked, on exact cases: a pass never waits (no sleep or timed wait, no object asked twice) nor loses a reply
still being uploaded, which comes back complete, equal in content, exactly once, once its objects are in; a complete
reply is not held back by an incomplete one; a reply whose objects the SuperLink no longer has (its push session
expired, or the objects deleted) becomes a MESSAGE_UNAVAILABLE error reply to the right message; an incomplete reply
no longer asked for is forgotten; one inbox per grid; and a grid that is not an HttpGrid is pulled as it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, RecordDict
from flwr.app.message import make_message, remove_content_from_message
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, NOOP_FLWR_AID, SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_to_proto
from flwr.proto.fleet_pb2 import (  # pylint: disable=E0611
    ActivateNodeRequest,
    PullMessagesRequest,
    PushMessagesRequest,
    RegisterNodeFleetRequest,
)
from flwr.proto.message_pb2 import (  # pylint: disable=E0611
    ConfirmMessageReceivedRequest,
    ConfirmMessageReceivedResponse,
    PullObjectRequest,
    PullObjectResponse,
    PushObjectRequest,
    PushObjectResponse,
)
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    GetNodesRequest,
    GetNodesResponse,
    PullAppMessagesRequest,
    PullAppMessagesResponse,
    PushAppMessagesRequest,
    PushAppMessagesResponse,
)
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.linkstate import LinkState, LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
from flwr.supercore.date import now
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    iterate_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.http_grid import HttpGrid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from flwr.superlink.servicer.fleet import fleet_handlers
from flwr.superlink.servicer.runtime import runtime_handlers

from crossdc import protocol
from crossdc.db.engine import upgrade
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import load_config
from crossdc.federation import reply_inbox
from crossdc.federation.grid_io import FederationError, discover_datacenters
from crossdc.federation.reply_inbox import ReplyInbox, inbox_of
from crossdc.protocol import CONFIG_KEY

MESSAGE_TYPE = "train"
EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"
INSTRUCTION_TTL_S = 3600.0


# --- the SuperLink, in process ---------------------------------------------------------------------------------------


class InProcessRuntimeClient:
    """The Runtime API as HttpGrid calls it, answered by Flower's own Runtime handlers in this process (no HTTP).

    Each call authenticates its task by the task token, as the Runtime API's router does, and records what it was
    asked for, so that a test can tell what one pass of the inbox did."""

    def __init__(self, state: LinkState, token: str) -> None:
        self.state = state
        self.token = token
        self.pulled_object_ids: list[str] = []  # every PullObject, in order
        self.pull_messages_requests: list[list[str]] = []  # the message ids of every PullMessages
        self.confirmed_message_ids: list[str] = []  # every ConfirmMessageReceived

    def _task(self) -> Task:
        task = self.state.get_task_by_token(self.token)
        if task is None:
            raise RuntimeError("the Runtime API refused the task token")
        return task

    def GetNodes(self, request: GetNodesRequest) -> GetNodesResponse:  # noqa: N802 (the Runtime API's name)
        return runtime_handlers.get_nodes(request, self.state, self._task())

    def PushMessages(self, request: PushAppMessagesRequest) -> PushAppMessagesResponse:  # noqa: N802
        return runtime_handlers.push_messages(request, self.state, self._task())

    def PushObject(self, request: PushObjectRequest) -> PushObjectResponse:  # noqa: N802
        return runtime_handlers.push_object(request, self.state, self._task())

    def PullMessages(self, request: PullAppMessagesRequest) -> PullAppMessagesResponse:  # noqa: N802
        self.pull_messages_requests.append(list(request.message_ids))
        return runtime_handlers.pull_messages(request, self.state, self._task())

    def PullObject(self, request: PullObjectRequest) -> PullObjectResponse:  # noqa: N802
        self.pulled_object_ids.append(request.object_id)
        return runtime_handlers.pull_object(request, self.state, self._task())

    def ConfirmMessageReceived(self, request: ConfirmMessageReceivedRequest) -> ConfirmMessageReceivedResponse:  # noqa: N802
        self.confirmed_message_ids.append(request.message_object_id)
        return runtime_handlers.confirm_message_received(request, self.state, self._task())


class InProcessHttpGrid(HttpGrid):
    """Flower's HttpGrid, unchanged but for its runtime client: the in-process one above instead of HTTP."""

    def __init__(self, client: InProcessRuntimeClient, run: Run) -> None:
        super().__init__(token=client.token)
        self.in_process_client = client
        self.set_run(run)

    @property
    def _runtime_client(self) -> InProcessRuntimeClient:  # type: ignore[override]
        return self.in_process_client


@dataclass
class UploadingReply:
    """A reply a SuperNode has registered with the SuperLink, and the objects it still has to push (tree order)."""

    reply: Message
    session_id: str
    to_push: list[tuple[str, bytes]]

    @property
    def message_id(self) -> str:
        return self.reply.metadata.message_id


@dataclass
class SuperNodeSide:
    """One SuperNode's side of the Fleet API, driven as Flower's SuperNode drives it, on Flower's Fleet handlers."""

    state: LinkState
    node_id: int
    run_id: int

    @property
    def node(self) -> Node:
        return Node(node_id=self.node_id)

    def receive(self) -> Message:
        """Pull the next instruction and its objects, and confirm it (Fleet PullMessages, PullObject, Confirm...)."""
        response = fleet_handlers.pull_messages(PullMessagesRequest(node=self.node), self.state, self.state.object_store)
        assert len(response.messages_list) == 1, "no instruction for this node"
        tree = response.message_object_trees[0]
        message = pull_and_inflate_object_from_tree(
            tree,
            make_pull_object_fn_protobuf(lambda request: fleet_handlers.pull_object(request, self.state), self.node,
                                         self.run_id),
            make_confirm_message_received_fn_protobuf(
                lambda request: fleet_handlers.confirm_message_received(request, self.state, self.state.object_store),
                self.node, self.run_id),
            return_type=Message,
        )
        message.metadata.__dict__["_message_id"] = tree.object_id
        return message

    def register_reply(self, reply: Message) -> UploadingReply:
        """Register the reply and its object tree (Fleet PushMessages), pushing none of its objects yet."""
        reply.metadata.__dict__["_message_id"] = reply.object_id
        with no_object_id_recompute():
            tree = get_object_tree(reply)
            objects = get_all_nested_objects(reply)
            response = fleet_handlers.push_messages(
                PushMessagesRequest(node=self.node, messages_list=[message_to_proto(remove_content_from_message(reply))],
                                    message_object_trees=[tree]),
                self.state)
            missing = set(response.objects_to_push)
            to_push = [(object_id, objects[object_id].deflate())
                       for object_id in dict.fromkeys(node.object_id for node in iterate_object_tree(tree))
                       if object_id in missing]
        assert to_push, "the SuperLink asked for none of the reply's objects"
        return UploadingReply(reply, response.session_id, to_push)

    def upload(self, uploading: UploadingReply, count: int | None = None) -> None:
        """Push the next `count` objects of the reply (all that remain if None) (Fleet PushObject)."""
        count = len(uploading.to_push) if count is None else count
        for object_id, content in uploading.to_push[:count]:
            response = fleet_handlers.push_object(
                PushObjectRequest(node=self.node, run_id=self.run_id, object_id=object_id, object_content=content,
                                  session_id=uploading.session_id),
                self.state)
            assert response.stored, f"the SuperLink refused object {object_id}"
        del uploading.to_push[:count]


@dataclass
class SuperLink:
    """A SuperLink's state with a running ServerApp run and its SuperNodes, and the ServerApp's grid on it."""

    factory: LinkStateFactory
    state: InMemoryLinkState
    run: Run
    client: InProcessRuntimeClient
    grid: InProcessHttpGrid
    nodes: list[SuperNodeSide] = field(default_factory=list)

    def add_node(self, public_key: bytes) -> SuperNodeSide:
        """Register and activate a SuperNode as Flower's SuperNode does on connecting (Fleet RegisterNode,
        ActivateNode)."""
        fleet_handlers.register_node(RegisterNodeFleetRequest(public_key=public_key), self.state,
                                     enable_supernode_auth=False)
        node_id = fleet_handlers.activate_node(
            ActivateNodeRequest(public_key=public_key, heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL), self.state).node_id
        node = SuperNodeSide(self.state, node_id, self.run.run_id)
        self.nodes.append(node)
        return node


def instruction_to(run_id: int, node_id: int) -> Message:
    """An instruction message as a ServerApp makes one (its id is set when it is pushed)."""
    content = RecordDict({"arrays": ArrayRecord({"model": Array(np.zeros((2, 3), dtype=np.float32))}),
                          "config": ConfigRecord({"round": 1})})
    return make_message(
        metadata=Metadata(run_id=run_id, message_id="", src_node_id=SUPERLINK_NODE_ID, dst_node_id=node_id,
                          reply_to_message_id="", group_id="1", created_at=now().timestamp(), ttl=INSTRUCTION_TTL_S,
                          message_type=MESSAGE_TYPE),
        content=content)


def reply_content(seed: int) -> RecordDict:
    """A datacenter's answer: a small array of its own and a config record (distinct per seed, so that two replies
    share no object)."""
    weights = np.arange(6, dtype=np.float32).reshape(2, 3) + seed
    return RecordDict({"arrays": ArrayRecord({"model": Array(weights)}),
                       "config": ConfigRecord({"datacenter": f"dc{seed}", "steps": 10 + seed, "loss": 0.5 * seed})})


def assert_reply_content(message: Message, seed: int) -> None:
    assert not message.has_error()
    expected = reply_content(seed)
    got_weights = message.content.array_records["arrays"]["model"].numpy()
    np.testing.assert_array_equal(got_weights, expected.array_records["arrays"]["model"].numpy())
    assert got_weights.dtype == np.float32
    assert dict(message.content.config_records["config"]) == dict(expected.config_records["config"])


def assert_handed_over_already(messages: list[Message], instruction_id: str) -> None:
    """What a pass gives for a message id whose reply it has already returned: not the reply again, only what Flower's
    SuperLink answers for an instruction it no longer has (its own MESSAGE_UNAVAILABLE error, sent by the SuperLink
    itself; Flower's HttpGrid.pull_messages gives the same). A caller stops asking for an id once it has its reply."""
    assert [message for message in messages if not message.has_error()] == []
    [error_reply] = messages
    assert error_reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert error_reply.metadata.src_node_id == SUPERLINK_NODE_ID
    assert error_reply.metadata.reply_to_message_id == instruction_id


@pytest.fixture
def superlink() -> SuperLink:
    """Flower's in-memory SuperLink state, a run whose ServerApp task is claimed and running, and the grid on it."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = cast(InMemoryLinkState, factory.state())
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, NOOP_FLWR_AID, TaskType.SERVER_APP)
    run = state.get_run_info(run_ids=[run_id])[0]
    task_id = cast(int, run.primary_task_id)
    token = state.claim_task(task_id)
    assert token is not None and state.activate_task(task_id)
    client = InProcessRuntimeClient(state, token)
    return SuperLink(factory, state, run, client, InProcessHttpGrid(client, run))


def send_instruction(superlink: SuperLink, node: SuperNodeSide) -> str:
    """Push an instruction to `node` through the grid (Runtime PushMessages, PushObject), and return its id."""
    [message_id] = superlink.grid.push_messages([instruction_to(superlink.run.run_id, node.node_id)])
    assert message_id
    return message_id


class PassRunner:
    """Runs one `ReplyInbox.pull` with waiting forbidden, and tells which objects it asked the SuperLink for.

    Waiting is `time.sleep`, or `threading.Event.wait` with a timeout (how Flower's own pull backs off between tries);
    each attempt is recorded and refused, and a pass that attempted one fails, wherever the refusal was caught."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.asked: list[str] = []
        self.waits: list[float] = []

    def _refuse_to_wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        raise AssertionError(f"a pass of the inbox waited ({seconds} s): it must never wait on a reply")

    def __call__(self, inbox: ReplyInbox, message_ids: set[str]) -> list[Message]:
        client = cast(InProcessHttpGrid, inbox.grid).in_process_client if isinstance(inbox.grid, HttpGrid) else None
        before = len(client.pulled_object_ids) if client else 0
        event_wait = threading.Event.wait

        def timed_wait_refused(event: threading.Event, timeout: float | None = None) -> bool:
            if timeout is not None and timeout > 0:
                self._refuse_to_wait(timeout)
            return event_wait(event, timeout)

        self.waits = []
        with self.monkeypatch.context() as patch:
            patch.setattr(time, "sleep", self._refuse_to_wait)
            patch.setattr(threading.Event, "wait", timed_wait_refused)
            replies = inbox.pull(set(message_ids))
        assert self.waits == [], "a pass of the inbox waited"
        self.asked = client.pulled_object_ids[before:] if client else []
        assert len(self.asked) == len(set(self.asked)), "an object was asked for twice in one pass"
        return replies


@pytest.fixture
def one_pass(monkeypatch: pytest.MonkeyPatch) -> PassRunner:
    """One pass of an inbox, as `one_pass(inbox, message_ids)` (see PassRunner)."""
    return PassRunner(monkeypatch)


# --- the cases -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("uploaded_before_death", [0, 3], ids=["none-uploaded", "some-uploaded"])
def test_a_reply_still_uploading_is_kept_and_returned_once_complete(superlink: SuperLink, one_pass: PassRunner,
                                                                     uploaded_before_death: int) -> None:
    node = superlink.add_node(b"node-a")
    instruction_id = send_instruction(superlink, node)
    instruction = node.receive()
    assert instruction.metadata.message_id == instruction_id
    uploading = node.register_reply(Message(reply_content(1), reply_to=instruction))
    all_objects = [object_id for object_id, _ in uploading.to_push]
    assert len(all_objects) > uploaded_before_death + 1  # the reply stays incomplete
    node.upload(uploading, uploaded_before_death)
    inbox = ReplyInbox(superlink.grid)

    assert one_pass(inbox, {instruction_id}) == []  # returns at once, without the reply
    assert set(inbox.arriving) == {instruction_id}  # ... which it keeps
    assert set(one_pass.asked) <= set(all_objects)
    assert superlink.client.confirmed_message_ids == []
    got_in_first_pass = set(all_objects[:uploaded_before_death])
    assert got_in_first_pass <= set(one_pass.asked)

    assert one_pass(inbox, {instruction_id}) == []  # nothing more uploaded: still nothing, still kept
    assert set(inbox.arriving) == {instruction_id}
    assert not got_in_first_pass & set(one_pass.asked)  # what it had, it does not ask for again

    node.upload(uploading)  # the rest arrives
    [reply] = one_pass(inbox, {instruction_id})
    assert not got_in_first_pass & set(one_pass.asked)
    assert_reply_content(reply, 1)
    assert reply.metadata.reply_to_message_id == instruction_id
    assert reply.metadata.message_id == uploading.message_id
    assert reply.metadata.src_node_id == node.node_id
    assert reply.metadata.run_id == superlink.run.run_id
    assert inbox.arriving == {}
    assert superlink.client.confirmed_message_ids == [uploading.message_id]
    assert uploading.message_id not in superlink.state.object_store  # confirmed: the SuperLink let its objects go

    assert_handed_over_already(one_pass(inbox, {instruction_id}), instruction_id)  # returned exactly once
    assert one_pass(inbox, set()) == []
    assert inbox.arriving == {}


@pytest.mark.parametrize("incomplete_listed_first", [False, True], ids=["listed-together", "incomplete-listed-first"])
def test_a_complete_reply_is_not_held_back_by_an_incomplete_one(superlink: SuperLink, one_pass: PassRunner,
                                                                 incomplete_listed_first: bool) -> None:
    fast, dying = superlink.add_node(b"node-fast"), superlink.add_node(b"node-dying")
    fast_id, dying_id = send_instruction(superlink, fast), send_instruction(superlink, dying)
    inbox = ReplyInbox(superlink.grid)
    dying_upload = dying.register_reply(Message(reply_content(2), reply_to=dying.receive()))
    dying.upload(dying_upload, 1)
    if incomplete_listed_first:  # the incomplete one is then tried first in the next pass, whatever the listing order
        assert one_pass(inbox, {fast_id, dying_id}) == []
        assert set(inbox.arriving) == {dying_id}
    fast_upload = fast.register_reply(Message(reply_content(1), reply_to=fast.receive()))
    fast.upload(fast_upload)

    [reply] = one_pass(inbox, {fast_id, dying_id})  # the complete one comes back at once
    assert reply.metadata.reply_to_message_id == fast_id
    assert_reply_content(reply, 1)
    assert set(inbox.arriving) == {dying_id}

    dying.upload(dying_upload)
    [late] = one_pass(inbox, {dying_id})
    assert late.metadata.reply_to_message_id == dying_id
    assert_reply_content(late, 2)
    assert inbox.arriving == {}


def _expire_push_session(state: InMemoryLinkState, session_id: str) -> None:
    """What 180 s without a push does to a push session (Flower's OBJECT_PUSH_SESSION_TTL_SECONDS): the SuperLink
    drops the session's messages and objects the next time one of its pending objects is asked for."""
    state._object_push_sessions[session_id].expires_at = now() - timedelta(seconds=1)  # noqa: SLF001


@pytest.mark.parametrize("how", ["push-session-expired", "deleted-from-object-store"])
@pytest.mark.parametrize("uploaded_before_death", [0, 3], ids=["none-uploaded", "some-uploaded"])
def test_a_reply_whose_objects_are_gone_comes_back_as_an_error_reply(superlink: SuperLink, one_pass: PassRunner,
                                                                      how: str, uploaded_before_death: int) -> None:
    node = superlink.add_node(b"node-killed")
    instruction_id = send_instruction(superlink, node)
    uploading = node.register_reply(Message(reply_content(3), reply_to=node.receive()))
    node.upload(uploading, uploaded_before_death)  # ... then SIGKILL
    inbox = ReplyInbox(superlink.grid)
    assert one_pass(inbox, {instruction_id}) == []
    assert set(inbox.arriving) == {instruction_id}

    if how == "push-session-expired":
        _expire_push_session(superlink.state, uploading.session_id)
    else:
        superlink.state.object_store.delete(uploading.message_id)
    [error_reply] = one_pass(inbox, {instruction_id})

    assert uploading.message_id not in superlink.state.object_store
    assert error_reply.has_error() and not error_reply.has_content()
    assert error_reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert error_reply.metadata.reply_to_message_id == instruction_id
    assert error_reply.metadata.run_id == superlink.run.run_id
    assert error_reply.metadata.src_node_id == node.node_id
    assert error_reply.metadata.dst_node_id == SUPERLINK_NODE_ID
    assert inbox.arriving == {}
    assert_handed_over_already(one_pass(inbox, {instruction_id}), instruction_id)  # given once


def test_a_pass_keeps_the_replies_another_caller_still_waits_for(superlink: SuperLink, one_pass: PassRunner) -> None:
    """A loop's reply still arriving survives a pass made for other messages (a rediscovery's hellos, between two
    polls of the loop): it is neither pulled nor forgotten there, and the loop's next pass gets it."""
    loop_node, new_node = superlink.add_node(b"node-loop"), superlink.add_node(b"node-new")
    loop_id = send_instruction(superlink, loop_node)
    loop_upload = loop_node.register_reply(Message(reply_content(6), reply_to=loop_node.receive()))
    loop_objects = {object_id for object_id, _ in loop_upload.to_push}
    inbox = ReplyInbox(superlink.grid)
    assert one_pass(inbox, {loop_id}) == []
    hello_id = send_instruction(superlink, new_node)
    hello_upload = new_node.register_reply(Message(reply_content(7), reply_to=new_node.receive()))
    new_node.upload(hello_upload)
    loop_node.upload(loop_upload)
    [hello] = one_pass(inbox, {hello_id})  # the rediscovery's pass
    assert hello.metadata.reply_to_message_id == hello_id
    assert not set(one_pass.asked) & loop_objects
    assert set(inbox.arriving) == {loop_id}
    [reply] = one_pass(inbox, {loop_id})  # the loop's next poll
    assert reply.metadata.reply_to_message_id == loop_id
    assert_reply_content(reply, 6)


def test_an_incomplete_reply_no_longer_asked_for_is_forgotten(superlink: SuperLink, one_pass: PassRunner,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reply_inbox, "FORGET_AFTER_S", 0.0)  # not asked in a pass: forgotten at once
    given_up, still_wanted = superlink.add_node(b"node-given-up"), superlink.add_node(b"node-still-wanted")
    given_up_id, still_wanted_id = send_instruction(superlink, given_up), send_instruction(superlink, still_wanted)
    given_up.register_reply(Message(reply_content(4), reply_to=given_up.receive()))
    wanted_upload = still_wanted.register_reply(Message(reply_content(5), reply_to=still_wanted.receive()))
    inbox = ReplyInbox(superlink.grid)
    assert one_pass(inbox, {given_up_id, still_wanted_id}) == []
    assert set(inbox.arriving) == {given_up_id, still_wanted_id}

    assert one_pass(inbox, {still_wanted_id}) == []  # the caller gave up on `given_up_id`
    assert set(inbox.arriving) == {still_wanted_id}
    assert superlink.client.pull_messages_requests[-1] == []  # an arriving reply is not listed again

    assert one_pass(inbox, set()) == []
    assert inbox.arriving == {}
    still_wanted.upload(wanted_upload)
    assert one_pass(inbox, set()) == []


def test_inbox_of_gives_one_inbox_per_grid(superlink: SuperLink) -> None:
    inbox = inbox_of(superlink.grid)
    assert inbox_of(superlink.grid) is inbox
    assert inbox.grid is superlink.grid
    other_grid = InProcessHttpGrid(superlink.client, superlink.run)
    assert inbox_of(other_grid) is not inbox
    assert inbox_of(other_grid) is inbox_of(other_grid)


class CountingInMemoryGrid(InMemoryGrid):
    """Flower's in-process grid, counting the calls to its own pull."""

    def __init__(self, factory: LinkStateFactory) -> None:
        super().__init__(factory)
        self.pulls: list[list[str]] = []

    def pull_messages(self, message_ids: object) -> list[Message]:  # type: ignore[override]
        ids = list(cast(list[str], message_ids))
        self.pulls.append(ids)
        return list(super().pull_messages(ids))


def test_a_grid_that_is_not_an_http_grid_is_pulled_as_it_is(superlink: SuperLink, one_pass: PassRunner) -> None:
    node = superlink.add_node(b"node-in-process")
    grid = CountingInMemoryGrid(superlink.factory)
    grid.set_run(superlink.run)
    [instruction_id] = grid.push_messages([instruction_to(superlink.run.run_id, node.node_id)])
    instruction = superlink.state.message_ins_store[instruction_id]
    reply = Message(reply_content(6), reply_to=instruction)
    reply.metadata.__dict__["_message_id"] = reply.object_id
    assert superlink.state.store_message_res(reply) == reply.object_id
    inbox = ReplyInbox(grid)

    [got] = one_pass(inbox, {instruction_id})
    assert grid.pulls == [[instruction_id]]
    assert got.metadata.reply_to_message_id == instruction_id
    assert_reply_content(got, 6)
    assert inbox.arriving == {}
    assert superlink.client.pull_messages_requests == []  # the Runtime API was not used


def test_a_transport_error_mid_pass_loses_no_reply(superlink: SuperLink) -> None:
    """A pass that completes one reply and then cannot reach the SuperLink for another still returns the first (it
    was confirmed and the SuperLink forgot it: raising would have lost it), and the other is pulled the next time."""
    early, late = superlink.add_node(b"node-early"), superlink.add_node(b"node-late")
    early_id, late_id = send_instruction(superlink, early), send_instruction(superlink, late)
    inbox = ReplyInbox(superlink.grid)
    early_upload = early.register_reply(Message(reply_content(1), reply_to=early.receive()))
    assert inbox.pull({early_id, late_id}) == []  # listed while incomplete
    early.upload(early_upload)
    late_upload = late.register_reply(Message(reply_content(2), reply_to=late.receive()))
    late.upload(late_upload)
    client = superlink.client
    real_pull_object = client.PullObject
    unreachable = {late_upload.message_id}  # (the message's own object, the first of its tree)

    def pull_object(request: Any) -> Any:
        if request.object_id in unreachable:
            raise ConnectionError("the SuperLink is unreachable")
        return real_pull_object(request)

    client.PullObject = pull_object  # type: ignore[method-assign]
    [reply] = inbox.pull({early_id, late_id})
    assert reply.metadata.reply_to_message_id == early_id and not reply.has_error()
    assert_reply_content(reply, 1)
    assert set(inbox.arriving) == {late_id}
    client.PullObject = real_pull_object  # type: ignore[method-assign]
    [reply] = inbox.pull({late_id})
    assert reply.metadata.reply_to_message_id == late_id
    assert_reply_content(reply, 2)
    assert inbox.arriving == {}


# --- discovery on the same SuperLink -------------------------------------------------------------------------------


def answer_hello(node: SuperNodeSide, answer: Callable[[Message], Message]) -> threading.Thread:
    """A SuperNode that waits (up to 30 s) for its hello and sends `answer(hello)`, fully uploaded, in a thread."""

    def serve() -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                hello = node.receive()
                break
            except AssertionError:  # nothing for this node yet
                assert time.monotonic() < deadline, "no hello came"
                time.sleep(0.02)
        node.upload(node.register_reply(answer(hello)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_discovery_names_the_reason_a_node_gave_for_failing_its_hello(superlink: SuperLink, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose ClientApp failed the hello (here: its trainer did not start) answered, with an error: the
    discovery's error names the missing datacenter and gives that node's reason, rather than only 'did not answer'."""
    # the ServerApp's identity, which Flower sets in a ServerApp's process (its messages carry the run id)
    for name, value in (("_run_id", superlink.run.run_id), ("_task_id", superlink.run.primary_task_id),
                        ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    config = load_config(EXAMPLE_CONFIG)  # datacenters us-east and eu-west
    named, failing = superlink.add_node(b"node-named"), superlink.add_node(b"node-failing")
    reason = "the trainer did not start within 300s"
    threads = [
        answer_hello(named, lambda hello: Message(RecordDict({CONFIG_KEY: ConfigRecord({protocol.DATACENTER: "us-east"})}),
                                                  reply_to=hello)),
        answer_hello(failing, lambda hello: Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                                                    reply_to=hello)),
    ]
    db_url = f"sqlite:///{tmp_path / 'runs.db'}"
    upgrade(db_url)
    with RunLog(db_url) as runlog, pytest.raises(FederationError) as raised:
        discover_datacenters(superlink.grid, config, runlog, "run-1")
    for thread in threads:
        thread.join(timeout=30)
    assert str(raised.value) == (f"datacenters did not answer: eu-west; node {failing.node_id} answered with an "
                                 f"error: {reason}")
