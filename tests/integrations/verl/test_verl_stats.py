"""The verl losses read the core's statistics (:meth:`pdmask.TokenStats.from_logprobs`) (no verl needed: the module
imports verl only inside the functions that call it)."""

from __future__ import annotations

import torch

from pdmask.integrations.verl import losses
from pdmask.keys import ESTIMATORS, TOPK_DIVERGENCES, ddot_key
from pdmask.stats import MAX_LOG_RATIO, TokenStats, TopKStats
from tests import flat  # noqa: E402


def _batch(B=3, T=5, V=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    zr = z + 0.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    k = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(z, -1).gather(-1, k[..., None])[..., 0]
    rlp = torch.log_softmax(zr, -1).gather(-1, k[..., None])[..., 0]
    return z, k, logp, rlp


BINARY = ("log_ratio", "ratio", "binary_tv", "binary_kl", "ddot_binary_tv", "ddot_binary_kl")


def test_from_logprobs_gives_the_token_stats_binary_part():
    z, k, logp, rlp = _batch()
    st = flat.token_stats(z, k, rlp)
    got = TokenStats.from_logprobs(st["logp"].detach(), rlp, torch.ones_like(k, dtype=torch.bool), sum_p2=st["sum_p2"])
    assert got.topk is None and got.full is None and got.kept is None
    # bitwise: both sides are stats._binary on the same detached inputs, elementwise ops in one order
    for key in BINARY:
        torch.testing.assert_close(got[key], st[key], rtol=0, atol=0, msg=key)


def test_verl_binary_stats_are_the_core_ones_with_the_pi_k_squared_bound():
    z, k, logp, rlp = _batch(seed=1)
    mask = torch.ones_like(k, dtype=torch.bool)
    mask[0, -2:] = False
    got = losses.binary_stats(logp, rlp, mask)
    want = TokenStats.from_logprobs(logp, rlp, mask, sum_p2=logp.exp().square())
    assert isinstance(got, TokenStats) and set(got) == set(want)
    assert torch.equal(got["sampled_logprob"][mask], rlp[mask])  # the anchor's log mu_k (DRPO's mu_k)
    assert got.logp is logp and torch.equal(got.entropy, torch.zeros_like(logp))
    for key in BINARY:  # bitwise: one function (stats._binary), the same elementwise ops on the same inputs
        torch.testing.assert_close(got[key][mask], want[key][mask], rtol=0, atol=0, msg=key)
        assert torch.isfinite(got[key]).all(), key  # padding gets a harmless placeholder
    # the bound changes the magnitude of Ddot, never its sign (the sign is the ratio's)
    st = flat.token_stats(z, k, rlp)
    for key in ("ddot_binary_tv", "ddot_binary_kl"):
        assert torch.equal(torch.sign(got[key][mask]), torch.sign(st[key][mask])), key


def test_ratio_is_capped_at_the_one_constant():
    logp = torch.tensor([-1e-3, -0.5])
    rlp = torch.tensor([-120.0, -0.25])  # a log-ratio of ~120 saturates
    st = TokenStats.from_logprobs(logp, rlp, torch.ones(2, dtype=torch.bool))
    assert st["ratio"][0] == torch.tensor(MAX_LOG_RATIO).exp()
    torch.testing.assert_close(st["ratio"][1], torch.tensor(-0.25).exp())
    v = losses.binary_stats(logp[None], rlp[None], torch.ones(1, 2, dtype=torch.bool))
    assert v["ratio"][0, 0] == torch.tensor(MAX_LOG_RATIO).exp()


def test_shipped_keys_are_the_top_k_parts_fields():
    """What the actor hook ships is named by the top-K part's fields, written nowhere else: the
    part made from them (as the loss side makes it) has every Ddot the hook computed."""
    want = [ddot_key(d, e) for d in TOPK_DIVERGENCES for e in ESTIMATORS]
    assert list(losses.SHIPPED[-len(want):]) == want and losses.SHIPPED[:2] == ("sampled_logprob", "entropy")
    z, k, _, _ = _batch(seed=2)
    lmu = torch.log_softmax(z + torch.randn(z.shape, generator=torch.Generator().manual_seed(3), dtype=z.dtype), -1)
    top = lmu.topk(4, -1)
    st = flat.token_stats(z, k, lmu.gather(-1, k[..., None])[..., 0], top.indices, top.values)
    shipped = st.topk.to_dict()
    assert list(shipped) == list(losses.SHIPPED[2:])
    part = TopKStats.from_dict(shipped)
    for key in want:
        assert torch.equal(part.ddot(*key.removeprefix("ddot_").rsplit("_", 1)), st[key]), key
