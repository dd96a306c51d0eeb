"""The tests' own float rules (tests/numerics.py): the thread pin restores what it changed,
and the reordered-sum tolerance holds for real reorderings yet catches a changed term."""

import math

import torch

from tests.numerics import EPS64, one_thread, sum_atol


def test_one_thread_pins_and_restores_the_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_fixture_pins_one_thread(one_thread):
    assert torch.get_num_threads() == 1


def test_sum_atol_holds_for_reorderings_and_catches_a_changed_term():
    g = torch.Generator().manual_seed(0)
    n = 10_000
    # terms of both signs and spread magnitudes: a sum with cancellation
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, n, dtype=torch.float64)
    x = x[torch.randperm(n, generator=g)]
    tol = sum_atol(n, x.abs().sum())
    assert tol == 2 * n * EPS64 * float(x.abs().sum())
    exact = math.fsum(x.tolist())
    orders = [x.sum().item(), x.flip(0).sum().item(), x.sort().values.sum().item(), sum(x.tolist()),
              x.view(100, 100).sum(0).sum().item(), x.view(100, 100).sum(1).sum().item()]
    for s in orders:
        assert abs(s - exact) <= tol / 2  # each order within n eps sum|x| of the exact sum
    # the largest term changed by 1e-8 of itself: about 17 times the tolerance here
    y = x.clone()
    i = int(x.abs().argmax())
    y[i] *= 1 + 1e-8
    assert abs(y.sum().item() - x.sum().item()) > tol
