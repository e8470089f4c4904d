"""pflkit: personalized federated learning on PyTorch (FedALA and its baselines)."""

__version__ = "0.3.0"
