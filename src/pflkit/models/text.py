"""Text models of the FedALA family."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from .base import UnitModel


class FastText(UnitModel):
    """fastText for AG News as in FedALA/PFLlib.

    embedding (vocab x 32, padding_idx 0) -> mean over all token positions (padding included;
    the padding row is zero-initialised and gets no gradient) -> fc1 Linear(32, 32) without
    activation (as in the reference) -> fc Linear(32, C). Input: int64 token ids [n, L].
    Units: embedding, fc1, fc.
    """

    unit_modules = ("embedding", "fc1", "fc")
    linear_head = True
    input_kind = "tokens"
    padding_idx = 0

    def __init__(self, vocab_size: int, num_classes: int = 4, hidden_dim: int = 32, seq_len: int | None = None) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"fastText needs a vocabulary of at least 2 tokens (padding included), got {vocab_size}")
        if seq_len is not None and seq_len < 1:
            raise ValueError(f"fastText needs sequences of at least one token, got length {seq_len}")
        self.seq_len = seq_len
        self.embedding = nn.Embedding(vocab_size, hidden_dim, padding_idx=self.padding_idx)
        self.fc1 = nn.Linear(hidden_dim, hidden_dim)
        self.fc = nn.Linear(hidden_dim, num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            # [n, L] ids -> [n, L, d] -> mean over the L positions (dim -2 also under vmap)
            return F.embedding(x, params["embedding.weight"], padding_idx=self.padding_idx).mean(-2)
        if index == 1:
            return F.linear(x, params["fc1.weight"], params["fc1.bias"])
        return F.linear(x, params["fc.weight"], params["fc.bias"])
