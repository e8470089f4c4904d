"""Modules between a model's body and its head.

A method may put trainable modules between the body (every unit but the last) and the head (the
last unit) of any :class:`~pflkit.models.base.UnitModel`. Their tensors travel in the model's
parameter dict under ``between.<kind>.``; whenever ``apply_units`` is about to run the head on
a dict that holds such entries, it hands the body's output ``h`` to the registered kind's
``route(params, h, head)``, which returns the logits (``head(params, z)`` runs the model's own
head unit on features ``z``). Training losses, evaluation on every engine and Flower clients
thus run body -> module(s) -> head with no change of their own; without ``between.`` entries a
model runs as before. Each entry states whether it is shared (uploaded and averaged by the
server) or kept on the client: ``Between.shared`` names the shared ones. A model holds one kind
at a time (entries of two kinds are refused).

FedDBE adds a personal vector to ``h``; FedCP routes each sample's feature through a conditional
policy network to a global and a personal head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from torch import Tensor

PREFIX = "between."

#: runs the model's head unit on features: ``head(params, z) -> logits``
Head = Callable[[Mapping[str, Tensor], Tensor], Tensor]


class Between:
    """A kind of module between body and head. Subclasses set ``kind`` and ``shared`` (local names
    of the shared entries; every other entry stays on the client) and implement ``route``."""

    kind: str = ""
    shared: frozenset[str] = frozenset()

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.kind}."

    def name(self, local: str) -> str:
        """The parameter-dict name of entry ``local`` (``between.<kind>.<local>``)."""
        return self.prefix + local

    def route(self, params: Mapping[str, Tensor], h: Tensor, head: Head) -> Tensor:
        """The logits of body output ``h`` (evaluation and training forwards alike)."""
        raise NotImplementedError

    def entries(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This kind's entries among ``params``."""
        return {k: v for k, v in params.items() if k.startswith(self.prefix)}

    def shared_entries(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The entries of this kind that the client uploads and the server averages."""
        return {k: v for k, v in self.entries(params).items() if k[len(self.prefix) :] in self.shared}


KINDS: dict[str, Between] = {}
Kind = TypeVar("Kind", bound=Between)


def register_between(module: Kind) -> Kind:
    """Make ``apply_units`` route heads through ``module`` wherever its entries appear."""
    if not module.kind or "." in module.kind:
        raise ValueError(f"a module between body and head needs a kind without '.': {module.kind!r}")
    KINDS[module.kind] = module
    return module


def between_of(params: Mapping[str, Tensor]) -> Between | None:
    """The registered module whose entries ``params`` holds, or None (a plain model). A model
    routes through one module: entries of two kinds are refused rather than one of them ignored."""
    found: Between | None = None
    for name in params:
        if name.startswith(PREFIX):
            kind = name[len(PREFIX) :].split(".", 1)[0]
            if kind not in KINDS:
                raise KeyError(f"parameter {name!r} belongs to no registered module between body and head")
            if found is not None and found.kind != kind:
                raise ValueError(
                    f"the parameters hold two modules between body and head, {found.kind!r} and {kind!r}: "
                    "a model routes its features through one"
                )
            found = KINDS[kind]
    return found


def without_between(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` without any module between body and head: the plain model."""
    return {k: v for k, v in params.items() if not k.startswith(PREFIX)}
