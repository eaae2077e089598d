"""Statistics of the hash dropout (betty.models.dropout): the keep rate is 1 − p and
mask entries are uncorrelated (between columns, neighbouring rows, keys and layers) to
the sampling noise floor, and a node's mask does not depend on which micro-batch it is in.

Noise floor: for m independent Bernoulli pairs the sample correlation has standard
deviation about ``1/sqrt(m)``, and the keep-rate estimate ``sqrt(p(1 − p)/m)``; every
bound below is 5 such standard deviations (the largest of 2,016 column pairs is about
4 sd for a fair hash, so 5 sd leaves room without hiding a real correlation; a
correlated or biased mask is off by orders of magnitude).
"""

from __future__ import annotations

import math

import pytest
import torch

from betty.models.dropout import dropout_key, hash_dropout, hash_keep_mask

N, WIDTH = 20_000, 64


def _ids(seed: int = 0) -> torch.Tensor:
    """Distinct global IDs: consecutive ones (the worst case for a weak hash) and
    scattered large ones."""
    gen = torch.Generator().manual_seed(seed)
    scattered = torch.randint(0, 1 << 40, (N // 2,), generator=gen)
    return torch.cat([torch.arange(N // 2, dtype=torch.int64), (1 << 41) + scattered])


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two equally shaped 0/1 tensors (pooled over entries)."""
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.7])
def test_keep_rate_is_one_minus_p(p):
    mask = hash_keep_mask(_ids(), WIDTH, p, dropout_key(0, 1), 0)
    m = mask.numel()
    assert abs(float(mask.double().mean()) - (1 - p)) < 5 * math.sqrt(p * (1 - p) / m)
    # per column too: no column is biased
    col_rate = mask.double().mean(0)
    assert float((col_rate - (1 - p)).abs().max()) < 5 * math.sqrt(p * (1 - p) / N)


def test_pairwise_column_correlations_at_noise_floor():
    mask = hash_keep_mask(_ids(), WIDTH, 0.5, dropout_key(3, 7), 1).double()
    c = torch.corrcoef(mask.T)  # (WIDTH, WIDTH)
    off = c[~torch.eye(WIDTH, dtype=torch.bool)]
    assert float(off.abs().max()) < 5 / math.sqrt(N)
    assert abs(float(off.mean())) < 5 / math.sqrt(N * (WIDTH - 1) / 2)


def test_rows_keys_and_layers_are_uncorrelated():
    ids = torch.arange(N, dtype=torch.int64)
    key = dropout_key(0, 0)
    mask = hash_keep_mask(ids, WIDTH, 0.5, key, 0)
    floor = 5 / math.sqrt(mask.numel())
    assert abs(_corr(mask[1:], mask[:-1])) < floor  # neighbouring IDs
    assert abs(_corr(mask, hash_keep_mask(ids, WIDTH, 0.5, dropout_key(0, 1), 0))) < floor  # next epoch
    assert abs(_corr(mask, hash_keep_mask(ids, WIDTH, 0.5, key, 1))) < floor  # next layer
    assert not torch.equal(mask, hash_keep_mask(ids, WIDTH, 0.5, dropout_key(1, 0), 0))


def test_masks_are_identical_across_micro_batches():
    """Rows carry the same mask whatever micro-batch (subset, order) they are computed in."""
    ids = _ids(1)
    key = dropout_key(5, 2)
    full = hash_keep_mask(ids, WIDTH, 0.5, key, 3)
    x = torch.randn(ids.numel(), WIDTH, dtype=torch.float64)
    full_out = hash_dropout(x, ids, 0.5, key, 3)
    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 7, (ids.numel(),), generator=gen)
    for k in range(7):
        rows = torch.nonzero(groups == k).flatten()
        rows = rows[torch.randperm(rows.numel(), generator=gen)]  # any order inside a micro-batch
        assert torch.equal(hash_keep_mask(ids[rows], WIDTH, 0.5, key, 3), full[rows])
        assert torch.equal(hash_dropout(x[rows], ids[rows], 0.5, key, 3), full_out[rows])
    # and a row's mask is its keep-mask, scaled by 1 / (1 - p)
    assert torch.equal(full_out, x * full / 0.5)


def test_the_largest_drop_probability_is_checked_where_dropout_is_configured():
    """Hash dropout's threshold ``round(p · 2^24)`` must stay below ``2^24``: p up to
    ``1 - 2^-24`` works (and drops nearly everything); a p closer to 1 is refused with the
    bound by every model that takes it, not an integer overflow inside the kernel."""
    from betty.catalog import MAX_DROPOUT
    from betty.models import build_model

    x, ids = torch.ones(64, 8), torch.arange(64)
    assert hash_dropout(x, ids, MAX_DROPOUT, key=1, layer=0).count_nonzero() <= 2
    near_one = 1 - 1e-9
    with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1 - 2\^-24\]"):
        hash_dropout(x, ids, near_one, key=1, layer=0)
    for arch, kwargs in (("sage", {"dropout": near_one}), ("gat", {"attn_dropout": near_one})):
        with pytest.raises(ValueError, match=r"must be a probability in \[0, 1 - 2\^-24\]"):
            build_model(arch, 8, 3, hidden=4, layers=1, **kwargs)
    build_model("gat", 8, 3, hidden=4, layers=1, dropout=MAX_DROPOUT, attn_dropout=MAX_DROPOUT)

