"""How the tests compare floats computed twice.

Two rules (issue 30: the suite failed on an AMD EPYC where it passed on an Intel Xeon):

- **Bitwise** (``torch.equal``, ``rtol=0, atol=0``) only where the same operations run
  in the same order: run such a test under :func:`one_thread` (or the ``one_thread``
  fixture of ``tests/conftest.py``), because a BLAS or OpenMP reduction split over
  several threads may order its sums differently from call to call.
- **Two different computations** (two graphs, two code paths, chunked vs whole) agree
  only to float64 rounding of their sums: :func:`sum_atol` is the tolerance, derived from
  the length and the size of the sums, with the derivation in a comment at the call.
"""

from __future__ import annotations

import contextlib

import torch

#: float64 machine epsilon (2**-52): the spacing of floats at 1.0
EPS64 = torch.finfo(torch.float64).eps


@contextlib.contextmanager
def one_thread():
    """Torch (and through it MKL/OpenMP) on one intra-op thread inside the block; the
    previous count is restored after, so the pin does not leak into other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sum_atol(n_terms: int, abs_sum) -> float:
    """The absolute tolerance between two float64 evaluations of one sum of ``n_terms``
    terms whose absolute values sum to ``abs_sum``, summed in any two orders.

    Each order's result is within gamma_n * sum|terms| of the exact sum (Higham, Accuracy
    and Stability of Numerical Algorithms, 2nd ed., eq. 4.4; gamma_n = n eps / (1 - n eps),
    taken as n eps for n eps << 1), so the two differ by at most 2 n eps sum|terms|.
    ``abs_sum`` may be a float or a tensor (its largest entry is taken)."""
    if isinstance(abs_sum, torch.Tensor):
        abs_sum = float(abs_sum.detach().abs().max())
    return 2 * n_terms * EPS64 * float(abs_sum)
