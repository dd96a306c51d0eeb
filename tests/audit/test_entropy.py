"""The closed form of the first-order entropy change, checked in float64."""

import math

import pytest
import torch

from pdmask_lab.audit.criteria import entropy_ddot


def _autograd_hdot(logits, ids, T):
    z = (logits / T).clone().requires_grad_(True)
    logq = torch.log_softmax(z, -1)
    H = -(logq.exp() * logq).sum(-1)
    (g,) = torch.autograd.grad(H.sum(), z)
    pi = logq.exp().detach()
    u = -pi
    u.scatter_add_(1, ids[:, None], torch.ones_like(u[:, :1]))
    return (g * u).sum(-1)


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_entropy_ddot_matches_autograd_float64(T):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 37, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 37, (64,), generator=g)
    got = entropy_ddot(logits, ids, temperature=T, chunk_size=5)  # several chunks
    want = _autograd_hdot(logits, ids, T)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_entropy_ddot_finite_difference_and_shape():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    got = entropy_ddot(logits, ids)
    assert got.shape == (2, 3)
    z, k = logits.reshape(-1, 11), ids.reshape(-1)
    pi = torch.softmax(z, -1)
    u = -pi
    u[torch.arange(6), k] += 1
    H = lambda x: -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)  # noqa: E731
    h = 1e-6
    fd = (H(z + h * u) - H(z - h * u)) / (2 * h)
    torch.testing.assert_close(got.reshape(-1), fd, rtol=1e-6, atol=1e-9)


def test_entropy_ddot_hand_cases():
    # Uniform pi is the entropy maximum: log pi_i + H = -log V + log V = 0 for every i,
    # so Hdot = 0 whatever token is pushed up.
    assert entropy_ddot(torch.zeros(1, 5, dtype=torch.float64), torch.tensor([2])).abs().item() < 1e-15
    # Two tokens, pi = (p, 1-p), p = sigmoid(z_0 - z_1), pushing token 0 up. The step
    # e_0 - pi = (1-p, -(1-p)) changes z_0 - z_1 by 2 (1-p); dp/d(z_0 - z_1) = p (1-p),
    # so dp = 2 p (1-p)^2. dH/dp = log((1-p)/p), hence Hdot = 2 p (1-p)^2 log((1-p)/p).
    # With p = 0.2: 2 * 0.2 * 0.64 * log 4 = 0.354891 (> 0: moving towards 1/2 raises H).
    p = 0.2
    z = torch.tensor([[math.log(p), math.log(1 - p)]], dtype=torch.float64)
    got = entropy_ddot(z, torch.tensor([0])).item()
    assert got == pytest.approx(2 * p * (1 - p) ** 2 * math.log((1 - p) / p), rel=1e-12)
    assert got == pytest.approx(0.354891, abs=1e-6)
