"""What the methods with trainable modules between the body and the head share (FedCP, GPFL): the
modules' fresh parameters travel in the global model under their kind's prefix
(``pflkit.models.between``), are redrawn from the run seed in ``prepare``, and are downloaded with
the model; the global model scored alone leaves them out."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..functional import Params, clone
from ..models import head_names
from ..models.between import Between, without_between
from .base import Algorithm, ClientSummary, State


class RoutedMethod(Algorithm):
    """A method whose features route through modules of kind ``route`` between body and head."""

    route: ClassVar[Between]

    body_use = "routes features between the model's body and its head"

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.head = head_names(units)
        self.body = len(units) - 1

    def fresh_modules(self, like: torch.Tensor, seed: int) -> Params:
        """The modules' initial parameters, shaped after the head's weight ``like``, from ``seed``."""
        raise NotImplementedError

    def init_server(self, init_params: Params) -> State:
        return {"global": {**clone(init_params), **self.fresh_modules(init_params[self.head[0]], 0)}}

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        return {**server, "global": {**server["global"], **self.fresh_modules(server["global"][self.head[0]], seed)}}

    def downloaded_names(self, names: list[str]) -> list[str]:
        """The model's downloaded entries and the modules'."""
        base = super().downloaded_names(names)
        taken = set(base)
        return [*base, *(n for n in names if n.startswith(self.route.prefix) and n not in taken)]

    def global_params(self, server: State) -> Params:
        """The global model without the modules (they need a client's own inputs)."""
        return without_between(server["global"])
