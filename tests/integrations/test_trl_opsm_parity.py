"""pdmask's off-policy sequence mask against TRL 1.16's (GRPOTrainer.get_off_policy_mask):
the same threshold keeps the same sequences."""

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="needs trl")

from pdmask import corrections as C  # noqa: E402


@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_off_policy_mask_matches_trl(delta):
    g = torch.Generator().manual_seed(0)
    B, T = 32, 10
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampling = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[5, 4:] = 0
    mask[9, 1:] = 0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64)
    trl_keep = trl_grpo.GRPOTrainer.get_off_policy_mask(adv, logp, sampling, mask, delta)  # (B, 1)
    keep, _ = C.off_policy_mask(logp - sampling, adv[:, 0], mask.bool(), delta)
    ours = (keep | ~mask.bool()).all(-1)  # a sequence is kept iff all its response tokens are
    assert 0 < int((~ours).sum()) < B or delta == 0.5
    assert torch.equal(ours, trl_keep[:, 0].bool())
