"""A Grid wrapper that waits for restarted SuperNodes instead of failing the round."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from ..federation.stopping import check_stop

log = logging.getLogger("flwr")


class ResilientGrid(Grid):
    """Re-sends messages that the SuperLink answered with *node unavailable* (a SuperNode that is
    down, e.g. being restarted), until the node is back or ``wait_seconds`` have passed.

    Only undelivered messages are re-sent, so a node never processes a round twice. A node
    authenticated by its key keeps its node id across restarts; other errors pass through. While
    it waits for replies, a stop asked for by a signal ends the wait (``check_stop``).
    """

    def __init__(self, grid: Grid, wait_seconds: float = 120.0, poll_seconds: float = 2.0) -> None:
        self.grid = grid
        self.wait_seconds = wait_seconds
        self.poll_seconds = poll_seconds

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def _send_and_receive(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Push ``messages`` and pull their replies until all came or ``timeout`` passed, checking
        between polls whether a signal asked the run to stop (a round in flight is then abandoned)."""
        ids = set(self.grid.push_messages(messages))
        replies: list[Message] = []
        end = None if timeout is None else time.time() + timeout
        while ids and (end is None or time.time() < end):
            check_stop()
            for reply in self.grid.pull_messages(list(ids)):
                ids.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            if ids:
                time.sleep(0.1)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        pending = {m.metadata.dst_node_id: m for m in messages}
        replies: list[Message] = []
        deadline = time.time() + self.wait_seconds
        while pending:
            sent = list(pending.values())
            got = self._send_and_receive(sent, timeout)
            node_of = {m.metadata.message_id: node for node, m in pending.items()}  # ids are set on push
            retry = {}
            for reply in got:
                node = node_of.get(reply.metadata.reply_to_message_id)
                if (
                    reply.has_error()
                    and reply.error.code == ErrorCode.NODE_UNAVAILABLE
                    and node is not None
                    and time.time() < deadline
                ):
                    retry[node] = pending[node]
                else:
                    replies.append(reply)
            if not retry:
                break
            log.warning(
                "SuperNode(s) %s unavailable; waiting up to %.0f s for them to come back",
                sorted(retry),
                deadline - time.time(),
            )
            time.sleep(self.poll_seconds)
            pending = {
                node: Message(
                    m.content, dst_node_id=node, message_type=m.metadata.message_type, group_id=m.metadata.group_id
                )
                for node, m in retry.items()
            }
        return replies
