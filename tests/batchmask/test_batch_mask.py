"""The batch direction c_t: finite differences of Phi, the per-token loop, both methods, the mask."""

import pytest
import torch

import pdmask
from pdmask_lab.batchmask import BatchMask, batch_mask, preconditioner

from .helpers import (
    F64, TinyLM, logits_of, make_batch, naive_divergence, per_token_oracle, region_and_weights, tiny_llama,
)
from tests import flat  # noqa: E402


def _phi_at(model, batch, named, O, divergence, temperature):
    """Phi with O held fixed, from the core's own divergence values."""
    with torch.no_grad():
        z = logits_of(model, batch, named)
    T = z.shape[1]
    st = flat.token_stats(z, batch["input_ids"][:, -T:], batch["rollout_logprob"], batch["rollout_topk_ids"],
                            batch["rollout_topk_logprobs"], response_mask=batch["response_mask"],
                            temperature=temperature)
    return float((st[divergence] * O).sum())


@pytest.mark.parametrize("divergence,temperature,optim", [
    ("topk_kl", 1.0, None), ("topk_tv", 1.0, None), ("topk_kl", 0.7, None), ("topk_kl", 1.0, "adamw")])
def test_c_is_the_central_difference_of_phi_along_the_tokens_own_update(divergence, temperature, optim):
    """c_t = d/de Phi(theta + e P grad l_t) at e = 0, l_t = w_t A_t log pi_t, O fixed."""
    m = TinyLM(seed=1)
    opt = None
    if optim == "adamw":  # a real state: P is far from a multiple of the identity
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * torch.rand(p.shape, generator=g,
                                                                                        dtype=p.dtype)
            opt.step()
        opt.zero_grad(set_to_none=True)
    batch = make_batch(m, seed=1, temperature=temperature)
    delta = 0.05 if divergence == "topk_kl" else 0.12
    out = flat.batch_mask(m, **batch, divergence=divergence, delta_low=delta, delta_high=delta, temperature=temperature,
                     optimizer=opt, all_tokens=True)
    O, w, A, _ = region_and_weights(m, batch, divergence=divergence, delta=delta, temperature=temperature)
    assert torch.equal(out.out_of_region, O) and 0 < O.sum() < batch["response_mask"].sum()
    names, params = zip(*m.named_parameters())
    T = O.shape[1]
    checked = 0
    for b, t in [(0, 0), (0, 3), (1, 1), (1, 3), (2, 2), (2, 5)]:
        z = logits_of(m, batch)
        logp = torch.log_softmax(z / temperature, -1)[b, t, batch["input_ids"][b, -T + t]]
        d = torch.autograd.grad(w[b, t] * A[b, t] * logp, params)  # grad l_t
        if opt is not None:
            d = [x * P for x, P in zip(d, preconditioner(opt, list(params), list(names)))]  # P grad l_t
        norm = torch.sqrt(sum((g * g).sum() for g in d))
        eps = 1e-5 / norm  # a step of length 1e-5 in parameter space
        plus = _phi_at(m, batch, {n: p + eps * g for n, p, g in zip(names, params, d)}, O, divergence, temperature)
        minus = _phi_at(m, batch, {n: p - eps * g for n, p, g in zip(names, params, d)}, O, divergence, temperature)
        fd = float((plus - minus) / (2 * eps))
        assert out.c[b, t].item() == pytest.approx(fd, rel=1e-6, abs=1e-9), (b, t)
        checked += abs(fd) > 1e-3
    assert checked >= 4  # the differences are not all ~0
    # c = A w ddot
    torch.testing.assert_close(out.c, A * w * out.ddot)


@pytest.mark.parametrize("method", ["jvp", "double-backward"])
@pytest.mark.parametrize("tied", [False, True])
def test_both_methods_equal_an_explicit_per_token_gradient_loop(method, tied):
    m = TinyLM(seed=2, tied=tied)
    batch = make_batch(m, seed=2)
    out = flat.batch_mask(m, **batch, method=method, all_tokens=True)
    assert out.method == method
    ref, O, w, A = per_token_oracle(m, batch, list(m.parameters()))
    assert torch.equal(out.out_of_region, O) and O.any()
    assert ref.abs().max() > 1e-2
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)
    assert (out.ddot[~batch["response_mask"]] == 0).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.usefixtures("one_thread")  # bitwise auto vs jvp: one method, the same ops, on one thread
def test_transformers_model_jvp_double_backward_and_loop_agree(arch):
    """transformers' RMSNorm computes in float32 even in a float64 model, so agreement is
    to float32 rounding; both methods differentiate exactly the same function."""
    m = tiny_llama(arch=arch, tied=True)
    batch = make_batch(m, seed=3)
    a = flat.batch_mask(m, **batch, method="jvp", all_tokens=True)
    b = flat.batch_mask(m, **batch, method="double-backward", all_tokens=True)
    auto = BatchMask(m, all_tokens=True)
    c = flat.call_mask(auto, **batch)
    assert auto.method == "jvp"  # the math SDPA backend has forward-mode derivatives
    ref, O, _, _ = per_token_oracle(m, batch, list(m.parameters()))
    assert O.any() and ref.abs().max() > 1e-3
    torch.testing.assert_close(a.ddot, b.ddot, atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(c.ddot, a.ddot, atol=0, rtol=0)
    torch.testing.assert_close(a.ddot, ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)


class _NoForwardAD(torch.autograd.Function):
    """tanh with a backward but no jvp: forward mode cannot go through it."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _LMWithCustomOp(TinyLM):
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm_head(_NoForwardAD.apply(self.norm(self.embed(input_ids) + self.pos(position_ids))))


def test_auto_falls_back_to_double_backward_when_an_op_has_no_forward_mode_derivative():
    m = _LMWithCustomOp(seed=4)
    batch = make_batch(m, seed=4)
    with pytest.raises(NotImplementedError, match="jvp"):
        flat.batch_mask(m, **batch, method="jvp", all_tokens=True)
    bm = BatchMask(m, all_tokens=True)
    out = flat.call_mask(bm, **batch)
    assert out.method == "double-backward" and bm.method == "double-backward"
    ref, O, _, _ = per_token_oracle(m, batch, list(m.parameters()))
    assert O.any() and ref.abs().max() > 1e-3
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("scope", ["region", "all"])
def test_mask_is_what_policy_loss_applies_with_the_batch_mode(scope):
    m = TinyLM(seed=5)
    batch = make_batch(m, seed=5)
    out = flat.batch_mask(m, **batch, scope=scope, delta_low=0.04, delta_high=0.06)
    O, w, A, _ = region_and_weights(m, batch)
    O = (batch["advantages"][:, None] > 0) & (region_and_weights(m, batch, delta=0.06)[0]) | \
        (batch["advantages"][:, None] < 0) & (region_and_weights(m, batch, delta=0.04)[0])
    outward = A * out.ddot > 0
    want = ~((O if scope == "region" else batch["response_mask"]) & outward)
    assert torch.equal(out.mask, want) and torch.equal(out.out_of_region, O)
    assert (~want).any() and (want & batch["response_mask"]).any()
    assert torch.equal(outward, out.c > 0)
    # the loss applies the same mask on the same logits (same parameters)
    z = logits_of(m, batch).detach().requires_grad_()
    T = z.shape[1]
    kw = out.loss_kwargs()
    assert kw["mode"] == ("pdm-batch-topk-kl" if scope == "region" else "pdm-batch-all-topk-kl")
    loss = flat.policy_loss(z, batch["input_ids"][:, -T:], batch["rollout_logprob"], batch["rollout_topk_ids"],
                              batch["rollout_topk_logprobs"], batch["advantages"], batch["response_mask"], **kw)
    assert torch.equal(loss.mask, out.mask)
    loss.loss.backward()
    assert (z.grad[~out.mask] == 0).all() and (z.grad[out.mask & batch["response_mask"]].abs().sum(-1) > 0).all()
    # metrics
    mt = out.metrics
    n = batch["response_mask"].sum()
    assert mt["num_out_of_region"] == O.sum() and mt["num_masked"] == (~want).sum()
    assert mt["masked_frac"].item() == pytest.approx(float((~want).sum() / n))
    assert mt["phi"].item() == pytest.approx(float((naive_divergence(z.detach(), batch, "topk_kl") * O).sum()))
    assert all(not t.requires_grad for t in mt.values())


@pytest.mark.usefixtures("one_thread")  # bitwise: ddot does not read is_cap, the same ops, on one thread
def test_is_weight_scales_c_but_never_changes_the_mask():
    m = TinyLM(seed=6)
    batch = make_batch(m, seed=6)
    a = flat.batch_mask(m, **batch, is_cap=1.0)  # w <= 1
    b = flat.batch_mask(m, **batch, is_cap=float("inf"))
    assert torch.equal(a.mask, b.mask) and torch.equal(a.ddot, b.ddot) and not torch.equal(a.c, b.c)


def test_the_model_and_its_parameters_are_left_untouched():
    m = TinyLM(seed=7)
    batch = make_batch(m, seed=7)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    flat.batch_mask(m, **batch, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n


def test_float32_model_gives_finite_results_close_to_float64():
    m64 = TinyLM(seed=8)
    m32 = TinyLM(seed=8, dtype=torch.float32)
    batch = make_batch(m64, seed=8)
    a = flat.batch_mask(m64, **batch, all_tokens=True)
    b = flat.batch_mask(m32, **batch, all_tokens=True)
    assert b.ddot.dtype == torch.float32 and torch.isfinite(b.ddot).all()
    torch.testing.assert_close(b.ddot.double(), a.ddot, atol=1e-3 * a.ddot.abs().max().item(), rtol=1e-3)
    assert a.ddot.dtype == F64
