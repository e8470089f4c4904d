"""Feature shift: every client's images seen through its own domain (the ``[feature_shift]`` section).

A domain is a fixed, offline transform of a client's training and test images, drawn on top of any
label partition (the partition itself is unchanged). The transforms, applied in this order:

* ``rotate``: the clients form ``k`` contiguous groups, client ``i`` of ``N`` gets angle
  ``angles[i * k // N]`` (default: ``k = rotations`` angles ``360 * j / k``, counter-clockwise).
  Multiples of 180 degrees, and of 90 on square images, are exact (``torch.rot90``); other angles
  resample bilinearly on an affine grid, the corners filled with the images' minimum value.
* ``invert``: the clients form ``colour_groups`` contiguous groups (the same rule); the odd groups
  see inverted images, ``x -> lo + hi - x`` with ``lo``, ``hi`` the images' value range.
* ``tint``: group ``g >= 1`` of the ``colour_groups`` blends every pixel toward a colour,
  ``x -> (1 - tint_strength) * x + tint_strength * c_g``: red, green, blue, yellow, magenta, cyan
  (in turn) for RGB images, grey level ``g / (colour_groups - 1)`` of the value range (a brighter
  background) for other channel counts; group 0 keeps its images.
* ``noise``: NIID-Bench's noise-based feature imbalance (``experiments.py`` of
  Xtra-Computing/NIID-Bench, ``noise_type = "level"``: ``noise / (n_parties - 1) * net_id``):
  client ``i`` gets Gaussian noise of standard deviation ``noise_sigma * i / (N - 1)`` (client 0
  none, the last client ``noise_sigma``), in units of the value range (NIID-Bench adds it to
  pixels in [0, 1]). NIID-Bench draws new noise at every read; here it is drawn once, from the
  partition seed and the client id, so a partition seed gives the same images everywhere.

The global test set (``test_set = "official"``) keeps its images (``global_test = "original"``)
or spreads the domains over its samples (``"domains"``: sample ``j`` gets client ``j % N``'s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pflkit.data.errors import DataError
from pflkit.functional.streams import torch_generator

if TYPE_CHECKING:
    from pflkit.data.federated import FederatedData

__all__ = [
    "TRANSFORMS",
    "Domain",
    "FeatureShift",
    "apply_feature_shift",
    "client_domain",
    "shift_images",
    "shift_test_set",
]

#: The transforms, in the order they are applied.
TRANSFORMS: tuple[str, ...] = ("rotate", "invert", "tint", "noise")
_PALETTE = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1))


class FeatureShift(BaseModel):
    """The ``[feature_shift]`` section: per-client domain transforms of the images."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    transforms: list[str] = Field(
        default_factory=list,
        description="domain transforms of each client's train and test images, applied in the order "
        "rotate, invert, tint, noise (any of them); empty: no feature shift",
    )
    rotations: int = Field(
        4, ge=1, description="rotate: k angles 360*j/k; client i of N gets angle index i*k//N (contiguous groups)"
    )
    angles: list[float] | None = Field(
        None, description="rotate: the angles in degrees (counter-clockwise) instead of rotations evenly spaced"
    )
    noise_sigma: float = Field(
        0.1,
        ge=0,
        description="noise: client i of N gets Gaussian noise of std noise_sigma*i/(N-1) "
        "(NIID-Bench), in units of the images' value range, drawn once from the partition seed",
    )
    colour_groups: int = Field(
        2,
        ge=2,
        description="invert/tint: contiguous client groups (client i of N in group i*G//N); "
        "invert flips the odd groups, tint colours groups 1..G-1",
    )
    tint_strength: float = Field(0.5, gt=0, le=1, description="tint: blend of each pixel toward its group's colour")
    global_test: Literal["original", "domains"] = Field(
        "original",
        description="test_set = official: the global test set keeps its images (original), or its "
        "sample j gets client j % N's domain (domains)",
    )

    @field_validator("transforms")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in TRANSFORMS:
                raise ValueError(f"unknown transform {name!r}; available: {', '.join(TRANSFORMS)}")
        if len(set(names)) != len(names):
            raise ValueError("transforms contains duplicates")
        return names

    @field_validator("angles")
    @classmethod
    def _some_angles(cls, angles: list[float] | None) -> list[float] | None:
        if angles is not None and not angles:
            raise ValueError("is empty: give at least one angle, or drop angles for rotations")
        return angles

    @model_validator(mode="after")
    def _one_angle_setting(self) -> FeatureShift:
        if self.angles is not None and "rotations" in self.model_fields_set and self.rotations != len(self.angles):
            raise ValueError(f"rotations = {self.rotations} but angles lists {len(self.angles)}: set one of them")
        return self

    @property
    def active(self) -> bool:
        return bool(self.transforms)

    @property
    def rotation_angles(self) -> list[float]:
        """The k angles of ``rotate``."""
        if self.angles is not None:
            return list(self.angles)
        return [360.0 * j / self.rotations for j in range(self.rotations)]

    def check_clients(self, num_clients: int, clients_key: str = "num_clients") -> None:
        """ValueError where a group count of the active transforms exceeds the clients
        (``clients_key``: how the message names the client count)."""
        groups = {}
        if "rotate" in self.transforms:
            groups["angles" if self.angles is not None else "rotations"] = len(self.rotation_angles)
        if "invert" in self.transforms or "tint" in self.transforms:
            groups["colour_groups"] = self.colour_groups
        for key, k in groups.items():
            if k > num_clients:
                raise ValueError(
                    f"feature_shift.{key} gives {k} domain groups but {clients_key} = {num_clients}: "
                    "at most one group per client"
                )


@dataclass(frozen=True)
class Domain:
    """One client's domain: its rotation, colour group and noise level (std in value-range units)."""

    rotation: float = 0.0
    invert: bool = False
    tint: int = 0
    noise_std: float = 0.0

    def record(self) -> dict[str, Any]:
        return {
            "rotation": self.rotation,
            "invert": self.invert,
            "tint": self.tint,
            "noise_std": self.noise_std,
            "label": self.label(),
        }

    def label(self) -> str:
        """A short label for plots: ``rot 90, inv, tint 1, noise 0.05`` (only what differs from none)."""
        parts = [f"rot {self.rotation:g}" if self.rotation % 360 else ""]
        parts += ["inv" if self.invert else "", f"tint {self.tint}" if self.tint else ""]
        parts.append(f"noise {self.noise_std:.3f}" if self.noise_std else "")
        return ", ".join(p for p in parts if p) or "original"


def client_domain(spec: FeatureShift, client: int, num_clients: int) -> Domain:
    """The domain of client ``client`` of ``num_clients`` (contiguous groups, see the module docstring)."""
    if not 0 <= client < num_clients:
        raise ValueError(f"client {client} is not one of {num_clients} clients")
    out = Domain()
    if "rotate" in spec.transforms:
        angles = spec.rotation_angles
        out = replace(out, rotation=float(angles[client * len(angles) // num_clients]))
    group = client * spec.colour_groups // num_clients
    if "invert" in spec.transforms:
        out = replace(out, invert=group % 2 == 1)
    if "tint" in spec.transforms:
        out = replace(out, tint=group)
    if "noise" in spec.transforms and num_clients > 1:
        out = replace(out, noise_std=spec.noise_sigma * client / (num_clients - 1))
    return out


def rotate(x: torch.Tensor, degrees: float, fill: float = 0.0) -> torch.Tensor:
    """Images ``[n, C, H, W]`` rotated counter-clockwise by ``degrees`` (shape kept; see the module docstring)."""
    turns = degrees / 90.0
    h, w = x.shape[-2:]
    if turns == round(turns) and (round(turns) % 2 == 0 or h == w):
        return torch.rot90(x, round(turns) % 4, dims=(-2, -1))
    a = math.radians(degrees)
    cos, sin = math.cos(a), math.sin(a)
    # output pixel -> input pixel in pixel units, scaled to affine_grid's [-1, 1] coordinates
    theta = torch.tensor([[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]], dtype=x.dtype, device=x.device)
    grid = F.affine_grid(theta.expand(len(x), 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


def shift_images(
    x: torch.Tensor,
    domain: Domain,
    value_range: tuple[float, float],
    generator: torch.Generator | None = None,
    colour_groups: int = 2,
    tint_strength: float = 0.5,
) -> torch.Tensor:
    """Images ``x`` ``[n, C, H, W]`` in ``domain``; ``value_range``: (lo, hi) of the dataset's images,
    ``generator``: the noise's source (a CPU generator, so that the noise is the same on every device)."""
    lo, hi = value_range
    if domain.rotation % 360:
        x = rotate(x, domain.rotation, fill=lo)
    if domain.invert:
        x = lo + hi - x
    if domain.tint:
        if x.shape[1] == 3:
            colour = torch.tensor(_PALETTE[(domain.tint - 1) % len(_PALETTE)], dtype=x.dtype, device=x.device)
        else:
            colour = torch.full((x.shape[1],), domain.tint / (colour_groups - 1), dtype=x.dtype, device=x.device)
        x = (1 - tint_strength) * x + tint_strength * (lo + (hi - lo) * colour.view(1, -1, 1, 1))
    if domain.noise_std:
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
        x = x + noise * (domain.noise_std * (hi - lo))
    return x


def shift_test_set(
    x: torch.Tensor, spec: FeatureShift, num_clients: int, seed: int, value_range: tuple[float, float]
) -> torch.Tensor:
    """A global test set with the domains spread over it (``global_test = "domains"``): sample ``j``
    gets client ``j % num_clients``'s domain, noise from partition seed ``seed``."""
    out = x.clone()
    generator = torch_generator(seed, "feature-shift", "global-test")
    for i in range(min(num_clients, len(x))):
        picked = torch.arange(i, len(x), num_clients, device=x.device)
        domain = client_domain(spec, i, num_clients)
        out[picked] = shift_images(x[picked], domain, value_range, generator, spec.colour_groups, spec.tint_strength)
    return out


def _check_images(fed: FederatedData, spec: FeatureShift) -> torch.Tensor:
    x = fed.x
    if x is None or x.dim() != 4 or not x.is_floating_point():
        shape = "no tensors" if x is None else f"{x.dtype} samples of shape {tuple(x.shape[1:])}"
        raise DataError(
            f"feature_shift.transforms = {spec.transforms} changes images [C, H, W], but dataset "
            f"{fed.dataset!r} holds {shape} (token ids are no images): drop feature_shift.transforms"
        )
    return x


def apply_feature_shift(fed: FederatedData, spec: FeatureShift, seed: int) -> FederatedData:
    """``fed`` with every client's train and test images in its domain (partition seed ``seed``
    draws the noise); the label partition is unchanged and each client's domain is in
    ``partition_info["domains"]`` (after the client's own domain, where its data has one). Without
    transforms, ``fed`` itself."""
    if not spec.active:
        return fed
    x = _check_images(fed, spec)
    assert fed.y is not None
    try:
        spec.check_clients(fed.num_clients, f"the clients of {fed.dataset!r}")
    except ValueError as exc:
        raise DataError(str(exc)) from None
    lo, hi = float(x.min()), float(x.max())
    n = fed.num_clients
    domains = [client_domain(spec, i, n) for i in range(n)]

    def shift(images: torch.Tensor, domain: Domain, generator: torch.Generator) -> torch.Tensor:
        return shift_images(images, domain, (lo, hi), generator, spec.colour_groups, spec.tint_strength)

    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    global_rows = None
    if fed.global_test_rows is not None:
        gx = x[fed.global_test_rows]
        if spec.global_test == "domains":
            gx = shift_test_set(gx, spec, n, seed, (lo, hi))
        global_rows = torch.arange(len(gx), device=x.device)
        xs.append(gx)
        ys.append(fed.y[fed.global_test_rows])
    for i, client in enumerate(fed.clients):
        generator = torch_generator(seed, "feature-shift", client.client_id)
        xs += [shift(client.train_x, domains[i], generator), shift(client.test_x, domains[i], generator)]
        ys += [client.train_y, client.test_y]
    new_x, new_y = torch.cat(xs), torch.cat(ys)
    records = [d.record() for d in domains]
    before = fed.partition_info.get("domains")
    if isinstance(before, list) and len(before) == n:  # the clients' own domains (multi-domain data) come first
        records = [{**b, **r, "label": f"{b['label']}, {r['label']}"} for b, r in zip(before, records)]
    offset = 0 if global_rows is None else len(global_rows)
    clients = []
    for c in fed.clients:
        mid, end = offset + c.num_train, offset + c.num_train + c.num_test
        tr = torch.arange(offset, mid, device=x.device)
        te = torch.arange(mid, end, device=x.device)
        clients.append(replace(c, train_x=new_x[offset:mid], test_x=new_x[mid:end], train_rows=tr, test_rows=te))
        offset = end
    info = {
        **fed.partition_info,
        "feature_shift": {
            **spec.model_dump(mode="json"),
            "rule": "client i of N: rotation angles[i * k // N], colour group i * colour_groups // N, "
            "noise std noise_sigma * i / (N - 1)",
            "value_range": [lo, hi],
        },
        "domains": records,
    }
    return replace(fed, clients=clients, x=new_x, y=new_y, partition_info=info, global_test_rows=global_rows)
