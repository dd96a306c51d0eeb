"""Phi's closed-form chunked gradient equals autograd through log_softmax (float64)."""

import math

import pytest
import torch

import pdmask
from pdmask._validate import prepare
from pdmask_lab.batchmask import out_of_region_divergence

from .helpers import F64, naive_divergence
from tests import flat  # noqa: E402


def _case(B=2, T=9, V=30, K=4, seed=0, temperature=1.0, peaked=0.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=F64) * 1.5
    z[0, :, 0] += peaked  # the trainer puts almost all mass on one token: a small tail pi_T
    logmu = torch.log_softmax((z + 0.8 * torch.randn(B, T, V, generator=g, dtype=F64)) / temperature, -1)
    top = logmu.topk(K, -1)
    k = torch.multinomial(logmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    k[1, :3] = torch.randint(0, V, (3,), generator=g)  # some sampled tokens outside the top-K
    ids = torch.cat([torch.zeros(B, 1, dtype=torch.long), k], 1)  # a context column (unused here)
    rmask = torch.ones(B, T, dtype=torch.bool)
    rmask[1, -2:] = False
    batch = dict(input_ids=ids, rollout_logprob=logmu.gather(-1, k[..., None])[..., 0],
                 rollout_topk_ids=top.indices, rollout_topk_logprobs=top.values, response_mask=rmask)
    weight = (torch.rand(B, T, generator=g) < 0.6) & rmask
    return z, k, batch, weight


@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("peaked", [0.0, 10.0])
def test_phi_value_is_the_cores_and_its_gradient_is_autograds(divergence, temperature, peaked):
    z, k, batch, weight = _case(temperature=temperature, peaked=peaked)
    st = flat.token_stats(z, k, batch["rollout_logprob"], batch["rollout_topk_ids"], batch["rollout_topk_logprobs"],
                            response_mask=batch["response_mask"], temperature=temperature)
    value = (st[divergence] * weight).sum()
    b = prepare(tuple(z.shape[:-1]), z.shape[-1], z.device, flat.rollout(sampled_ids=k, **batch), validate=False)
    x = z.clone().requires_grad_()
    phi = out_of_region_divergence(x.reshape(-1, z.shape[-1]), value, weight.reshape(-1).to(F64), b.sampled_ids,
                                   b.sampled_logprob, b.topk_ids, b.topk_logprobs, divergence=divergence,
                                   temperature=temperature, chunk_rows=5)  # chunks that split the rows unevenly
    phi.backward()
    y = z.clone().requires_grad_()
    ref = (naive_divergence(y, batch, divergence, temperature) * weight).sum()
    ref.backward()
    torch.testing.assert_close(phi.detach(), ref.detach(), atol=1e-12, rtol=1e-12)
    assert x.grad.abs().sum() > 0 and (x.grad[~weight] == 0).all()
    # peaked: autograd's 1 - sum_{S'} pi loses digits as pi_T shrinks; the closed form does not
    torch.testing.assert_close(x.grad, y.grad, atol=1e-11, rtol=1e-9 if not peaked else 1e-6)


def test_phi_gradient_has_the_logits_dtype_and_no_nan_in_bf16():
    z, k, batch, weight = _case(peaked=60.0)  # pi_T underflows: autograd through log(1 - sum) gives NaN
    st = flat.token_stats(z, k, batch["rollout_logprob"], batch["rollout_topk_ids"], batch["rollout_topk_logprobs"],
                            response_mask=batch["response_mask"])
    b = prepare(tuple(z.shape[:-1]), z.shape[-1], z.device, flat.rollout(sampled_ids=k, **batch), validate=False)
    x = z.to(torch.bfloat16).requires_grad_()
    out_of_region_divergence(x.reshape(-1, z.shape[-1]), (st["topk_kl"] * weight).sum().float(),
                             weight.reshape(-1).float(), b.sampled_ids, b.sampled_logprob, b.topk_ids,
                             b.topk_logprobs, divergence="topk_kl", temperature=1.0, chunk_rows=4).backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert math.isfinite(float(x.grad.float().abs().max()))
