"""share_forward=True: the mask on the caller's own forward, whose logits the loss reuses."""

import copy

import pytest
import torch

import pdmask
from pdmask_lab.batchmask import BatchMask

from .helpers import TinyLM, logits_of, make_batch
from tests import flat  # noqa: E402


def _loss(logits, batch, out):
    T = logits.shape[1]
    return flat.policy_loss(logits, batch["input_ids"][:, -T:], batch["rollout_logprob"],
                              batch["rollout_topk_ids"], batch["rollout_topk_logprobs"], batch["advantages"],
                              batch["response_mask"], **out.loss_kwargs())


@pytest.mark.parametrize("method,tied,params", [("jvp", False, "all"), ("jvp", True, 1),
                                                ("double-backward", True, "all"), ("double-backward", True, 1)])
def test_shared_forward_gives_the_same_mask_and_the_ordinary_gradient(method, tied, params):
    """Same ddot and mask as the separate forward; the loss on ``out.logits`` back-propagates
    into every parameter exactly as a loss on a fresh forward (a tied matrix through both
    of its uses, even when the subset moves only the head's use)."""
    m = TinyLM(seed=3, tied=tied)
    batch = make_batch(m, seed=3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for p in m.parameters():  # a real AdamW state, so P is not a multiple of the identity
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)
    bm = BatchMask(m, params=params, optimizer=opt, method=method)
    ref = flat.call_mask(bm, **batch)
    assert ref.logits is None and all(p.grad is None for p in m.parameters())
    out = flat.call_mask(bm, **batch, share_forward=True)
    assert out.method == ref.method and out.logits.requires_grad
    torch.testing.assert_close(out.ddot, ref.ddot, rtol=1e-10, atol=1e-12)
    assert torch.equal(out.mask, ref.mask) and (~out.mask).any() and out.out_of_region.sum() > (~out.mask).sum()
    assert all(p.grad is None for p in m.parameters())  # the direction's backward leaves .grad alone
    _loss(out.logits, batch, out).loss.backward()
    plain = copy.deepcopy(m)
    plain.zero_grad(set_to_none=True)
    _loss(logits_of(plain, batch), batch, ref).loss.backward()
    for (n, p), q in zip(m.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13, msg=n)
    assert sum(p.grad.abs().sum() for p in m.parameters()) > 0


@pytest.mark.parametrize("params,share", [("all", False), (1, True)])
def test_region_scope_differentiates_only_the_sequences_holding_O(params, share):
    """Only tokens of O can be masked (scope="region"), so by default only the sequences
    that hold one are differentiated: same mask, same ddot there, 0 elsewhere."""
    m = TinyLM(seed=4, tied=True)
    batch = make_batch(m, B=5, seed=4)
    batch["advantages"] = torch.tensor([1.3, 0.0, 0.0, -1.1, 0.0], dtype=torch.float64)  # A = 0: never in O
    full = flat.call_mask(BatchMask(m, params=params, all_tokens=True), **batch)
    out = flat.call_mask(BatchMask(m, params=params), **batch, share_forward=share)
    rows = full.out_of_region.any(1)
    assert rows.tolist() == [True, False, False, True, False]
    assert int(out.metrics["num_direction_rows"]) == 2 and int(full.metrics["num_direction_rows"]) == 5
    assert torch.equal(out.mask, full.mask) and (~out.mask).any()
    torch.testing.assert_close(out.ddot[rows], full.ddot[rows], rtol=1e-10, atol=1e-12)
    assert (out.ddot[~rows] == 0).all() and (full.ddot[~rows] != 0).any()
    assert out.metrics["direction_norm"].item() == pytest.approx(full.metrics["direction_norm"].item(), rel=1e-10)
    # all sequences hold O: the whole batch on the first forward (the cheaper route)
    batch["advantages"] = torch.tensor([1.3, -0.8, 0.6, -1.1, 0.9], dtype=torch.float64)
    out = flat.call_mask(BatchMask(m, params=params), **batch)
    if bool(out.out_of_region.any(1).all()):
        assert int(out.metrics["num_direction_rows"]) == 5
    # no token of O at all: nothing to differentiate, nothing masked
    batch["advantages"] = torch.zeros(5, dtype=torch.float64)
    out = flat.call_mask(BatchMask(m, params=params), **batch)
    assert out.mask.all() and (out.ddot == 0).all() and int(out.metrics["num_direction_rows"]) == 0
