"""pdmask's corrections against verl 0.9.1's own rollout-correction helper: the same names
and thresholds give the same keep masks and IS weights (the one-to-one mapping of
docs/corrections.md), on random log-ratios with ragged response masks."""

import pytest
import torch

helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="needs verl 0.9.1")

from pdmask import corrections as C  # noqa: E402


def batch(seed=0, B=16, T=12, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[3, 5:] = 0
    mask[7, 2:] = 0
    mask[11, 1:] = 0
    return lr, mask


RULES = [("token_k1", "0.6_1.5"), ("token_k1", 1.5), ("token_k2", 0.1), ("token_k3", 0.08),
         ("seq_sum_k1", "0.3_2.5"), ("seq_sum_k2", 1.0), ("seq_sum_k3", 0.9), ("seq_mean_k1", "0.9_1.2"),
         ("seq_mean_k2", 0.08), ("seq_mean_k3", 0.08), ("seq_max_k2", 0.3), ("seq_max_k3", 0.3),
         ("token_k3,seq_mean_k1", "0.1,0.8_1.3")]


@pytest.mark.parametrize("rule, thr", RULES, ids=[f"{r}:{t}" for r, t in RULES])
def test_rollout_rs_keeps_the_same_tokens(rule, thr):
    lr, mask = batch()
    verl_mask, _ = helper.compute_rollout_rejection_mask(lr, mask, rule, thr)
    keep, _ = C.rejection_mask(lr, mask.bool(), rule, thr)
    v = mask.bool()
    assert 0 < int((~keep & v).sum()) < int(v.sum())  # the rule bites, and not everywhere
    assert torch.equal((verl_mask > 0.5) & v, keep & v)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("thr", [2.0, "0.7_1.6"], ids=["tis", "icepop-mis"])
@pytest.mark.parametrize("normalize", [False, True])
def test_rollout_is_gives_the_same_weights(level, thr, normalize):
    lr, mask = batch(seed=1)
    w_verl, _ = helper.compute_rollout_correction_weights(lr, mask, level, thr, normalize)
    kw = dict(is_level=level, is_batch_normalize=normalize)
    if isinstance(thr, str):
        lo, hi = map(float, thr.split("_"))
        kw.update(is_cap=hi, is_floor=lo, is_mask=True)
    else:
        kw.update(is_cap=thr)
    w, keep, _ = C.importance_weights(lr, mask.bool(), C.Corrections(**kw))
    torch.testing.assert_close(w * mask, w_verl * mask)
    if kw.get("is_mask"):  # verl zeroes the IcePop / MIS weights; pdmask masks the same tokens
        assert torch.equal((w_verl > 0) | ~mask.bool(), keep | ~mask.bool())
        assert not keep.all()
