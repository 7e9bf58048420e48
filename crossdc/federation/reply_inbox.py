"""Pulling replies from Flower's SuperLink without ever waiting on one that is still being uploaded.

Flower 1.42's ``HttpGrid.pull_messages`` lists a reply as soon as its sender has registered it, then pulls the reply's
objects, retrying with a backoff of 1 to 10 s for as long as 2 hours, before it returns any of the replies it found.
A datacenter whose node died in the middle of its upload therefore froze the whole coordinator until the SuperLink's
push session expired (180 s: every other datacenter's reply, every deadline and the heartbeat's verdicts waited),
and a large reply still arriving over a slow link held the others back by up to 10 s of backoff.

:class:`ReplyInbox` promises instead: each :meth:`ReplyInbox.pull` makes one pass and returns at once with the
replies that are complete; a reply whose objects are not all there yet is kept and tried again at the next pass
(one that no pass has asked for in :data:`FORGET_AFTER_S` is forgotten); a reply whose objects
the SuperLink no longer has comes back as an error reply (``MESSAGE_UNAVAILABLE``), as Flower's own pull would
return it; an error of the transport in the middle of a pass ends the pass without losing the replies completed in
it (the rest is tried again at the next pass). Grids other than ``HttpGrid`` (the in-process one) never hold an
incomplete reply and are pulled as they are.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import cast

from flwr.app import Message, Metadata
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.common.constant import ErrorCode
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    ObjectUnavailableError,
    inflate_object_from_contents,
)
from flwr.superlink.grid.http_grid import HttpGrid

log = logging.getLogger(__name__)

#: a reply still arriving that no pass has asked for in this long is forgotten with what was pulled of it (its
#: caller gave up on it). Passes of one grid may ask for different messages (a loop's replies, then a rediscovery's
#: hellos for up to 20 s, grid_io.REDISCOVERY_TIMEOUT_S), so a pass keeps what it was not asked for
FORGET_AFTER_S = 60.0


@dataclass
class _Arriving:
    """A reply the SuperLink has listed whose objects are being pulled."""

    message_id: str
    reply_to: str
    src_node_id: int
    object_ids: list[str]
    contents: dict[str, bytes] = field(default_factory=dict)
    asked_at: float = field(default_factory=time.monotonic)  # when a pass last asked for it


class ReplyInbox:
    """The replies of one grid, pulled without blocking (see the module docstring)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.arriving: dict[str, _Arriving] = {}  # by the message id it replies to

    def pull(self, message_ids: set[str]) -> list[Message]:
        """One pass: the complete replies to `message_ids` (the ids of the messages they answer), in no order."""
        if not isinstance(self.grid, HttpGrid):
            return list(self.grid.pull_messages(list(message_ids)))
        grid = self.grid
        now = time.monotonic()
        for reply_to, arriving in list(self.arriving.items()):
            if reply_to in message_ids:
                arriving.asked_at = now
            elif now - arriving.asked_at > FORGET_AFTER_S:
                del self.arriving[reply_to]  # given up on by whoever waited for it
        listed = grid._runtime_client.PullMessages(  # noqa: SLF001 (Flower's own pull blocks; see the module docstring)
            PullAppMessagesRequest(message_ids=[m for m in message_ids if m not in self.arriving]))
        for proto, tree in zip(listed.messages_list, listed.message_object_trees, strict=True):
            reply_to = proto.metadata.reply_to_message_id
            self.arriving[reply_to] = _Arriving(proto.metadata.message_id, reply_to, proto.metadata.src_node_id,
                                                [node.object_id for node in iterate_object_tree(tree)])
        pull_object = make_pull_object_fn_protobuf(grid._runtime_client.PullObject, grid.node,  # noqa: SLF001
                                                   grid.run.run_id)
        complete: list[Message] = []
        for reply_to, arriving in list(self.arriving.items()):
            if reply_to not in message_ids:
                continue  # another caller's (a loop's replies while it rediscovers a node): kept for its next pass
            try:
                for object_id in arriving.object_ids:
                    if object_id not in arriving.contents:
                        arriving.contents[object_id] = pull_object(object_id)
            except ObjectUnavailableError:
                continue  # still being uploaded: next pass
            except ObjectPullError as err:
                del self.arriving[reply_to]
                complete.append(self._unavailable(arriving, str(err)))
                continue
            except Exception:  # the SuperLink unreachable meanwhile: the replies complete so far are not lost with the
                log.warning("pulling a reply's objects failed; trying again at the next poll", exc_info=True)
                break  # pass (the rest is tried again next time; a lasting failure surfaces in PullMessages then)
            message = cast(Message, inflate_object_from_contents(arriving.message_id, dict(arriving.contents)))
            message.metadata.__dict__["_message_id"] = arriving.message_id
            del self.arriving[reply_to]
            complete.append(message)
            try:
                grid._runtime_client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(  # noqa: SLF001
                    node=grid.node, run_id=grid.run.run_id, message_object_id=arriving.message_id))
            except Exception:  # the reply is in hand; the SuperLink frees its objects with the run at worst
                log.warning("confirming a reply to the SuperLink failed", exc_info=True)
        return complete

    def _unavailable(self, arriving: _Arriving, reason: str) -> Message:
        """The error reply Flower's own pull gives for a reply whose objects cannot be had."""
        grid = cast(HttpGrid, self.grid)
        return make_message(
            metadata=Metadata(run_id=grid.run.run_id, message_id="", src_node_id=arriving.src_node_id,
                              dst_node_id=grid.node.node_id, message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0,
                              reply_to_message_id=arriving.reply_to, created_at=time.time()),
            error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                        reason=f"the reply's objects are unavailable (its sender may have died while uploading): {reason}"))


_INBOXES: weakref.WeakKeyDictionary[Grid, ReplyInbox] = weakref.WeakKeyDictionary()


def inbox_of(grid: Grid) -> ReplyInbox:
    """The grid's one inbox (replies half pulled must be found again by the next pass, whoever makes it)."""
    inbox = _INBOXES.get(grid)
    if inbox is None:
        inbox = _INBOXES[grid] = ReplyInbox(grid)
    return inbox
