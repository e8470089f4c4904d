"""FedPer (Arivazhagan et al., 2019) with a chosen number of personal units, written outside
pflkit: the body is federated, the top ``head_units`` units stay on each client (pflkit's own
``fedper`` keeps the last one). Run it with ``algorithms = ["mylab_methods:FedPer"]`` (this file on
PYTHONPATH), or ``"mylab_methods:FedPer+ala"`` for FedPer + ALA.
"""

from __future__ import annotations

from pydantic import Field

from pflkit.algorithms import Algorithm, ClientContext, Payload, Settings, State, Trained


class FedPerSettings(Settings):
    """The ``[myfedper]`` section of a config."""

    head_units: int = Field(1, ge=1, description="top units of the model that stay personal")


class FedPer(Algorithm):
    name = "myfedper"  # its config section: pflkit's methods own theirs (``fedper`` among them)
    settings_class = FedPerSettings
    has_global_model = False  # the server never trains a head: its model is no model to score

    def head(self) -> set[str]:
        """The parameter names of the personal head (the top ``head_units`` units)."""
        return {name for _, names in self.units[-self.settings.head_units:] for name in names}

    def downloaded_names(self, names: list[str]) -> list[str]:
        """The download carries the body only; ``receive`` then overwrites just the body."""
        return [n for n in super().downloaded_names(names) if n not in self.head()]

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        """E epochs of cross-entropy on body and head together; the body is uploaded."""
        fit = self.train_model(state["model"], ctx, self.loss())
        body = {k: v for k, v in fit.params.items() if k not in self.head()}
        return {**state, "model": fit.params}, self.upload(body, ctx), {"train_loss": fit.loss}
