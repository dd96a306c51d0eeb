"""The typed arguments: each spec checks its fields when made (one line naming the field),
and ``PolicyLoss`` configured once computes exactly what ``policy_loss`` computes."""

import math

import pytest
import torch

import pdmask
from pdmask.masks import resolve_thresholds

F64 = torch.float64


def case(B=2, T=4, V=13, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=F64)
    mu = torch.log_softmax(logits + 0.5 * torch.randn(B, T, V, generator=g, dtype=F64), -1)
    ids = torch.distributions.Categorical(logits=mu).sample()
    top = mu.topk(K, -1)
    r = pdmask.Rollout(ids, mu.gather(-1, ids[..., None])[..., 0], top.indices, top.values,
                       torch.ones(B, T, dtype=torch.bool))
    return logits, r, torch.tensor([1.0, -1.0], dtype=F64)


@pytest.mark.parametrize("make,name", [
    (lambda: pdmask.Thresholds(delta_low=-1.0), "delta_low"),
    (lambda: pdmask.Thresholds(eps_low=1.0), "eps_low"),
    (lambda: pdmask.Thresholds(eps_high=math.inf), "eps_high"),
    (lambda: pdmask.Corrections(is_floor=6.0), "is_floor"),
    (lambda: pdmask.Corrections(is_level="seq"), "is_level"),
    (lambda: pdmask.Corrections(rejection="token_k2"), "rejection_threshold"),
    (lambda: pdmask.Sampling(temperature=0.0), "temperature"),
    (lambda: pdmask.Sampling(top_p=0.0), "top_p"),
    (lambda: pdmask.Aggregation("sum"), "loss_agg"),
    (lambda: pdmask.Aggregation(num_tokens=0), "num_tokens"),
    (lambda: pdmask.Compute(impl="gpu"), "impl"),
    (lambda: pdmask.Compute(chunk_rows=0), "chunk_rows"),
    (lambda: pdmask.PolicyLoss(mode="grpo", corrections=pdmask.Corrections(is_batch_normalize=True)),
     "is_batch_normalize"),
    (lambda: pdmask.PolicyLoss(sampling=pdmask.Sampling(top_k=5), compute=pdmask.Compute(impl="triton")), "impl"),
    (lambda: pdmask.PolicyLoss(thresholds={"delta_low": 0.1}), "thresholds"),
    (lambda: pdmask.Rollout(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 3, 1)),
     "rollout.topk_logprobs"),
])
def test_a_spec_checks_its_fields_when_made(make, name):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(name + ":") and "\n" not in str(e.value), str(e.value)


def test_off_values_are_stored_as_none():
    assert pdmask.Sampling(top_k=0, top_p=1.0, min_p=0.0) == pdmask.Sampling()
    assert not pdmask.Sampling(top_k=-1).truncated and pdmask.Sampling(top_p=0.9).truncated


def test_thresholds_resolve_to_the_modes_default():
    th = pdmask.Thresholds(delta_high=0.3).resolve(pdmask.MODES["pdm-topk-tv"])
    assert (th.delta_low, th.delta_high) == (pdmask.MODES["pdm-topk-tv"].default_delta, 0.3)


def test_resolve_thresholds_fills_in_the_modes_defaults():
    mode = pdmask.MODES["pdm-topk-tv"]
    assert resolve_thresholds(None, mode) == pdmask.Thresholds().resolve(mode)
    th = pdmask.Thresholds(0.1, 0.3)
    assert resolve_thresholds(th, mode) is th


@pytest.mark.usefixtures("one_thread")  # bitwise: the same operations in the same order, on one thread
def test_policy_loss_callable_equals_the_function():
    logits, r, adv = case()
    kw = dict(mode="pdm-topk-kl", thresholds=pdmask.Thresholds(0.02, 0.03),
              corrections=pdmask.Corrections(is_level="sequence", is_cap=2.0),
              sampling=pdmask.Sampling(temperature=0.8), aggregation=pdmask.Aggregation("seq-mean-token-mean"))
    a = pdmask.policy_loss(logits, r, adv, **kw)
    b = pdmask.PolicyLoss(**kw)(logits, r, adv)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.mask, b.mask)
    # a per-call aggregation replaces the configured one
    c = pdmask.PolicyLoss(**kw)(logits, r, adv, aggregation=pdmask.Aggregation("token-mean"))
    d = pdmask.policy_loss(logits, r, adv, **{**kw, "aggregation": None})
    torch.testing.assert_close(c.loss, d.loss, rtol=0, atol=0)
    m = pdmask.PolicyLoss(**kw).mask(logits, r, adv)
    assert torch.equal(m, pdmask.trust_region_mask(logits, r, adv, mode="pdm-topk-kl",
                                                   thresholds=pdmask.Thresholds(0.02, 0.03),
                                                   sampling=pdmask.Sampling(temperature=0.8)))


def test_rollout_indexing_and_moving():
    _, r, _ = case()
    s = r[torch.tensor([1])]
    assert s.sampled_ids.shape == (1, 4) and s.topk_ids.shape == (1, 4, 3)
    f = r.to(dtype=torch.float32)
    assert f.sampled_logprob.dtype == torch.float32 and f.sampled_ids.dtype == torch.long
