"""FedProto against my transcriptions of the authors' code and of PFLlib's port.

References read (written from reading them, not copied): yuetan031/FedProto 97e42e2,
``lib/update.py`` (``LocalUpdate.update_weights_het``: SGD momentum 0.5, NLLLoss of the log-softmax
plus ld * MSELoss(proto_new, protos) with proto_new the features with each row replaced by its
class's global prototype where there is one; the features of every step's forward collected per
class, the collection restarted every epoch; ``test_inference_new_het_lt``: the nearest global
prototype by MSE among the classes that have one and that the client holds, 100 elsewhere),
``lib/utils.py`` (``agg_func``: the mean of a class's features; ``proto_aggregation``: the mean over
the clients that uploaded the class), ``lib/models/models.py`` (``CNNMnist`` returns the log-softmax
and the features before the classifier). TsingZ0/PFLlib d832e76 ``system/flcore/clients/clientproto.py``
(features collected over every epoch; ``test_metrics``: the nearest of every class's global
prototype) and ``system/flcore/servers/serverproto.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.engines import SingleClientContext
from pflkit.functional import forward
from pflkit.models import build_model
from tests.support.builders import batch_pairs, build, client_context, params_of
from tests.support.checks import assert_params_close


class AuthorsNet(nn.Module):
    """The digits CNN as the authors' ``CNNMnist`` returns it: (log-softmax, features of fc1)."""

    def __init__(self, model: nn.Module, params: dict) -> None:
        super().__init__()
        self.m = copy.deepcopy(model)
        with torch.no_grad():
            for k, p in self.m.named_parameters():
                p.copy_(params[k])

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.m.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.m.conv2(x), 2))
        x1 = F.relu(self.m.fc1(x.flatten(1)))
        return F.log_softmax(self.m.fc(x1), dim=1), x1


def weights_of(net: AuthorsNet) -> dict:
    return {k: v.detach().clone() for k, v in net.m.named_parameters()}


def authors_update_weights_het(net: AuthorsNet, epochs_of_batches, global_protos: dict, lr: float, ld: float):
    """``update_weights_het``: per epoch a fresh ``agg_protos_label``; per batch NLL + ld * MSE(proto_new,
    protos), step; each sample's features appended under its label. Then ``agg_func``."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.5)
    criterion, loss_mse = nn.NLLLoss(), nn.MSELoss()
    for batches in epochs_of_batches:
        agg_protos_label: dict = {}
        for images, labels in batches:
            net.zero_grad()
            log_probs, protos = net(images)
            loss1 = criterion(log_probs, labels)
            if len(global_protos) == 0:
                loss2 = 0 * loss1
            else:
                proto_new = copy.deepcopy(protos.data)
                for i, label in enumerate(labels):
                    if label.item() in global_protos:
                        proto_new[i, :] = global_protos[label.item()][0].data
                loss2 = loss_mse(proto_new, protos)
            (loss1 + loss2 * ld).backward()
            opt.step()
            for i in range(len(labels)):
                agg_protos_label.setdefault(labels[i].item(), []).append(protos[i, :])
    return {label: sum(p.data for p in ps) / len(ps) for label, ps in agg_protos_label.items()}


def authors_proto_aggregation(local_protos_list: dict) -> dict:
    """``proto_aggregation``: per label, the mean over the clients that uploaded it."""
    agg: dict = {}
    for idx in local_protos_list:
        for label, proto in local_protos_list[idx].items():
            agg.setdefault(label, []).append(proto)
    return {label: [sum(p.data for p in ps) / len(ps)] for label, ps in agg.items()}


def pfllib_clientproto_train(net: AuthorsNet, batches, global_protos, lr: float, lamda: float):
    """``clientProto.train``: plain SGD; protos collected over every epoch (never reset)."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    protos: dict = {}
    for x, y in batches:
        log_probs, rep = net(x)
        loss = F.nll_loss(log_probs, y)
        if global_protos is not None:
            proto_new = copy.deepcopy(rep.detach())
            for i, yy in enumerate(y):
                if yy.item() in global_protos:
                    proto_new[i, :] = global_protos[yy.item()].data
            loss = loss + nn.MSELoss()(proto_new, rep) * lamda
        for i, yy in enumerate(y):
            protos.setdefault(yy.item(), []).append(rep[i, :].detach().data)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {c: sum(ps) / len(ps) for c, ps in protos.items()}


def payload_from(global_protos: dict, C: int, d: int) -> dict:
    P, known = torch.zeros(C, d), torch.zeros(C)
    for c, p in global_protos.items():
        P[c], known[c] = p, 1.0
    return {"prototypes": P, "known": known}


def held(upload) -> dict:
    return {c: upload["class_means"][c] for c in torch.nonzero(upload["class_counts"] > 0).flatten().tolist()}


def test_fedproto_client_round_is_the_authors_update_weights_het():
    ctx = client_context(0, n_train=40, data_seed=3, batch_size=8, local_epochs=2, lr=0.05, momentum=0.5)
    alg = build("fedproto", ctx, "fedproto.lam=0.7")
    start = params_of(ctx, 5)
    g = torch.Generator().manual_seed(1)
    global_protos = {c: torch.rand(64, generator=g) for c in (0, 2, 3, 5, 7, 8)}  # some classes have none
    payload = payload_from(global_protos, 10, 64)
    state, _ = alg.local_init(payload, alg.init_client(start, 0), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    assert upload["params"] == {}  # no model parameter travels
    net = AuthorsNet(ctx.model, start)
    epochs = [batch_pairs(ctx, "train", 2)[:5], batch_pairs(ctx, "train", 2)[5:]]
    assert all(len(e) == 5 for e in epochs)
    protos = authors_update_weights_het(net, epochs, {c: [p] for c, p in global_protos.items()}, 0.05, 0.7)
    assert_params_close(new["model"], weights_of(net))
    assert sorted(held(upload)) == sorted(protos)
    assert_params_close(held(upload), protos)
    last = torch.cat([y for _, y in epochs[1]])
    assert torch.equal(upload["class_counts"], torch.bincount(last, minlength=10).float())  # the last epoch's


def test_fedproto_round_one_has_no_prototype_term():
    ctx = client_context(0, n_train=30, data_seed=1, batch_size=10, lr=0.1)
    alg = build("fedproto", ctx)
    start = params_of(ctx, 2)
    server = alg.init_server(start)
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(start, 0), ctx)
    new, _, _ = alg.local_train(payload, state, ctx)
    plain = build("fedavg", ctx)
    fedavg, _, _ = plain.local_train({"global": start}, {"model": start}, ctx)
    assert_params_close(new["model"], fedavg["model"])


def test_fedproto_server_is_the_authors_proto_aggregation_over_holders_only():
    ctx = client_context(0)
    alg = build("fedproto", ctx)
    server = alg.init_server(params_of(ctx, 0))
    g = torch.Generator().manual_seed(0)
    holdings = [(0, 1, 2), (1, 2), (2, 9)]  # class 0 and 9 held by one client each; 3-8 by none
    sizes = (50, 10, 30)
    uploads, local = [], {}
    for i, (classes, n) in enumerate(zip(holdings, sizes)):
        means, counts = torch.zeros(10, 64), torch.zeros(10)
        for c in classes:
            means[c], counts[c] = torch.rand(64, generator=g), float(1 + c + i)
        uploads.append({"params": {}, "num_samples": n, "client_id": i, "class_means": means, "class_counts": counts})
        local[i] = {c: means[c] for c in classes}
    out = alg.aggregate(server, uploads, 1)
    expected = authors_proto_aggregation(local)
    assert out["known"].tolist() == [1.0, 1.0, 1.0] + [0.0] * 6 + [1.0]
    assert_params_close({c: out["prototypes"][c] for c in expected}, {c: p[0] for c, p in expected.items()})
    torch.testing.assert_close(out["prototypes"][0], local[0][0])  # not divided by the clients without it
    torch.testing.assert_close(out["prototypes"][2], (local[0][2] + local[1][2] + local[2][2]) / 3)  # unweighted


def authors_nearest(protos: torch.Tensor, global_protos: dict, classes: list[int], num_classes: int) -> torch.Tensor:
    """``test_inference_new_het_lt`` (with protos): MSE to each global prototype of a class the client
    holds, 100 elsewhere; the argmin."""
    dist = 100 * torch.ones(protos.shape[0], num_classes)
    for i in range(protos.shape[0]):
        for j in range(num_classes):
            if j in global_protos and j in classes:
                dist[i, j] = nn.MSELoss()(protos[i, :], global_protos[j][0])
    return torch.min(dist, 1)[1]


@pytest.mark.parametrize("candidates", ["own", "all"])
def test_fedproto_scores_the_authors_nearest_prototype_among_own_classes(candidates):
    ctx = client_context(0, n_train=40, data_seed=2, classes=[1, 3, 4, 6, 8])
    alg = build("fedproto", ctx, f'fedproto.candidates="{candidates}"')
    model = params_of(ctx, 1)
    x = torch.randn(200, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    z = AuthorsNet(ctx.model, model).eval()(x)[1].detach()
    g = torch.Generator().manual_seed(3)
    global_protos = {c: [z[c * 7] + 0.3 * torch.randn(64, generator=g)] for c in (0, 1, 2, 3, 6, 8, 9)}
    payload = payload_from({c: p[0] for c, p in global_protos.items()}, 10, 64)
    state, _ = alg.local_init(payload, alg.init_client(model, 0), ctx)
    predicted = forward(ctx.model, alg.eval_params(state), x).argmax(1)
    own = [1, 3, 4, 6, 8] if candidates == "own" else list(range(10))
    expected = authors_nearest(z, global_protos, own, 10)
    assert torch.equal(predicted, expected)
    assert set(expected.tolist()) <= ({1, 3, 6, 8} if candidates == "own" else {0, 1, 2, 3, 6, 8, 9})
    head = build("fedproto", ctx, 'fedproto.scoring="head"')
    assert head.eval_params(state) is state["model"]


def test_fedproto_all_epochs_prototypes_are_pfllibs_clientproto():
    ctx = client_context(1, n_train=36, data_seed=5, batch_size=6, local_epochs=2, lr=0.05)
    alg = build("fedproto", ctx, 'fedproto.prototypes="all_epochs"')
    start = params_of(ctx, 8)
    g = torch.Generator().manual_seed(2)
    global_protos = {c: torch.rand(64, generator=g) for c in range(0, 10, 2)}
    payload = payload_from(global_protos, 10, 64)
    state, _ = alg.local_init(payload, alg.init_client(start, 1), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    net = AuthorsNet(ctx.model, start)
    protos = pfllib_clientproto_train(net, batch_pairs(ctx, "train", 2), global_protos, 0.05, 1.0)
    assert_params_close(new["model"], weights_of(net))
    assert_params_close(held(upload), protos)
    assert float(upload["class_counts"].sum()) == 72  # both epochs


def test_fedproto_after_training_prototypes_are_the_class_means_in_evaluation_mode():
    ctx = client_context(0, n_train=25, data_seed=6, batch_size=10)
    alg = build("fedproto", ctx, 'fedproto.prototypes="after_training"')
    start = params_of(ctx, 3)
    payload = alg.downlink(alg.init_server(start), 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(start, 0), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    z = forward(ctx.model, new["model"], ctx.data.train_x, stop=3)
    y = ctx.data.train_y
    for c in y.unique().tolist():
        torch.testing.assert_close(upload["class_means"][c], z[y == c].mean(0))
    assert torch.equal(upload["class_counts"], torch.bincount(y, minlength=10).float())


def test_fedproto_refuses_prototype_scoring_on_a_head_without_bias():
    model = build_model("conv2cifar", (3, 32, 32), 10)
    ctx = SingleClientContext(0, 1, 0, client_context(0).data, model, model.units(), client_context(0).train, "t")
    with pytest.raises(ValueError, match='set fedproto.scoring = "head"'):
        build("fedproto", ctx)
    build("fedproto", ctx, 'fedproto.scoring="head"')


@pytest.mark.parametrize("cut", ["fedproto", "fedgh"])
def test_fedproto_and_fedgh_resume_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config, cut):
    """Both keep client state (models, received prototypes) and server state (prototypes, head)."""
    from pflkit.config import load_config
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, fast_config + ['algorithms=["fedproto","fedgh"]', "rounds=3", "join_ratio=0.5"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter(cut, 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    records = records_without_timings(tmp_path / "cut")
    assert records == records_without_timings(tmp_path / "full")
    assert {r["algorithm"] for r in records} == {"fedproto", "fedgh"}
