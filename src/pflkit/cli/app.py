"""The ``pflkit`` command group."""

from __future__ import annotations

import logging

import click


@click.group()
@click.version_option(package_name="pflkit")
@click.option("--debug", is_flag=True, help="show the traceback of errors instead of one line")
def main(debug: bool) -> None:
    """Personalized federated learning: FedALA and its baselines, simulated or on Flower."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
