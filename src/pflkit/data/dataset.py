"""The pool of labelled samples that every dataset reader returns: images or token ids,
and the official train/test boundary where the dataset has one.

The readers (cifar, tiny_imagenet, agnews and sources' own MNIST, digits and synthetic) import it
from here, so sources.py, which dispatches to the readers by name, imports them at the top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Dataset"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """A pool of labelled samples, ``y`` int64 ``[n]`` and ``x`` either

    * images: float32 ``[n, C, H, W]`` (normalised), ``vocab_size`` None, or
    * token ids: int64 ``[n, L]`` in ``0..vocab_size-1`` (``vocab_size`` required).
    """

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    vocab_size: int | None = None
    #: The first ``official_train`` samples are the dataset's official training split, the rest
    #: its official test split (None: the dataset has no official split).
    official_train: int | None = None

    def __post_init__(self) -> None:
        if self.x.dtype == torch.int64 and self.x.dim() == 2:
            if self.vocab_size is None or self.vocab_size < 1:
                raise ValueError(
                    f"Dataset {self.name!r}: token ids x (int64 [n, L]) need vocab_size >= 1, got {self.vocab_size}"
                )
            if self.x.numel() and (int(self.x.min()) < 0 or int(self.x.max()) >= self.vocab_size):
                raise ValueError(
                    f"Dataset {self.name!r}: token ids must be in 0..{self.vocab_size - 1}, "
                    f"found {int(self.x.min())}..{int(self.x.max())}"
                )
        elif self.x.dtype != torch.float32 or self.x.dim() != 4:
            raise ValueError(
                f"Dataset {self.name!r}: x must be float32 [n, C, H, W] (images) or int64 [n, L] "
                f"(token ids), got {self.x.dtype} {tuple(self.x.shape)}"
            )
        elif self.vocab_size is not None:
            raise ValueError(f"Dataset {self.name!r}: vocab_size is only for token ids, not images")
        if self.y.dtype != torch.int64 or self.y.dim() != 1:
            raise ValueError(f"Dataset {self.name!r}: y must be int64 [n], got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.x) != len(self.y):
            raise ValueError(f"Dataset {self.name!r}: {len(self.x)} images but {len(self.y)} labels")
        if self.official_train is not None and not 0 <= self.official_train <= len(self.y):
            raise ValueError(
                f"Dataset {self.name!r}: official_train={self.official_train} is outside its {len(self.y)} samples"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``(C, H, W)`` or ``(L,)``."""
        return tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.y)
