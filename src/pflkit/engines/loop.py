"""The reference engine: clients of a round one after another in this process."""

from __future__ import annotations

from .base import ClientJob, ClientResult, RoundSetup, run_client


class LoopEngine:
    name = "loop"

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        return [run_client(setup, job, round) for job in jobs]

    def close(self) -> None:
        pass
