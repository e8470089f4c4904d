"""The pflkit ClientApp: the same client functions as the simulator, behind Flower messages.

``query``: report this node's client id, training-set size and label counts (for ``prepare``).
``train``: local initialisation (e.g. ALA), personalised evaluation (returned with the reply, as
pFL needs), local training, upload. ``evaluate``: the final evaluation-only pass.
Per-client state persists in ``context.state`` (one entry per algorithm and seed) and, when the
node config names a ``state-dir``, on disk, so a restarted SuperNode carries on; on Flower's
Simulation Engine with ``state_store = "disk"`` the server names a folder under the results instead
and the state lives only there (thousands of virtual nodes hold none in memory). The state after
the client's latest round is kept with the one before it, so a round that a restarted ServerApp
sends again starts from the same state as the first time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..engines import ClientJob, ClientResult, run_client
from .node import (
    add_version,
    load_state,
    node_run,
    node_setup,
    save_state,
    state_before,
    state_file,
    state_key,
    versions_from_record,
    versions_to_record,
)
from .serde import get as get_values
from .serde import has as has_values
from .serde import put as put_values

log = logging.getLogger("flwr")  # Flower's handler prints it in the SuperNode's log
app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    meta: Mapping[str, Any] = message.content["pflkit"]  # the ConfigRecord the server wrote
    setup = node_setup(str(meta["config"]), context.node_config, int(meta["seed"]))
    counts = np.bincount(setup.client.train_y.cpu().numpy(), minlength=setup.data.num_classes)
    reply = ConfigRecord(
        {
            "client-id": setup.client_id,
            "num-train": setup.client.num_train,
            "num-test": setup.client.num_test,
            "label-counts": [int(c) for c in counts],
            "input-shape": [int(s) for s in setup.data.input_shape],
            "num-classes": int(setup.data.num_classes),
            "vocab-size": int(setup.data.vocab_size or 0),
        }
    )  # 0: image data
    return Message(RecordDict({"pflkit": reply}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    return _client_round(message, context, train=True)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return _client_round(message, context, train=False)


def _client_round(message: Message, context: Context, train: bool) -> Message:
    meta: Mapping[str, Any] = message.content["pflkit"]  # the ConfigRecord the server wrote
    name, seed, round = str(meta["algorithm"]), int(meta["seed"]), int(meta["round"])
    run = node_run(str(meta["config"]), context.node_config, name, seed)
    setup, algorithm = run.setup, run.round_setup.algorithm
    if "newcomer" in meta:  # a client that never trains, scored as a newcomer: no state is read or kept
        payload = get_values(message.content, "payload", setup.device)
        fresh = algorithm.newcomer_state(setup.init, payload, setup.client_id)
        steps = int(meta["newcomer-steps"]) if "newcomer-steps" in meta else None
        lr = float(meta["newcomer-lr"]) if "newcomer-lr" in meta else None
        job = ClientJob(
            setup.client_id,
            payload,
            fresh,
            True,
            False,
            finetune=int(meta["newcomer"]),
            finetune_steps=steps,
            finetune_lr=lr,
        )
        return _reply(message, setup.client_id, run_client(run.round_setup, job, round))
    key = state_key(name, seed)
    shared = meta["state-dir"] if "state-dir" in meta else None  # the simulation's folder: no copy in memory
    path = (
        Path(str(shared)) / f"client{setup.client_id}" / f"{key}.pt"
        if shared is not None
        else state_file(context.node_config, key)
    )
    if shared is None and has_values(context.state, key):
        versions = versions_from_record(get_values(context.state, key, setup.device))
    elif path is not None and path.is_file():
        versions = load_state(path, setup.device)
        log.info("client %d resumes %s from its state saved after round %d", setup.client_id, key, versions[0][0])
    else:
        versions = []
    if "lost-rounds" in meta:  # rounds this client trained whose reply never counted: undo them
        lost = {int(r) for r in meta["lost-rounds"]}
        versions = [(r, s) for r, s in versions if r not in lost]
    state = state_before(versions, round)
    if state is None:
        if versions:
            raise RuntimeError(
                f"client {setup.client_id} holds no state of {key} from before round {round} "
                f"(its saved rounds: {[r for r, _ in versions]})"
            )
        state = algorithm.init_client(setup.init, setup.client_id)
    payload = get_values(message.content, "payload", setup.device)
    work = float(meta["work"]) if "work" in meta else 1.0  # (a float the server wrote)
    job = ClientJob(setup.client_id, payload, state, bool(meta["evaluate"]), train, work=work)
    result = run_client(run.round_setup, job, round)
    content = RecordDict()
    metrics = _metrics(setup.client_id, result)
    if train:
        assert result.state is not None and result.upload is not None  # (a trained client's result)
        versions = add_version(versions, round, result.state)
        if shared is None:
            put_values(context.state, key, versions_to_record(versions))
        if path is not None:
            save_state(path, versions)
        upload = result.upload
        metrics["num-examples"] = int(upload["num_samples"])
        put_values(content, "upload", upload)
    content["metrics"] = MetricRecord(metrics)
    return Message(content, reply_to=message)


def _metrics(client_id: int, result: ClientResult) -> dict[str, Any]:
    """A reply's metrics: the client's numbers, its id and its evaluation."""
    metrics: dict[str, Any] = {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}
    metrics.update({k: [float(x) for x in v] for k, v in result.metrics.items() if isinstance(v, list)})
    metrics["client-id"] = client_id
    if result.evaluation is not None:
        metrics.update({f"eval.{k}": float(v) for k, v in result.evaluation.items()})
    return metrics


def _reply(message: Message, client_id: int, result: ClientResult) -> Message:
    """The reply of an evaluation without training: metrics only."""
    return Message(RecordDict({"metrics": MetricRecord(_metrics(client_id, result))}), reply_to=message)
