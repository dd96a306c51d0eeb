"""policy_loss_from_hidden: the loss of ``hidden @ lm_head_weight.T`` without the logits,
against policy_loss on the materialised logits (value, metrics, gradients for hidden and
weight) in float64, float32 and bf16, and without any (N, V) tensor."""

import pytest
import torch

import pdmask

from ..ops._ops_cases import AllocRecorder
from tests import flat  # noqa: E402

F64 = torch.float64
MODES = ["pdm-topk-kl", "pdm-topk-tv", "dppo-topk-kl", "dppo-binary-tv", "grpo", "none"]
#: dtype -> tolerances of (loss, gradients): float64 to rounding; float32 a few ulps of the
#: largest logit; bf16 the logits themselves are rounded to 8 bits in either path, then
#: differently summed (a column chunk vs one matmul), so gradients agree to bf16 precision.
TOL = {F64: (dict(atol=1e-12, rtol=1e-10), dict(atol=1e-12, rtol=1e-10)),
       torch.float32: (dict(atol=1e-5, rtol=1e-5), dict(atol=1e-5, rtol=1e-4)),
       torch.bfloat16: (dict(atol=1e-2, rtol=2e-2), dict(atol=2e-2, rtol=5e-2))}


def case(dtype, B=3, T=6, H=24, V=80, K=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=F64)
    W = torch.randn(V, H, generator=g, dtype=F64) / H ** 0.5 * 2
    z = h @ W.T
    logmu = torch.log_softmax(z + 0.6 * torch.randn(z.shape, generator=g, dtype=F64), -1)
    k = torch.multinomial(logmu.exp().view(-1, V), 1, generator=g).view(B, T)
    top = logmu.topk(K, dim=-1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[-1, T - 2:] = False
    rest = dict(sampled_ids=k, rollout_logprob=logmu.gather(-1, k[..., None])[..., 0].float(),
                rollout_topk_ids=top.indices, rollout_topk_logprobs=top.values.float(),
                advantages=torch.tensor([1.0, -1.0, 0.5][:B]), response_mask=mask)
    return h.to(dtype), W.to(dtype), rest


def both(dtype, mode, **kw):
    h0, W0, rest = case(dtype)
    h1, W1 = h0.clone().requires_grad_(), W0.clone().requires_grad_()
    h2, W2 = h0.clone().requires_grad_(), W0.clone().requires_grad_()
    a = flat.policy_loss_from_hidden(h1, W1, **rest, mode=mode, chunk_rows=13, **kw)
    b = flat.policy_loss(h2 @ W2.T, **rest, mode=mode, **kw)
    a.loss.backward()
    b.loss.backward()
    return a, b, (h1.grad, W1.grad), (h2.grad, W2.grad)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_equals_the_logits_loss(mode, dtype):
    a, b, ga, gb = both(dtype, mode)
    tl, tg = TOL[dtype]
    assert torch.equal(a.mask, b.mask)  # the same decisions
    torch.testing.assert_close(a.loss.double(), b.loss.double(), **tl)
    for name, x, y in zip(("hidden", "weight"), ga, gb):
        assert x.dtype == dtype
        torch.testing.assert_close(x.double(), y.double(), **tg, msg=lambda m, n=name: f"{n}: {m}")
    for key in b.metrics:
        torch.testing.assert_close(a.metrics[key].double(), b.metrics[key].double(), **tl, msg=key)


@pytest.mark.parametrize("kw", [dict(sampling_top_p=0.9), dict(is_level="sequence", is_mask=True, is_cap=3.0,
                                                                rejection="seq_mean_k3", rejection_threshold=0.3)],
                         ids=["truncated", "corrections"])
def test_equals_the_logits_loss_with_truncation_and_corrections(kw):
    a, b, ga, gb = both(F64, "pdm-topk-kl", **kw)
    torch.testing.assert_close(a.loss, b.loss)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)
    assert set(a.metrics) == set(b.metrics)


def test_no_tensor_of_the_logits_size():
    B, T, H, V = 2, 16, 8, 600
    h0, W0, rest = case(torch.float32, B=B, T=T, H=H, V=V, K=4)
    rest["response_mask"] = torch.ones(B, T, dtype=torch.bool)
    h, W = h0.requires_grad_(), W0.requires_grad_()
    rec = AllocRecorder()
    with rec:
        flat.policy_loss_from_hidden(h, W, **rest, mode="pdm-topk-kl", chunk_rows=4).loss.backward()
    biggest = max(n for _, n in rec.sizes)
    assert biggest <= max(4 * V, V * H) < B * T * V, sorted(rec.sizes, key=lambda x: x[1])[-3:]  # rows of 4
    assert h.grad is not None and W.grad is not None


def test_bad_inputs_name_the_argument():
    h, W, rest = case(torch.float32)
    for hh, ww, msg in [
        (h[0, 0], W, r"^hidden: expected a floating-point"),
        (h, W[:, :5], r"^lm_head_weight: expected a floating-point \(V, 24\)"),
        (h, W.double(), r"^lm_head_weight: must have the dtype and device of hidden"),
        (h.long(), W, r"^hidden: "),
    ]:
        with pytest.raises(ValueError, match=msg):
            flat.policy_loss_from_hidden(hh, ww, **rest)
    with pytest.raises(ValueError, match=r"^rollout.sampled_ids: expected shape \(3, 6\)"):
        flat.policy_loss_from_hidden(h, W, **{**rest, "sampled_ids": rest["sampled_ids"][:, :3]})
