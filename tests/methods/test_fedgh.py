"""FedGH against my transcription of PFLlib's port, the reference pflkit follows, and of the authors'
per-prototype server loop.

References read (written from reading them, not copied): TsingZ0/PFLlib d832e76,
``system/flcore/clients/clientgh.py`` (``set_parameters`` copies the server's head into the
client's; ``train``: plain SGD on cross-entropy over the whole model; ``collect_protos``: evaluation
mode, no gradient, over ``load_train_data()`` (shuffled, ``drop_last=True``: the n mod B samples of
the last partial batch are left out), each sample's base output appended under its label, then
``agg_func``'s mean) and ``system/flcore/servers/servergh.py`` (``receive_protos``: a (prototype, label) pair per
class per client; ``train_head``: a shuffled DataLoader of the run's batch size, CrossEntropyLoss,
SGD at the server learning rate). LipingYi/FedGH ff50ac0 ``FedGH_Codes/experiments/FLHetero/FedGH.py``
(the server loop: one cross-entropy step per (client, class) prototype).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from pflkit.functional import torch_generator
from pflkit.models import build_model
from tests.support.builders import batch_pairs, build, client_context, params_of, stream
from tests.support.checks import assert_params_close, moved

HEAD = ("fc.weight", "fc.bias")


def module(ctx, params: dict) -> nn.Module:
    net = copy.deepcopy(ctx.model)
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.copy_(params[k])
    return net


def pfllib_clientgh_round(ctx, local: dict, head: nn.Linear, lr: float) -> tuple[dict, dict]:
    """``set_parameters(head)``, ``train`` (SGD on CE, whole model), ``collect_protos`` (eval mode)."""
    net = module(ctx, local)
    for new_param, old_param in zip(head.parameters(), net.fc.parameters()):
        old_param.data = new_param.data.clone()
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        opt.zero_grad()
        nn.CrossEntropyLoss()(net(x), y).backward()
        opt.step()
    net.eval()
    protos: dict = {}
    with torch.no_grad():
        for x, y in stream(ctx, "train"):  # full batches only, as PFLlib's drop_last loader
            x = torch.relu(torch.max_pool2d(net.conv1(x), 2))  # model.base(x): conv1, pool, conv2, pool, fc1
            x = torch.relu(torch.max_pool2d(net.conv2(x), 2))
            rep = torch.relu(net.fc1(x.flatten(1)))
            for i, yy in enumerate(y):
                protos.setdefault(yy.item(), []).append(rep[i, :])
    return {k: v.detach().clone() for k, v in net.named_parameters()}, {c: sum(p) / len(p) for c, p in protos.items()}


def pfllib_train_head(head: nn.Linear, uploaded_protos: list, order: torch.Tensor, batch: int, lr: float) -> None:
    """``train_head``: the DataLoader's batches (its shuffle: ``order``), CE, SGD(lr) step."""
    opt_h = torch.optim.SGD(head.parameters(), lr=lr)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch].tolist()
        p = torch.stack([uploaded_protos[r][0] for r in rows])
        y = torch.stack([uploaded_protos[r][1] for r in rows])
        loss = nn.CrossEntropyLoss()(head(p), y)
        opt_h.zero_grad()
        loss.backward()
        opt_h.step()


def linear_at(params: dict) -> nn.Linear:
    head = nn.Linear(64, 10)
    with torch.no_grad():
        head.weight.copy_(params["fc.weight"])
        head.bias.copy_(params["fc.bias"])
    return head


def test_fedgh_client_round_is_pfllibs_clientgh_train_and_collect_protos():
    # 32 samples in batches of 8: PFLlib's drop_last pass sees every sample, so its prototype is
    # pflkit's (with 33 it would leave one sample out: a recorded difference)
    ctx = client_context(0, n_train=32, data_seed=4, batch_size=8, local_epochs=2, lr=0.05, classes=[0, 2, 5, 7])
    alg = build("fedgh", ctx)
    server = alg.init_server(params_of(ctx, 1))
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(HEAD)  # only the head travels down
    local = params_of(ctx, 6)
    state, _ = alg.local_init(payload, alg.init_client(local, 0), ctx)
    assert_params_close({k: state["model"][k] for k in HEAD}, {k: server["global"][k] for k in HEAD})
    new, upload, _ = alg.local_train(payload, state, ctx)
    assert upload["params"] == {}  # nothing but prototypes travels up
    ref, protos = pfllib_clientgh_round(ctx, local, linear_at(server["global"]), 0.05)
    assert_params_close(new["model"], ref)
    held = torch.nonzero(upload["class_counts"] > 0).flatten().tolist()
    assert held == sorted(protos) == [0, 2, 5, 7]
    assert_params_close({c: upload["class_means"][c] for c in held}, protos)
    assert float(upload["class_counts"].sum()) == 32


def uploads_of(holdings, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    uploads = []
    for i, classes in enumerate(holdings):
        means, counts = torch.zeros(10, 64), torch.zeros(10)
        for c in classes:
            means[c], counts[c] = torch.rand(64, generator=g), 3.0
        uploads.append({"params": {}, "num_samples": 30, "client_id": i, "class_means": means, "class_counts": counts})
    return uploads


def test_fedgh_server_is_pfllibs_train_head_over_the_rounds_prototypes():
    ctx = client_context(0, batch_size=4)
    alg = build("fedgh", ctx, "fedgh.lr=0.5")
    server = alg.prepare(alg.init_server(params_of(ctx, 2)), [], seed=11)
    holdings = [(0, 3, 4), (3, 8), (1, 4, 9, 6)]
    uploads = uploads_of(holdings)
    out = alg.aggregate(server, list(reversed(uploads)), 3)  # arrival order does not matter
    pairs = [(u["class_means"][c], torch.tensor(c)) for u, cs in zip(uploads, holdings) for c in sorted(cs)]
    assert len(pairs) == 9  # empty classes send no prototype
    order = torch.randperm(9, generator=torch_generator(11, "server", 3, "fedgh"))
    head = linear_at(server["global"])
    pfllib_train_head(head, pairs, order, 4, 0.5)
    assert_params_close({k: out["global"][k] for k in HEAD}, {"fc.weight": head.weight, "fc.bias": head.bias})
    assert moved({k: out["global"][k] for k in HEAD}, {k: server["global"][k] for k in HEAD})
    body = [k for k in server["global"] if k not in HEAD]
    assert_params_close({k: out["global"][k] for k in body}, {k: server["global"][k] for k in body})


def test_fedgh_per_prototype_steps_are_the_authors_server_loop():
    """``batch = 1``: one CE step per prototype (the authors' loop, with its step taken on the head)."""
    ctx = client_context(0)
    alg = build("fedgh", ctx, "fedgh.batch=1", "fedgh.lr=0.1", "fedgh.epochs=2")
    server = alg.prepare(alg.init_server(params_of(ctx, 4)), [], seed=5)
    holdings = [(2, 7), (7,), (0, 1, 2)]
    uploads = uploads_of(holdings, seed=1)
    out = alg.aggregate(server, uploads, 1)
    pairs = [(u["class_means"][c], torch.tensor(c)) for u, cs in zip(uploads, holdings) for c in sorted(cs)]
    g = torch_generator(5, "server", 1, "fedgh")
    head = linear_at(server["global"])
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for _ in range(2):
        for r in torch.randperm(len(pairs), generator=g).tolist():
            rep, cls = pairs[r]
            loss = nn.CrossEntropyLoss()(head(rep).view(1, -1), cls.view(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert_params_close({k: out["global"][k] for k in HEAD}, {"fc.weight": head.weight, "fc.bias": head.bias})


def test_fedgh_trains_a_head_without_bias():
    model = build_model("conv2cifar", (3, 32, 32), 10)
    from pflkit.algorithms import TrainSettings
    from pflkit.config import load_config
    from pflkit.methods import build_algorithm

    alg = build_algorithm("fedgh", load_config(None, []).algorithm_sections(), TrainSettings(), model.units())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    server = alg.init_server(params)
    d = params["fc.weight"].shape[1]
    upload = {
        "params": {},
        "num_samples": 5,
        "client_id": 0,
        "class_means": torch.rand(10, d),
        "class_counts": torch.tensor([2.0] * 5 + [0.0] * 5),
    }
    out = alg.aggregate(server, [upload], 1)
    assert "fc.bias" not in out["global"]
    assert moved({"w": out["global"]["fc.weight"]}, {"w": params["fc.weight"]})
