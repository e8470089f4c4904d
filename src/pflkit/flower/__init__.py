"""Flower integration (optional extra ``pflkit[flower]``): pflkit algorithms on real machines.

``pflkit.flower.client_app:app`` and ``pflkit.flower.server_app:app`` are the Flower apps;
``run_on_flower`` drives an experiment over any Flower ``Grid``; ``LocalGrid`` runs the same
apps in-process. The core package never imports this module.
"""

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("pflkit.flower needs Flower: pip install -e '.[flower]' in a pflkit clone") from exc

from .server import discover, run_on_flower

__all__ = ["discover", "run_on_flower"]
