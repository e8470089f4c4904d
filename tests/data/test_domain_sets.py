"""Multi-domain datasets (Digit-5 in FedBN's pickles, Office-Caltech-10 and DomainNet trees): the
readers, a client per domain (or several), held-out domains, and the one-line errors.

Every test writes a miniature copy of the on-disk layout under tmp_path; nothing touches the network.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from pflkit.cli import main
from pflkit.config import ConfigError, build_config
from pflkit.data import DataError, DomainOptions, heldout_client_ids, load_clients, load_dataset, read_domains
from pflkit.data.domain_sets import DIGIT5_FOLDERS
from pflkit.federation import build_partitions

#: Digit-5 domain -> the shape of one image in FedBN's pickles (MNIST and USPS grey, the others RGB)
DIGIT_SHAPES = {"mnist": (28, 28), "svhn": (32, 32, 3), "usps": (16, 16), "synth": (32, 32, 3), "mnistm": (28, 28, 3)}


def dump(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(obj, f, pickle.HIGHEST_PROTOCOL)  # as FedBN's data_preprocess.py writes them


def digit5_tree(root: Path, part: int = 10, test: int = 6, parts: int = 3) -> Path:
    """FedBN's digit folders: ``parts`` training parts of ``part`` images and a test.pkl per domain."""
    rng = np.random.default_rng(0)
    for domain, folder in DIGIT5_FOLDERS.items():
        shape = DIGIT_SHAPES[domain]
        for k in range(parts):
            images = rng.integers(0, 256, (part, *shape), dtype=np.uint8)
            dump(root / folder / "partitions" / f"train_part{k}.pkl", (images, np.arange(part) % 10))
        dump(root / folder / "test.pkl", (rng.integers(0, 256, (test, *shape), dtype=np.uint8), np.arange(test) % 10))
    return root


def jpg(path: Path, seed: int, size: tuple[int, int] = (20, 14), grey: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0]) if grey else (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def class_tree(root: Path, domains: tuple[str, ...], classes: tuple[str, ...], per_class: int = 4) -> Path:
    for d, domain in enumerate(domains):
        for c, name in enumerate(classes):
            for i in range(per_class):
                jpg(root / domain / name / f"{domain}_{i:03d}.jpg", 100 * d + 10 * c + i, grey=(i == 0))
    return root


OFFICE = ("amazon", "caltech", "dslr", "webcam")


def domainnet_tree(root: Path, domains: tuple[str, ...] = ("clipart", "sketch")) -> Path:
    classes = ("aircraft_carrier", "bird", "zebra")  # official labels 0, 1, 2 here
    class_tree(root, domains, classes, per_class=3)
    for domain in domains:
        for part, picked in (("train", (0, 1)), ("test", (2,))):
            lines = [f"{domain}/{c}/{domain}_{i:03d}.jpg {k}" for k, c in enumerate(classes) for i in picked]
            (root / f"{domain}_{part}.txt").write_text("\n".join(lines) + "\n")
    return root


# ---------------------------------------------------------------- Digit-5


def test_digit5_reads_fedbn_parts_resizes_and_repeats_grey(tmp_path: Path) -> None:
    root = digit5_tree(tmp_path / "digits")
    splits, classes = read_domains("digit5", root, DomainOptions(percent=0.2))
    assert classes == 10 and [s.name for s in splits] == ["mnist", "svhn", "usps", "synth", "mnistm"]
    for s in splits:
        assert s.train_x.shape == (20, 3, 28, 28) and s.test_x.shape == (6, 3, 28, 28)
        assert s.train_x.dtype == torch.float32 and -1 <= float(s.train_x.min()) and float(s.train_x.max()) <= 1
        assert s.train_y.tolist() == list(range(10)) * 2
    raw, _ = pickle.loads((root / "USPS" / "partitions" / "train_part0.pkl").read_bytes())
    usps = splits[2].train_x[0]
    resized = np.array(Image.fromarray(raw[0]).resize((28, 28), Image.Resampling.BILINEAR))
    expected = torch.from_numpy(resized).float().div(255).sub(0.5).div(0.5)
    assert all(torch.equal(usps[c], expected) for c in range(3))  # grey -> 3 equal channels (Grayscale(3))
    mnist, _ = pickle.loads((root / "MNIST" / "partitions" / "train_part1.pkl").read_bytes())
    assert torch.equal(splits[0].train_x[10, 0], torch.from_numpy(mnist[0]).float().div(255).sub(0.5).div(0.5))
    half, _ = read_domains("digit5", root, DomainOptions(percent=0.05, domains=("svhn",)))
    assert [len(s.train_y) for s in half] == [5]  # below 0.1: the first percent * 10 of part 0


def test_digit5_clients_per_domain_split_iid_and_heldout_domains_are_recorded(tmp_path: Path) -> None:
    root = digit5_tree(tmp_path / "d")
    options = DomainOptions(percent=0.3, clients_per_domain=2, heldout_domains=("usps",))
    fed = load_clients("digit5", root, seed=0, domains=options)
    assert fed.num_clients == 10 and fed.input_shape == (3, 28, 28)
    assert [c.num_train for c in fed.clients] == [15] * 10 and [c.num_test for c in fed.clients] == [3] * 10
    info = fed.partition_record()
    assert [d["label"] for d in info["domains"]] == [d for d in DIGIT5_FOLDERS for _ in range(2)]
    assert info["heldout_clients"] == [4, 5] == heldout_client_ids(fed) and info["heldout_domains"] == ["usps"]
    again = load_clients("digit5", root, seed=0, domains=options)
    other = load_clients("digit5", root, seed=1, domains=options)
    assert torch.equal(fed.clients[0].train_x, again.clients[0].train_x)
    assert not torch.equal(fed.clients[0].train_x, other.clients[0].train_x)
    pair = torch.cat([fed.clients[0].train_x, fed.clients[1].train_x])  # the two clients hold the whole domain
    whole = load_clients("digit5", root, domains=DomainOptions(percent=0.3)).clients[0].train_x
    assert sorted(map(tuple, pair.flatten(1).tolist())) == sorted(map(tuple, whole.flatten(1).tolist()))


def test_digit5_bad_files_are_refused_in_one_line(tmp_path: Path) -> None:
    root = digit5_tree(tmp_path / "d", parts=1)
    cases = []
    with pytest.raises(DataError, match=r"train_part1\.pkl is missing") as info:
        read_domains("digit5", root, DomainOptions(percent=0.2))
    cases.append(info)
    dump(root / "SVHN" / "test.pkl", (np.zeros((4, 32, 32, 4), dtype=np.uint8), np.zeros(4)))
    with pytest.raises(DataError, match=r"SVHN/test\.pkl: expected uint8 images \[n, H, W\] or \[n, H, W, 3\]") as info:
        read_domains("digit5", root, DomainOptions(domains=("svhn",)))
    cases.append(info)
    dump(root / "SVHN" / "test.pkl", (np.zeros((4, 32, 32, 3), dtype=np.uint8), np.zeros(3)))
    with pytest.raises(DataError, match=r"test\.pkl: 4 samples but labels of shape \(3,\)") as info:
        read_domains("digit5", root, DomainOptions(domains=("svhn",)))
    cases.append(info)
    dump(root / "SVHN" / "test.pkl", {"images": 1})
    with pytest.raises(DataError, match=r"test\.pkl: expected a pickled \(images, labels\) pair, got dict") as info:
        read_domains("digit5", root, DomainOptions(domains=("svhn",)))
    cases.append(info)
    dump(root / "SVHN" / "test.pkl", (Path("x"), np.zeros(1)))  # another class: not unpickled at all
    with pytest.raises(DataError, match=r"test\.pkl is not a readable pickle of arrays: refusing pathlib") as info:
        read_domains("digit5", root, DomainOptions(domains=("svhn",)))
    cases.append(info)
    (root / "MNIST_M" / "test.pkl").rename(root / "MNIST_M" / "gone.pkl")
    (root / "USPS").rename(root / "usps-elsewhere")
    with pytest.raises(DataError, match=r"digit5: .*USPS is missing \(domain 'usps'\)") as info:
        read_domains("digit5", root, DomainOptions(domains=("usps",)))
    cases.append(info)
    with pytest.raises(ValueError, match="digit5 has no domain 'mnist-m'; its domains: mnist, svhn"):
        read_domains("digit5", root, DomainOptions(domains=("mnist-m",)))
    assert all("\n" not in str(i.value) for i in cases)


# ---------------------------------------------------------------- Office-Caltech-10 and DomainNet


def test_office_tree_splits_each_domain_and_reads_a_class_subset(tmp_path: Path) -> None:
    classes = ("back_pack", "bike", "mug")
    root = class_tree(tmp_path / "o" / "office_caltech_10", OFFICE, classes)
    splits, n = read_domains("office_caltech10", tmp_path / "o", DomainOptions(image_size=16))
    assert n == 3 and [s.name for s in splits] == list(OFFICE)
    assert splits[0].train_x.shape == (9, 3, 16, 16) and splits[0].test_x.shape == (3, 3, 16, 16)
    assert sorted(splits[0].test_y.tolist()) == [0, 1, 2]  # stratified 75/25
    sub, n = read_domains("office_caltech10", root, DomainOptions(image_size=8, classes=("mug", "back_pack")))
    assert n == 2 and sorted(set(sub[1].train_y.tolist())) == [0, 1]
    with pytest.raises(DataError, match=r"amazon has no class folder 'laptop' \(data.classes\); it has back_pack"):
        read_domains("office_caltech10", root, DomainOptions(classes=("laptop",)))
    (root / "webcam").rename(root / "web")
    with pytest.raises(DataError, match=r"office_caltech_10/webcam is missing"):
        read_domains("office_caltech10", root, DomainOptions())


def test_office_reads_fedbn_split_pickles_of_paths(tmp_path: Path) -> None:
    classes = ("back_pack", "bike")
    base = class_tree(tmp_path / "data" / "office_caltech_10", OFFICE, classes, per_class=3)
    for d in OFFICE:  # FedBN's paths are relative to the folder that holds office_caltech_10/
        train = [f"office_caltech_10/{d}/{c}/{d}_{i:03d}.jpg" for c in classes for i in (0, 1)]
        test = [f"office_caltech_10/{d}/{c}/{d}_002.jpg" for c in classes]
        dump(base / f"{d}_train.pkl", (np.asarray(train), np.asarray([p.split("/")[2] for p in train])))
        dump(base / f"{d}_test.pkl", (np.asarray(test), np.asarray(list(classes))))
    fed = load_clients("office_caltech10", tmp_path / "data", domains=DomainOptions(image_size=8))
    assert [c.num_train for c in fed.clients] == [4] * 4 and fed.clients[3].test_y.tolist() == [0, 1]
    dump(base / "dslr_test.pkl", (np.asarray(["office_caltech_10/dslr/nope.jpg"]), np.asarray(["bike"])))
    with pytest.raises(DataError, match=r"dslr_test\.pkl names office_caltech_10/dslr/nope\.jpg, which is not under"):
        load_clients("office_caltech10", base, domains=DomainOptions(image_size=8))


def test_domainnet_reads_the_official_split_files_and_a_class_subset(tmp_path: Path) -> None:
    root = domainnet_tree(tmp_path / "dn")
    splits, n = read_domains("domainnet", root, DomainOptions(domains=("clipart", "sketch"), image_size=12))
    assert n == 3 and splits[1].train_x.shape == (6, 3, 12, 12) and splits[1].test_y.tolist() == [0, 1, 2]
    options = DomainOptions(domains=("sketch", "clipart"), classes=("zebra", "bird"), image_size=12)
    fed = load_clients("domainnet", root, domains=options)
    assert fed.num_classes == 2 and [d["domain"] for d in fed.partition_info["domains"]] == ["sketch", "clipart"]
    assert fed.clients[0].train_y.tolist() == [1, 1, 0, 0] and fed.clients[0].test_y.tolist() == [1, 0]


def test_domainnet_bad_split_lines_missing_and_corrupt_images_name_the_file(tmp_path: Path) -> None:
    root = domainnet_tree(tmp_path / "dn")
    options = DomainOptions(domains=("clipart",), image_size=8)
    (root / "clipart" / "bird" / "clipart_002.jpg").unlink()
    with pytest.raises(DataError, match=r"clipart_test\.txt:2: names clipart/bird/clipart_002\.jpg, which is not"):
        read_domains("domainnet", root, options)
    domainnet_tree(tmp_path / "dn2")
    image = tmp_path / "dn2" / "clipart" / "zebra" / "clipart_001.jpg"
    image.write_bytes(image.read_bytes()[:40])
    with pytest.raises(DataError, match=r"zebra/clipart_001\.jpg is not a readable image \(corrupt or truncated\?\)"):
        read_domains("domainnet", tmp_path / "dn2", options)
    (tmp_path / "dn2" / "clipart_train.txt").write_text("clipart/zebra/clipart_001.jpg\n")
    with pytest.raises(DataError, match=r"clipart_train\.txt:1: expected 'path label'"):
        read_domains("domainnet", tmp_path / "dn2", options)
    with pytest.raises(DataError, match=r"domainnet: .*painting is missing \(domain 'painting'"):
        read_domains("domainnet", root, DomainOptions(domains=("painting",)))


# ---------------------------------------------------------------- config, partitions, CLI


def test_config_keys_name_unknown_domains_and_bad_counts() -> None:
    base = {"dataset": "digit5", "data_dir": "/x"}
    assert build_config(base).resolved_model == "fedbn_cnn"
    assert build_config({**base, "dataset": "domainnet"}).resolved_model == "resnet18"
    for data, message in (
        ({"domains": ["mnist", "mnist-m"]}, "data.domains: digit5 has no domain 'mnist-m'; its domains: mnist, svhn"),
        ({"heldout_domains": ["clipart"]}, "data.heldout_domains: digit5 has no domain 'clipart'"),
        ({"domains": ["mnist", "svhn"], "heldout_domains": ["usps"]}, "'usps' is not among the domains read"),
        ({"domains": ["mnist"], "heldout_domains": ["mnist"]}, "holds every domain read"),
        ({"clients_per_domain": 0}, "clients_per_domain"),
        ({"domains": []}, "is empty"),
    ):
        with pytest.raises(ConfigError, match=message) as info:
            build_config({**base, "data": data})
        assert len(str(info.value).strip().splitlines()) == 2  # the heading and one line naming the key
    with pytest.raises(ConfigError, match=r"the clients of digit5 \(domains x clients_per_domain\)"):
        build_config({**base, "data": {"domains": ["mnist"]}, "feature_shift": {"transforms": ["invert"]}})
    with pytest.raises(DataError, match="holds per-client splits"):
        load_dataset("digit5", "/x")
    # a dropout schedule counts the domains' clients (2 x 2), not num_clients
    two = {**base, "num_clients": 20, "data": {"domains": ["mnist", "svhn"], "clients_per_domain": 2}}
    assert build_config({**two, "run": {"dropout_schedule": [[1, 3]]}}).run.dropout_schedule == [[1, 3]]
    with pytest.raises(ConfigError, match=r"names client 4 in round 1, but the run has clients 0\.\.3"):
        build_config({**two, "run": {"dropout_schedule": [[1, 4]]}})


def test_data_keys_of_the_domain_sets_are_named_unused_elsewhere() -> None:
    from pflkit.config import unused_keys

    table = {"data": {"percent": 0.5, "clients_per_domain": 2, "heldout_domains": []}}
    assert unused_keys(table, build_config({"dataset": "digits", **table})) == [
        "data.percent = 0.5 is not used: only dataset = digit5 reads it",
        "data.clients_per_domain = 2 is not used: only dataset = digit5 or office_caltech10 or domainnet reads it",
    ]
    assert unused_keys(table, build_config({"dataset": "digit5", "data_dir": "/x", **table})) == []


def test_partitions_per_seed_replace_num_clients_and_keep_domains_under_feature_shift(tmp_path: Path) -> None:
    root = digit5_tree(tmp_path / "d", part=8, test=4, parts=1)
    config = build_config(
        {
            "dataset": "digit5",
            "data_dir": str(root),
            "seeds": [0, 1],
            "data": {"domains": ["svhn", "usps"], "clients_per_domain": 2},
            "feature_shift": {"transforms": ["invert"]},
        }
    )
    adopted, parts = build_partitions(config, torch.device("cpu"))
    assert adopted.partition.num_clients == 4 and set(parts) == {0, 1}
    labels = [d["label"] for d in parts[0].partition_record()["domains"]]
    assert labels == ["svhn, original", "svhn, original", "usps, inv", "usps, inv"]
    assert not torch.equal(parts[0].clients[0].train_y, parts[1].clients[0].train_y)


@pytest.mark.integration
def test_cli_runs_fedavg_and_fedbn_for_two_rounds_on_digit5(tmp_path: Path) -> None:
    root = digit5_tree(tmp_path / "digits", part=12, test=6, parts=1)
    out = tmp_path / "out"
    args = ["run", "dataset=digit5", f"data_dir={root}", "model=fedbn_cnn", 'algorithms=["fedavg","fedbn"]']
    args += ["rounds=2", "engine=loop", "batch_size=4", 'data.heldout_domains=["usps"]', "--quiet", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "num_clients = 5" in (out / "config.toml").read_text()
    record = json.loads((out / "partition-seed0.json").read_text())
    assert [d["label"] for d in record["domains"]] == ["mnist", "svhn", "usps", "synth", "mnistm"]
    assert record["heldout_clients"] == [2] and record["train_class_counts"][0] == [2] * 2 + [1] * 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r.get("algorithm") for r in rows if r.get("round") == 2} >= {"fedavg", "fedbn"}
    # the held-out domain's client never trains: it is scored as a newcomer every evaluation
    evaluated = [r for r in rows if "unseen_accuracy" in r]
    assert evaluated and all(r["unseen_evaluated_clients"] == 1 for r in evaluated)
    scored = [r for r in rows if "evaluated_clients" in r]
    assert scored and all(r["evaluated_clients"] == 4 for r in scored)  # the four participants


def test_heldout_domains_are_the_unseen_clients_of_the_config() -> None:
    config = build_config(
        {
            "dataset": "digit5",
            "data_dir": "/nowhere",
            "data": {"domains": ["svhn", "usps", "mnist"], "clients_per_domain": 2, "heldout_domains": ["usps"]},
            "run": {"unseen_clients": [0]},
        }
    )
    assert config.heldout_domain_ids() == [2, 3] and config.unseen_client_ids() == [0, 2, 3]


def test_unseen_clients_and_heldout_domains_together_must_leave_a_participant() -> None:
    base = {
        "dataset": "digit5",
        "data_dir": "/nowhere",
        "data": {"domains": ["svhn", "usps"], "heldout_domains": ["usps"]},
    }
    with pytest.raises(Exception, match="2 unseen clients of 2 \\(held-out domains included\\) leave none to train"):
        build_config({**base, "run": {"unseen_clients": [0]}})
    assert build_config(base).unseen_client_ids() == [1]


def test_download_domainnet_fetches_each_domains_zip_and_split_files_into_the_layout_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's layout: groundtruth/clipart.zip and painting.zip, the other zips at the top,
    domainnet/txt/<domain>_<part>.txt."""
    from pflkit.data import downloads

    domains = tuple(downloads._DOMAINNET_ZIPS)
    tree = domainnet_tree(tmp_path / "src", domains)
    served = tmp_path / "served"
    (served / "domainnet" / "txt").mkdir(parents=True)
    for domain, rel in downloads._DOMAINNET_ZIPS.items():
        (served / rel).parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(served / rel, "w") as zf:
            for path in sorted((tree / domain).rglob("*.jpg")):
                zf.write(path, path.relative_to(tree).as_posix())
        for part in ("train", "test"):
            name = f"{domain}_{part}.txt"
            (served / "domainnet" / "txt" / name).write_bytes((tree / name).read_bytes())
    monkeypatch.setattr(downloads, "_DOMAINNET_URL", served.as_uri() + "/")
    target = downloads.download("domainnet", tmp_path / "dn")
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [*domains, *(f"{d}_{part}.txt" for d in domains for part in ("train", "test"))]
    )
    splits, n = read_domains("domainnet", target, DomainOptions(image_size=8))
    assert n == 3 and [len(s.train_y) for s in splits] == [6] * 6
    assert downloads.download("domainnet", target) == target  # present: checked, not fetched again
    (target / "real_test.txt").write_text("real/bird/x.jpg\n")
    with pytest.raises(DataError, match="real_test.txt is already there but is not the expected file"):
        downloads.download("domainnet", target)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    with zipfile.ZipFile(wrong / "clipart.zip", "w") as zf:
        zf.writestr("sketch/bird/a.jpg", b"")
    with pytest.raises(DataError, match="clipart.zip should hold one folder clipart/ at its top"):
        downloads.download("domainnet", wrong)


def test_a_split_file_cannot_name_an_image_outside_the_dataset_folder(tmp_path: Path) -> None:
    root = domainnet_tree(tmp_path / "dn")
    outside = jpg(tmp_path / "outside.jpg", seed=1)
    (root / "clipart_test.txt").write_text(f"../{outside.name} 0\n")
    with pytest.raises(DataError, match=r"clipart_test\.txt:1: names \.\./outside\.jpg, which is not under"):
        read_domains("domainnet", root, DomainOptions(domains=("clipart",), image_size=8))
