"""Feature shift: each transform's promise, the partition it leaves alone, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.config import ConfigError, load_config
from pflkit.data import DataError, PartitionSpec, load_dataset
from pflkit.data.domains import FeatureShift, apply_feature_shift, client_domain, rotate, shift_images
from pflkit.data.federated import ClientData, FederatedData

N = 8


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def build(digits, seed=0, **partition):
    spec = PartitionSpec(num_clients=N, alpha=0.5, **partition)
    return FederatedData.build(digits, spec, seed)


def shifted(digits, seed=0, partition=None, **settings):
    return apply_feature_shift(build(digits, seed, **(partition or {})), FeatureShift(**settings), seed)


# ---- rotation ------------------------------------------------------------------------------------
def test_rotating_back_gives_each_clients_train_and_test_images(digits):
    plain = build(digits)
    out = shifted(digits, transforms=["rotate"], rotations=4)
    for i, (before, after) in enumerate(zip(plain.clients, out.clients)):
        angle = [0, 90, 180, 270][i * 4 // N]  # contiguous groups of two clients
        assert out.partition_info["domains"][i]["rotation"] == angle
        for x0, x1 in ((before.train_x, after.train_x), (before.test_x, after.test_x)):
            assert torch.equal(rotate(x1, -angle), x0)
            assert angle == 0 or not torch.equal(x1, x0)


def test_a_quarter_turn_is_counter_clockwise_and_keeps_a_non_square_shape():
    x = torch.zeros(1, 1, 6, 10)
    x[0, 0, 2:4, 6] = 1.0  # right of the centre
    y = rotate(x, 90.0)  # not square: the affine grid
    assert y.shape == x.shape
    assert torch.allclose(y[0, 0, 1, 4:6], torch.ones(2), atol=1e-5)  # now above the centre
    assert torch.allclose(y.sum(), torch.tensor(2.0), atol=1e-5)
    square = torch.zeros(1, 1, 4, 4)
    square[0, 0, 0, 3] = 1.0
    assert rotate(square, 90.0)[0, 0, 0, 0] == 1.0  # torch.rot90's direction


def test_an_arbitrary_angle_rotated_back_gives_the_centre_of_a_smooth_image():
    r = torch.arange(16.0) - 7.5
    blob = torch.exp(-(r.view(-1, 1) ** 2 + (r.view(1, -1) - 1) ** 2) / 60).expand(2, 3, 16, 16)
    there = rotate(blob, 37.0, fill=0.0)
    assert not torch.allclose(there, blob, atol=0.05)
    back = rotate(there, -37.0, fill=0.0)
    assert torch.allclose(back[..., 4:12, 4:12], blob[..., 4:12, 4:12], atol=0.02)  # bilinear, twice


def test_listed_angles_are_assigned_in_contiguous_groups():
    spec = FeatureShift(transforms=["rotate"], angles=[0, 45, 90])
    assert [client_domain(spec, i, 7).rotation for i in range(7)] == [0, 0, 0, 45, 45, 90, 90]


# ---- noise ---------------------------------------------------------------------------------------
def test_noise_grows_with_the_client_index_and_is_drawn_from_the_partition_seed(digits):
    plain = build(digits)
    out = shifted(digits, transforms=["noise"], noise_sigma=0.2)
    lo, hi = float(plain.x.min()), float(plain.x.max())
    stds = []
    for i, (before, after) in enumerate(zip(plain.clients, out.clients)):
        expected = 0.2 * i / (N - 1)  # NIID-Bench: noise / (n_parties - 1) * net_id
        assert out.partition_info["domains"][i]["noise_std"] == pytest.approx(expected)
        measured = float((after.train_x - before.train_x).std()) / (hi - lo) if i else 0.0
        assert measured == pytest.approx(expected, rel=0.05)
        stds.append(measured)
    assert stds == sorted(stds) and stds[0] == 0.0 and torch.equal(out.clients[0].train_x, plain.clients[0].train_x)
    again = shifted(digits, transforms=["noise"], noise_sigma=0.2)
    assert all(
        torch.equal(a.train_x, b.train_x) and torch.equal(a.test_x, b.test_x)
        for a, b in zip(out.clients, again.clients)
    )
    other = apply_feature_shift(plain, FeatureShift(transforms=["noise"], noise_sigma=0.2), seed=1)
    assert not torch.equal(other.clients[-1].train_x, out.clients[-1].train_x)


# ---- colour --------------------------------------------------------------------------------------
def test_inversion_flips_the_odd_groups_and_twice_gives_the_original(digits):
    plain = build(digits)
    out = shifted(digits, transforms=["invert"], colour_groups=4)
    lo, hi = float(plain.x.min()), float(plain.x.max())
    for i, (before, after) in enumerate(zip(plain.clients, out.clients)):
        inverted = (i * 4 // N) % 2 == 1
        assert out.partition_info["domains"][i]["invert"] is inverted
        assert torch.allclose(after.test_x, lo + hi - before.test_x if inverted else before.test_x)


def test_tint_keeps_group_zero_and_colours_rgb_groups():
    x = torch.rand(5, 3, 4, 4) * 2 - 1
    spec = FeatureShift(transforms=["tint"], colour_groups=3, tint_strength=0.5)
    assert torch.equal(shift_images(x, client_domain(spec, 0, 3), (-1.0, 1.0)), x)
    red = shift_images(x, client_domain(spec, 1, 3), (-1.0, 1.0), colour_groups=3)
    assert torch.allclose(red, 0.5 * x + 0.5 * torch.tensor([1.0, -1.0, -1.0]).view(1, 3, 1, 1))
    grey = shift_images(x[:, :1], client_domain(spec, 2, 3), (-1.0, 1.0), colour_groups=3)
    assert torch.allclose(grey, 0.5 * x[:, :1] + 0.5)  # the last group blends toward the maximum


# ---- what a domain leaves alone ------------------------------------------------------------------
def test_the_label_partition_is_unchanged_and_the_record_shows_each_domain(digits):
    plain = build(digits)
    out = shifted(digits, transforms=["rotate", "invert", "noise"])
    for a, b in zip(plain.clients, out.clients):
        assert torch.equal(a.train_y, b.train_y) and torch.equal(a.test_y, b.test_y)
    assert all(np.array_equal(a, b) for a, b in zip(plain.train_indices, out.train_indices))
    assert np.array_equal(plain.counts, out.counts)
    record, before = out.partition_record(), plain.partition_record()
    assert record["train_class_counts"] == before["train_class_counts"]
    assert len(record["domains"]) == N and record["domains"][-1]["label"] == "rot 270, inv, noise 0.100"
    assert record["feature_shift"]["transforms"] == ["rotate", "invert", "noise"]
    for c in out.clients:  # the batched engines gather the same images from the rows
        assert torch.equal(out.x[c.train_rows], c.train_x) and torch.equal(out.y[c.test_rows], c.test_y)
    assert apply_feature_shift(plain, FeatureShift(), 0) is plain


def test_the_global_test_set_keeps_its_images_unless_the_domains_are_spread_over_it(digits):
    plain = build(digits, test_set="official")
    kept = apply_feature_shift(plain, FeatureShift(transforms=["rotate"]), 0)
    assert torch.equal(kept.global_test[0], plain.global_test[0])
    spread = apply_feature_shift(plain, FeatureShift(transforms=["rotate"], global_test="domains"), 0)
    x0, x1 = plain.global_test[0], spread.global_test[0]
    assert torch.equal(spread.global_test[1], plain.global_test[1])
    for j in (0, 3, 5, 7, 8 + 6):
        assert torch.equal(x1[j], rotate(x0[j : j + 1], [0, 90, 180, 270][(j % N) * 4 // N])[0])


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,needle",
    [
        (['feature_shift.transforms=["spin"]'], "unknown transform 'spin'; available: rotate, invert, tint, noise"),
        (["feature_shift.rotations=0"], "feature_shift.rotations: must be >= 1"),
        (
            ['feature_shift.transforms=["rotate"]', "feature_shift.rotations=21"],
            "feature_shift.rotations gives 21 domain groups but num_clients = 20",
        ),
        (
            ['feature_shift.transforms=["noise"]', "dataset=agnews", "data_dir='/x'"],
            "dataset 'agnews' holds token ids",
        ),
        (["feature_shift.noise_sigma=-0.1"], "feature_shift.noise_sigma: must be >= 0"),
        (["feature_shift.angles=[]"], "feature_shift.angles: is empty"),
        (["feature_shift.rotations=3", "feature_shift.angles=[0,90]"], "rotations = 3 but angles lists 2"),
    ],
)
def test_bad_settings_get_one_clear_line(overrides, needle):
    with pytest.raises(ConfigError, match="invalid configuration") as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_token_ids_are_no_images():
    tokens = torch.randint(0, 50, (6, 12))
    client = ClientData(0, tokens[:4], torch.zeros(4, dtype=torch.int64), tokens[4:], torch.zeros(2, dtype=torch.int64))
    fed = FederatedData.from_clients([client], 2, name="tokens", vocab_size=50)
    with pytest.raises(DataError, match=r"changes images \[C, H, W\], but dataset 'tokens' holds torch.int64"):
        apply_feature_shift(fed, FeatureShift(transforms=["noise"]), 0)


def test_a_folder_with_fewer_clients_than_groups_is_named():
    x = torch.zeros(6, 1, 4, 4)
    client = ClientData(0, x[:4], torch.zeros(4, dtype=torch.int64), x[4:], torch.zeros(2, dtype=torch.int64))
    fed = FederatedData.from_clients([client], 2, name="folder")
    with pytest.raises(DataError, match="rotations gives 4 domain groups but the clients of 'folder' = 1"):
        apply_feature_shift(fed, FeatureShift(transforms=["rotate"]), 0)
