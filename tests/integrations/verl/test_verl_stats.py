"""The verl binary losses read the core's binary statistics (no verl needed: the module
imports verl only inside the functions that call it)."""

from __future__ import annotations

import torch

import pdmask
from pdmask.integrations.verl import losses
from pdmask.keys import ESTIMATORS, TOPK_DIVERGENCES, ddot_key
from pdmask.stats import MAX_LOG_RATIO, binary_stats
from tests import flat  # noqa: E402


def _batch(B=3, T=5, V=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    zr = z + 0.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    k = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(z, -1).gather(-1, k[..., None])[..., 0]
    rlp = torch.log_softmax(zr, -1).gather(-1, k[..., None])[..., 0]
    return z, k, logp, rlp


def test_core_binary_stats_are_the_token_stats_binary_keys():
    z, k, logp, rlp = _batch()
    st = flat.token_stats(z, k, rlp)
    got = binary_stats(st["logp"].detach(), rlp, st["sum_p2"])
    assert set(got) == {"log_ratio", "ratio", "binary_tv", "binary_kl", "ddot_binary_tv", "ddot_binary_kl"}
    for key, val in got.items():
        torch.testing.assert_close(val, st[key], rtol=0, atol=0, msg=key)


def test_verl_binary_stats_are_the_core_ones_with_the_pi_k_squared_bound():
    z, k, logp, rlp = _batch(seed=1)
    mask = torch.ones_like(k, dtype=torch.bool)
    mask[0, -2:] = False
    got = losses.binary_stats(logp, rlp, mask)
    want = binary_stats(logp, rlp, logp.exp().square())
    assert set(got) == set(want) | {"entropy", "sampled_logprob"}
    assert torch.equal(got["sampled_logprob"][mask], rlp[mask])  # the anchor's log mu_k (DRPO's mu_k)
    for key in want:
        torch.testing.assert_close(got[key][mask], want[key][mask], rtol=0, atol=0, msg=key)
        assert torch.isfinite(got[key]).all(), key  # padding gets a harmless placeholder
    # the bound changes the magnitude of Ddot, never its sign (the sign is the ratio's)
    st = flat.token_stats(z, k, rlp)
    for key in ("ddot_binary_tv", "ddot_binary_kl"):
        assert torch.equal(torch.sign(got[key][mask]), torch.sign(st[key][mask])), key


def test_ratio_is_capped_at_the_one_constant():
    logp = torch.tensor([-1e-3, -0.5])
    rlp = torch.tensor([-120.0, -0.25])  # a log-ratio of ~120 saturates
    st = binary_stats(logp, rlp, logp.exp().square())
    assert st["ratio"][0] == torch.tensor(MAX_LOG_RATIO).exp()
    torch.testing.assert_close(st["ratio"][1], torch.tensor(-0.25).exp())
    v = losses.binary_stats(logp[None], rlp[None], torch.ones(1, 2, dtype=torch.bool))
    assert v["ratio"][0, 0] == torch.tensor(MAX_LOG_RATIO).exp()


def test_topk_stat_keys_are_the_vocabulary_keys():
    want = [ddot_key(d, e) for d in TOPK_DIVERGENCES for e in ESTIMATORS]
    assert list(losses.TOPK_STAT_KEYS[-len(want):]) == want
    assert "ddot_topk_kl_aggregated" in losses.TOPK_STAT_KEYS
