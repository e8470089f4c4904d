"""An in-process Flower grid: Flower's own ClientApp and messages, no network (tests, debugging)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


class LocalGrid(Grid):
    """Delivers each message to ``client_app`` with that node's persistent ``Context``."""

    def __init__(self, client_app: ClientApp, node_configs: list[dict[str, Any]]) -> None:
        self.client_app = client_app
        self.contexts = {
            1000 + i: Context(run_id=1, node_id=1000 + i, node_config=dict(cfg), state=RecordDict(), run_config={})
            for i, cfg in enumerate(node_configs)
        }
        self._run: Run | None = None
        self._replies: dict[str, Message] = {}
        # Flower's server runtime sets this process identity before a ServerApp runs; so do we.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run  # type: ignore[return-value]  # Grid.run is a Run: set_run comes first

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            reply = self.client_app(message, self.contexts[message.metadata.dst_node_id])
            self._replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
