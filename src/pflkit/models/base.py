"""Model conventions: every pflkit model declares its parameter units from input to output.

A *unit* is an architectural layer/block (FedALA Table 5): ALA's ``p`` counts units from the
output side, FedRep splits body/head at the last unit. Units are lists of parameter names as
they appear in ``named_parameters()``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

Units = list[tuple[str, list[str]]]


class UnitModel(nn.Module):
    """A module that knows its units (ordered input -> output) and can run any range of them.

    Subclasses implement ``unit_forward(i, params, x)``: unit ``i`` (with its activation and
    pooling) as a pure function of a parameter dict. ``apply_units(params, x, start, stop)``
    runs units ``start..stop-1`` on any parameters, without touching the module's own (no
    parameter swapping, vmappable); frozen lower units can thus be computed once and the top
    units iterated alone (ALA's feature cache). ``prefix_is_deterministic`` must be False for
    models whose lower units contain dropout or batch-norm in training mode.
    """

    unit_modules: Sequence[str] = ()
    prefix_is_deterministic: bool = True
    #: True when the last unit is exactly ``F.linear(x, weight, bias)`` with its two parameters
    #: in that order; ALA then uses the closed-form gradient of cross-entropy for p = 1.
    linear_head: bool = False

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_units(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, start: int = 0,
                    stop: int | None = None) -> torch.Tensor:
        for index in range(start, len(self.unit_modules) if stop is None else stop):
            x = self.unit_forward(index, params, x)
        return x

    def forward(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.apply_units(dict(self.named_parameters()), x, start, stop)

    def units(self) -> Units:
        """Ordered (unit name, parameter names) pairs, input side first."""
        names = [n for n, _ in self.named_parameters()]
        out: Units = []
        for unit in self.unit_modules:
            members = [n for n in names if n == unit or n.startswith(unit + ".")]
            if not members:
                raise ValueError(f"unit {unit!r} of {type(self).__name__} owns no parameters")
            out.append((unit, members))
        covered = {n for _, ms in out for n in ms}
        missing = [n for n in names if n not in covered]
        if missing:
            raise ValueError(f"parameters not assigned to any unit: {missing}")
        return out


def top_unit_names(units: Units, p: int) -> list[str]:
    """Parameter names of the top ``p`` units (FedALA Eq. 4's higher layers)."""
    if not 1 <= p <= len(units):
        raise ValueError(f"p={p} is out of range: this model has {len(units)} units "
                         f"({', '.join(u for u, _ in units)})")
    return [n for _, members in units[len(units) - p:] for n in members]


def head_names(units: Units) -> list[str]:
    """Parameter names of the last unit (the head used by FedRep and friends)."""
    return list(units[-1][1])


def count_parameters(model: nn.Module, names: Sequence[str] | None = None) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in (names if names is not None else params))


def reference_layer_idx(units: Units, p: int) -> int:
    """The FedALA reference code's ``layer_idx`` (tensors from the end) equivalent to unit ``p``."""
    return len(top_unit_names(units, p))


def check_no_buffers(model: nn.Module) -> None:
    """Refuse models with buffers (BatchNorm statistics) until per-client buffers exist."""
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise NotImplementedError(
            f"{type(model).__name__} has buffers {buffers[:3]}...; per-client buffer handling "
            "(spec §0.2 bn_buffers) is not implemented yet")


