"""Model conventions: every pflkit model declares its parameter units from input to output.

A *unit* is an architectural layer/block (FedALA Table 5): ALA's ``p`` counts units from the
output side, FedRep splits body/head at the last unit. Units are lists of parameter names as
they appear in ``named_parameters()``.

Batch-norm running statistics (floating buffers, e.g. ``bn1.running_mean``) travel in the same
parameter dicts as the parameters, under their state-dict names, but belong to no unit: ALA's
weights, FedRep's head and parameter counts only see parameters. ``buffer_names`` lists them.
Integer ``num_batches_tracked`` counters are not kept (pflkit's batch norm uses a fixed momentum).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from .between import between_of

Units = list[tuple[str, list[str]]]

#: Integer buffers that pflkit tolerates but does not keep in parameter dicts.
IGNORED_BUFFERS = ("num_batches_tracked",)


class UnitModel(nn.Module):
    """A module that knows its units (ordered input -> output) and can run any range of them.

    Subclasses implement ``unit_forward(i, params, x)``: unit ``i`` (with its activation and
    pooling) as a pure function of a parameter dict. ``apply_units(params, x, start, stop)``
    runs units ``start..stop-1`` on any parameters, without touching the module's own (no
    parameter swapping, vmappable); frozen lower units can thus be computed once and the top
    units iterated alone (ALA's feature cache). ``prefix_is_deterministic`` must be False for
    models whose lower units contain dropout or batch-norm in training mode.

    ``unit_modules`` entries are a module name or a tuple of module names (one unit owning
    several modules, e.g. ``("conv1", "bn1")``; the unit is named after the first one).

    Models whose units behave differently in training and evaluation mode (batch norm) set
    ``train_mode_aware = True`` and take ``unit_forward(i, params, x, *, train=False)``: with
    ``train=True`` batch norm uses batch statistics and updates the running statistics found in
    ``params`` in place; with ``train=False`` it uses them.
    """

    unit_modules: Sequence[str | tuple[str, ...]] = ()
    prefix_is_deterministic: bool = True
    #: True when the last unit is exactly ``F.linear(x, weight, bias)`` with its two parameters
    #: in that order; ALA then uses the closed-form gradient of cross-entropy for p = 1.
    linear_head: bool = False
    #: True when ``unit_forward`` takes the ``train`` keyword (models with batch norm or dropout).
    train_mode_aware: bool = False
    #: What ``build_model`` checks the input shape against: "image" ([C, H, H]), "tokens" ([L]) or
    #: "features" (any shape, flattened).
    input_kind: str = "image"

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_units(
        self,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        start: int = 0,
        stop: int | None = None,
        *,
        train: bool = False,
    ) -> torch.Tensor:
        mode = {"train": train} if self.train_mode_aware else {}
        last = len(self.unit_modules) - 1
        for index in range(start, len(self.unit_modules) if stop is None else stop):
            between = between_of(params) if index == last and index > 0 else None
            if between is not None:  # modules between body and head route the head (models/between.py)
                return between.route(params, x, lambda p, z: self.unit_forward(last, p, z, **mode))
            x = self.unit_forward(index, params, x, **mode)
        return x

    def forward(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The module's own parameters and buffers (buffers updated in training mode)."""
        keep = set(self.buffer_names())
        own = {**dict(self.named_parameters()), **{n: b for n, b in self.named_buffers() if n in keep}}
        return self.apply_units(own, x, start, stop, train=self.training)

    def buffer_names(self) -> list[str]:
        """Names of the floating buffers (batch-norm running statistics) kept in parameter dicts."""
        return buffer_names(self)

    def units(self) -> Units:
        """Ordered (unit name, parameter names) pairs, input side first (buffers belong to none)."""
        names = [n for n, _ in self.named_parameters()]
        out: Units = []
        for entry in self.unit_modules:
            modules = (entry,) if isinstance(entry, str) else tuple(entry)
            members = [n for n in names if any(n == m or n.startswith(m + ".") for m in modules)]
            if not members:
                raise ValueError(f"unit {modules[0]!r} of {type(self).__name__} owns no parameters")
            out.append((modules[0], members))
        covered = {n for _, ms in out for n in ms}
        missing = [n for n in names if n not in covered]
        if missing:
            raise ValueError(f"parameters not assigned to any unit: {missing}")
        return out


def parameter_names(units: Units) -> list[str]:
    """Every parameter name of the units, input side first (buffers belong to no unit)."""
    return [n for _, members in units for n in members]


def num_outputs(model: UnitModel) -> int:
    """The model's number of outputs (classes): the first dimension of its last unit's first
    parameter (the head's weight)."""
    units = model.units()
    return int(dict(model.named_parameters())[units[-1][1][0]].shape[0])


def top_unit_names(units: Units, p: int) -> list[str]:
    """Parameter names of the top ``p`` units (FedALA Eq. 4's higher layers)."""
    if not 1 <= p <= len(units):
        raise ValueError(f"p={p} is out of range: this model has {len(units)} units ({', '.join(u for u, _ in units)})")
    return [n for _, members in units[len(units) - p :] for n in members]


def head_names(units: Units) -> list[str]:
    """Parameter names of the last unit (the head used by FedRep and friends)."""
    return list(units[-1][1])


def count_parameters(model: nn.Module, names: Sequence[str] | None = None) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in (names if names is not None else params))


def reference_layer_idx(units: Units, p: int) -> int:
    """The FedALA reference code's ``layer_idx`` (tensors from the end) equivalent to unit ``p``."""
    return len(top_unit_names(units, p))


def buffer_names(model: nn.Module) -> list[str]:
    """Floating buffers of ``model`` (batch-norm running statistics), in ``named_buffers()`` order.

    These travel in parameter dicts next to the parameters; integer ``num_batches_tracked``
    counters do not.
    """
    return [n for n, b in model.named_buffers() if b.is_floating_point()]


def statistic_entries(model: nn.Module, keys: Iterable[str]) -> list[str]:
    """The entries of ``keys`` that hold ``model``'s batch-norm statistics: a buffer's own name, or
    one under a method's prefix ending in ``/`` (APFL's personal model in the same dict,
    ``apfl.v/bn1.running_mean``). A training-mode forward updates them in place."""
    names = set(buffer_names(model))
    return [k for k in keys if k in names or ("/" in k and k.rsplit("/", 1)[1] in names)]


def norm_layers(names: Iterable[str]) -> set[str]:
    """The batch-norm layers among a model's entry ``names``: each known by its ``running_mean``."""
    suffix = ".running_mean"
    return {n[: -len(suffix)] for n in names if n.endswith(suffix)}


def check_buffers(model: nn.Module) -> None:
    """Refuse buffers pflkit cannot carry in parameter dicts (integer buffers other than
    ``num_batches_tracked``, complex buffers)."""
    bad = [
        f"{n} ({b.dtype})"
        for n, b in model.named_buffers()
        if not b.is_floating_point() and n.rsplit(".", 1)[-1] not in IGNORED_BUFFERS
    ]
    if bad:
        raise NotImplementedError(
            f"{type(model).__name__} has buffers pflkit does not handle: {', '.join(bad[:3])}"
            f"{'...' if len(bad) > 3 else ''}; only floating buffers (batch-norm running statistics) "
            "are kept per client"
        )
