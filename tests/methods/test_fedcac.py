"""FedCAC: the critical mask by hand, and whole rounds against my transcription of the authors'
code (FLAIR-Community/Fling faebd06: ``fling/component/client/fedcac_client.py`` train and
evaluate_critical_parameter, ``fling/component/group/fedcac_group.py`` aggregate,
get_customized_global_models and sync, ``fling/utils/compress_utils/fed_avg.py``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.base import ROUND_INFO
from pflkit.algorithms.fedcac import collaboration_threshold, critical_mask, overlaps
from tests.support.builders import batch_pairs, build, client_context, params_of
from tests.support.checks import assert_expected_close
from tests.support.references import module_at, weights


def test_critical_mask_by_hand():
    old = torch.zeros(8)
    new = torch.tensor([1.0, -3.0, 0.5, 2.0, 0.0, -0.1, 4.0, 0.2])  # c = new^2
    assert critical_mask(new, old, 0.5, 0).tolist() == [True, True, False, True, False, False, True, False]
    assert critical_mask(new, old, 0.25, 0).tolist() == [False, True, False, False, False, False, True, False]
    # the 4th largest c is 0: the smallest positive c (0.01) becomes the threshold
    sparse = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 2.0, -0.1, 0.0])
    assert critical_mask(sparse, old, 0.5, 0).tolist() == [False] * 5 + [True, True, False]
    # nothing changed: every c is 0, and the authors' threshold (0) marks every entry
    assert critical_mask(new, new, 0.5, 0).all()
    # fewer entries than 1 / tau: int(tau n) = 0 and no entry is critical
    assert not critical_mask(torch.ones(1), torch.zeros(1), 0.5, 0).any()
    # per client along a leading dimension
    batched = critical_mask(torch.stack([new, -new.flip(0)]), torch.zeros(2, 8), 0.25, 1)
    assert batched[0].tolist() == critical_mask(new, old, 0.25, 0).tolist()
    assert batched[1].tolist() == critical_mask(-new.flip(0), old, 0.25, 0).tolist()


def test_overlap_and_threshold_by_hand():
    """Overlap of i with j: 1 - |m_i - m_j| / (2 |m_i|), over every tensor; asymmetric where the
    masks differ in size; a client without critical entries overlaps no one."""
    masks = [
        {"a": torch.tensor([1, 1, 0, 0], dtype=torch.bool), "b": torch.tensor([[1, 0]], dtype=torch.bool)},
        {"a": torch.tensor([1, 0, 0, 0], dtype=torch.bool), "b": torch.tensor([[1, 1]], dtype=torch.bool)},
        {"a": torch.tensor([0, 0, 0, 0], dtype=torch.bool), "b": torch.tensor([[0, 0]], dtype=torch.bool)},
    ]
    rate = overlaps(masks)
    # |m_0| = 3, |m_1| = 3, |m_0 - m_1| = 2; |m_2| = 0
    expected = [[1.0, 1 - 2 / 6, 1 - 3 / 6], [1 - 2 / 6, 1.0, 1 - 3 / 6], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(rate, torch.tensor(expected))
    masks[1]["b"] = torch.tensor([[0, 1]], dtype=torch.bool)  # |m_1| = 2, |m_0 - m_1| = 3
    rate = overlaps(masks)
    assert float(rate[0, 1]) == pytest.approx(1 - 3 / 6) and float(rate[1, 0]) == pytest.approx(1 - 3 / 4)
    pairs = [float(rate[i, j]) for i in range(3) for j in range(3) if i != j]
    mean = sum(pairs) / 6
    assert collaboration_threshold(rate, 2, 4) == pytest.approx(mean + 0.5 * (max(pairs) - mean))
    assert collaboration_threshold(rate[:1, :1], 1, 4) == float("inf")


# ============================================================================ the authors' code
class FlingClient:
    """FedCACClient: its model, its critical_parameter vector and the local / global masks."""

    def __init__(self, ctx, model: torch.nn.Module) -> None:
        self.ctx, self.model = ctx, model
        self.customized_model = copy.deepcopy(model)
        self.sample_num = ctx.num_train

    def train(self, ctx, tau: float) -> None:
        """train: keep the model before local training, BaseClient.train (SGD over local_eps
        epochs: CE, zero_grad, backward, step), then evaluate_critical_parameter."""
        initial_model = copy.deepcopy(self.model)
        opt = torch.optim.SGD(self.model.parameters(), lr=ctx.train.lr, momentum=ctx.train.momentum)
        self.model.train()
        for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
            loss = F.cross_entropy(self.model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.critical_parameter, self.global_mask, self.local_mask = [], [], []
        for prevparam, param in zip(initial_model.parameters(), self.model.parameters()):
            c = torch.abs((param.data - prevparam.data) * param.data)
            metric = c.view(-1)
            nz = int(tau * metric.size(0))
            top_values, _ = torch.topk(metric, nz)
            thresh = top_values[-1] if len(top_values) > 0 else np.inf
            if thresh <= 1e-10:
                new_metric = metric[metric > 1e-20]
                if len(new_metric) > 0:
                    thresh = new_metric.sort()[0][0]
            self.local_mask.append((c >= thresh).int())
            self.global_mask.append((c < thresh).int())
            self.critical_parameter.append((c >= thresh).int().view(-1))
        self.critical_parameter = torch.cat(self.critical_parameter)


def fling_aggregate(clients: list[FlingClient], epoch: int, beta: int) -> dict:
    """FedCACServerGroup.aggregate: fed_avg (sample-weighted), get_customized_global_models with the
    group's epoch counter, then sync (local_mask * customised + global_mask * global). Returns the
    global state dict."""
    total = sum(c.sample_num for c in clients)
    glob = {
        k: sum(c.sample_num / total * c.model.state_dict()[k] for c in clients) for k in clients[0].model.state_dict()
    }
    n = len(clients)
    overlap_buffer = [[] for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            overlap_rate = 1 - torch.sum(
                torch.abs(clients[i].critical_parameter - clients[j].critical_parameter)
            ) / float(torch.sum(clients[i].critical_parameter) * 2)
            overlap_buffer[i].append(overlap_rate)
    overlap_tensor = torch.tensor(overlap_buffer)
    overlap_avg = overlap_tensor.sum() / ((n - 1) * n)
    threshold = overlap_avg + (epoch + 1) / beta * (overlap_tensor.max() - overlap_avg)
    for i in range(n):
        w = copy.deepcopy(clients[i].model.state_dict())
        collaboration = [i]
        index = 0
        for j in range(n):
            if i == j:
                continue
            if overlap_buffer[i][index] >= threshold:
                collaboration.append(j)
            index += 1
        for key in w:
            for c in collaboration[1:]:
                w[key] += clients[c].model.state_dict()[key]
            w[key] = torch.div(w[key], float(len(collaboration)))
        clients[i].customized_model.load_state_dict(w)
    temp = copy.deepcopy(clients[0].model)
    temp.load_state_dict(glob)
    for c in clients:
        for index, (p1, p2, p3) in enumerate(
            zip(c.model.parameters(), temp.parameters(), c.customized_model.parameters())
        ):
            p1.data = c.local_mask[index].float() * p3.data + c.global_mask[index].float() * p2.data
    return glob


SIZES = (40, 30, 50, 20)


def contexts(round: int, classes) -> list:
    return [
        client_context(
            i, n_train=n, data_seed=50 + i, classes=classes[i], round=round, lr=0.05, momentum=0.9, local_epochs=2
        )
        for i, n in enumerate(SIZES)
    ]


@pytest.mark.parametrize("tau,beta", [(0.5, 3), (0.3, 5)])
def test_fedcac_rounds_match_the_authors_group(tau, beta):
    """Four clients of overlapping label sets, three rounds: every client's model after the server's
    sync (pflkit: the next round's download), the global model and the masks agree."""
    classes = [[0, 1, 2], [1, 2, 3], [5, 6, 7], [6, 7, 8]]
    first = contexts(1, classes)
    alg = build("fedcac", first[0], f"fedcac.tau={tau}", f"fedcac.beta={beta}")
    init = params_of(first[0], 1)
    server = alg.init_server(init)
    states = [alg.init_client(init, i) for i in range(len(SIZES))]
    fling = [FlingClient(ctx, module_at(ctx.model, init)) for ctx in first]
    collaborators = []
    for t in range(1, 4):
        ctxs = contexts(t, classes)
        uploads = []
        for i, ctx in enumerate(ctxs):
            payload = alg.downlink(server, i, t)
            assert_expected_close(payload["global"], weights(fling[i].model))  # the authors' sync
            state, _ = alg.local_init(payload, states[i], ctx)
            states[i], upload, _ = alg.local_train(payload, state, ctx)
            uploads.append({**upload, "num_samples": int(upload["num_samples"]), "client_id": i})
            fling[i].train(ctx, tau)
            assert_expected_close(upload["params"], weights(fling[i].model))
            mask = torch.cat([upload["critical"][k].reshape(-1) for k in alg.parameter_names]).int()
            assert torch.equal(mask, fling[i].critical_parameter)
        server = alg.aggregate(server, uploads, t)
        glob = fling_aggregate(fling, t - 1, beta)
        assert_expected_close(server["global"], glob)
        collaborators.append(server[ROUND_INFO]["fedcac_collaborators"])
    for i in range(len(SIZES)):
        assert_expected_close(alg.downlink(server, i, 4)["global"], weights(fling[i].model))
    # the rounds cover partial collaboration: neither every client nor none but the client itself
    assert any(1 < c < len(SIZES) for c in collaborators), collaborators


def test_fedcac_refuses_partial_participation():
    from pflkit.methods import method_class

    assert method_class("fedcac").requires_full_participation


@pytest.mark.integration
def test_fedcac_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.config import load_config
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, [*fast_config, 'algorithms=["fedcac+ala"]', "rounds=3"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedcac+ala", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")
