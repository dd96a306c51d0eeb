"""pdmask's corrections against SkyRL 0.3.0's sequence and token masks, restated in our own words
(SkyRL is not installed here).

Source: NovaSky-AI/SkyRL, ``skyrl-train/skyrl_train/utils/off_policy_correction_utils.py``
(``compute_sequence_mask``, ``compute_token_mask``) with ``safe_exp_delta`` of
``skyrl_train/utils/torch_utils.py`` (``exp`` of the input clamped to [-20, 20]):

- geometric (``sequence_mask_metric: geometric``): the sequence's log-ratios
  ``old_log_probs - rollout_logprobs`` are summed over its response tokens and divided by their
  count; ``safe_exp_delta`` of that mean is the geometric mean; the sequence is kept iff it lies in
  ``[geo_mask_low, geo_mask_high]``.
- product (``sequence_mask_metric: product``): the same with the sum in place of the mean, kept
  iff in ``[product_mask_low, product_mask_high]``.
- token mask: a token is kept iff ``safe_exp_delta`` of its own log-ratio lies in
  ``[token_mask_is_threshold_low, token_mask_is_threshold_high]``.

pdmask's names for them (docs/corrections.md): Geo-RS ``rejection="seq_mean_k1"`` with
``rejection_threshold=f"{1/b}_{1/a}"``; sequence MIS ``is_level="sequence", is_mask=True``;
IcePop ``is_level="token", is_mask=True``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdmask import corrections as C

F64 = torch.float64


def _sx(x):
    return torch.exp(x.clamp(-20.0, 20.0))


def skyrl_geometric_keep(lr, mask, low, high):
    n = mask.sum(-1).clamp(min=1)
    geo = _sx((lr * mask).sum(-1) / n)
    return (geo >= low) & (geo <= high), geo


def skyrl_product_keep(lr, mask, low, high):
    prod = _sx((lr * mask).sum(-1))
    return (prod >= low) & (prod <= high)


def skyrl_token_keep(lr, low, high):
    r = _sx(lr)
    return (r >= low) & (r <= high)


def batch(seed=0, B=24, T=10, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(B, T, generator=g, dtype=F64) * scale
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 6:] = False
    mask[5, 1:] = False
    return lr, mask


@pytest.mark.parametrize("a,b", [(0.9, 1.1), (0.95, 1.02)])
def test_geo_rs_equals_skyrls_geometric_mask_inside_the_clamp(a, b):
    lr, mask = batch()
    keep, _ = C.rejection_mask(lr, mask, "seq_mean_k1", f"{1 / b}_{1 / a}")
    sky, _ = skyrl_geometric_keep(lr, mask, a, b)
    assert 0 < int((~sky).sum()) < len(sky), "the mask must bite, and not everywhere"
    assert torch.equal(keep.all(-1), sky)


def test_sequence_mis_and_icepop_equal_skyrls_inside_the_clamp():
    lr, mask = batch(1)
    _, keep, _ = C.importance_weights(lr, mask, C.Corrections(is_level="sequence", is_mask=True, is_floor=0.5,
                                                              is_cap=2.0))
    assert torch.equal(keep.all(-1), skyrl_product_keep(lr, mask, 0.5, 2.0))
    _, keep, _ = C.importance_weights(lr, mask, C.Corrections(is_level="token", is_mask=True, is_floor=0.8,
                                                              is_cap=1.25))
    sky = skyrl_token_keep(lr, 0.8, 1.25)
    assert torch.equal(keep | ~mask, sky | ~mask) and not bool(keep.all())


def test_geo_rs_differs_from_skyrl_beyond_the_clamp():
    """Documented difference (docs/corrections.md): SkyRL clamps the mean log-ratio, pdmask (as
    verl) each token's. 20 tokens, one at log r = -30, bounds [0.3, 3]: SkyRL 0.22, masked;
    pdmask 0.37, kept."""
    lr = torch.zeros(1, 20, dtype=F64)
    lr[0, 7] = -30.0
    mask = torch.ones(1, 20, dtype=torch.bool)
    sky, geo = skyrl_geometric_keep(lr, mask, 0.3, 3.0)
    assert float(geo) == pytest.approx(math.exp(-1.5)) and not bool(sky.any())  # 0.22
    stat = C.rule_statistic("seq_mean_k1", lr, mask)  # mean of -clamp(log r): 1/geometric mean
    assert float(torch.exp(-stat)) == pytest.approx(math.exp(-1.0))  # 0.37
    keep, _ = C.rejection_mask(lr, mask, "seq_mean_k1", f"{1 / 3.0}_{1 / 0.3}")
    assert bool(keep.all())


def test_sequence_mis_differs_from_skyrl_and_verl_beyond_the_clamp():
    """A log-ratio sum of -29.7 under [1e-12, 1e12]: SkyRL (and verl) clamp it to -20 and keep the
    sequence; pdmask masks it (e^-29.7 = 1.3e-13 < 1e-12)."""
    lr = torch.full((1, 2), -14.85, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert bool(skyrl_product_keep(lr, mask, 1e-12, 1e12).all())
    _, keep, _ = C.importance_weights(lr, mask, C.Corrections(is_level="sequence", is_mask=True, is_floor=1e-12,
                                                              is_cap=1e12))
    assert not bool(keep.any())
