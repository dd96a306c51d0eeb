"""Classification counts, rates and bootstrap intervals (METHOD.md section 5).

Definitions (ours; the paper's exact definitions were not available):

- ``O``: response tokens with ``A != 0`` and ``D > delta`` (delta by the sign of A).
- realized change ``dD = D(mu, pi') - D(mu, pi)``, same divergence, same mu.
  *increase* iff ``dD > tie_tol``, *decrease* iff ``dD < -tie_tol``, else a tie.
- criterion c calls a token *outward* iff ``A c > 0``; ``kept_c`` = tokens of the set
  that c does not mask (not outward).
- unsafe-keep rate = ``|kept_c and increase| / |kept_c|``;
  corrective-update rate = ``|kept_c and decrease| / |kept_c|`` (the two sum to 1 minus
  the share of ties); sign accuracy = share of the set where ``sign(A c)`` equals the
  realized sign (``sign(0) = 0``, a tie); mask precision = ``|masked_c and increase| /
  |masked_c|``.
- disagreement set of a predictive criterion p: tokens of O where the ratio and p
  differ on "outward".

Across seeds the rates are pooled over tokens with a seed-cluster bootstrap: see
:mod:`.tables`, which computes every table of the report from the per-token records.
This module holds the per-set counting rules (also used for one seed's quick counts).
"""

from __future__ import annotations

import torch

from pdmask.masks import outward
from .criteria import PREDICTIVE, RATIO

COUNT_KEYS = ("n", "kept", "masked", "unsafe", "corrective", "ties_kept", "masked_increase", "sign_ok")
#: rate name -> (numerator count, denominator count)
RATES = {
    "unsafe_keep": ("unsafe", "kept"),
    "corrective": ("corrective", "kept"),
    "sign_accuracy": ("sign_ok", "n"),
    "mask_precision": ("masked_increase", "masked"),
    "kept_frac": ("kept", "n"),
}


def realized_sign(dD: torch.Tensor, tie_tol: float = 0.0) -> torch.Tensor:
    """+1 increase, -1 decrease, 0 tie (``|dD| <= tie_tol``), as int64."""
    return (dD > tie_tol).long() - (dD < -tie_tol).long()


def classify(dD: torch.Tensor, advantages: torch.Tensor, values: dict[str, torch.Tensor],
             token_set: torch.Tensor, *, tie_tol: float = 0.0) -> dict[str, dict[str, int]]:
    """Counts of one token set for every criterion in ``values`` (all tensors the same shape).

    Returns ``{criterion: {n, kept, masked, unsafe, corrective, ties_kept,
    masked_increase, sign_ok}}`` as Python ints (one host sync).
    """
    if dD.shape != advantages.shape or dD.shape != token_set.shape:
        raise ValueError(f"dD: shape {tuple(dD.shape)} must equal advantages {tuple(advantages.shape)}"
                         f" and token_set {tuple(token_set.shape)}")
    real = realized_sign(dD, tie_tol)
    inc, dec = real > 0, real < 0
    S = token_set.bool()
    rows = []
    for name, v in values.items():
        pred = torch.sign(advantages * v).long()
        out = pred > 0
        kept = S & ~out
        rows.append(torch.stack([
            S.sum(), kept.sum(), (S & out).sum(), (kept & inc).sum(), (kept & dec).sum(),
            (kept & (real == 0)).sum(), (S & out & inc).sum(), (S & (pred == real)).sum(),
        ]))
    table = torch.stack(rows).tolist() if rows else []
    return {name: dict(zip(COUNT_KEYS, map(int, row))) for name, row in zip(values, table)}


def disagreement_set(values: dict[str, torch.Tensor], advantages: torch.Tensor, region: torch.Tensor,
                     criterion: str) -> torch.Tensor:
    """Tokens of ``region`` where ``criterion`` and the ratio differ on "outward"."""
    return region & (outward(values[RATIO], advantages) != outward(values[criterion], advantages))


def classify_seed(dD: torch.Tensor, advantages: torch.Tensor, values: dict[str, torch.Tensor],
                  region: torch.Tensor, *, tie_tol: float = 0.0) -> dict[str, dict]:
    """Counts on O and on each predictive criterion's disagreement set with the ratio.

    Keys: ``"out_of_region"`` (every criterion) and ``"disagreement:<p>"`` (the ratio
    and p only) for every predictive criterion p present in ``values``.
    """
    res = {"out_of_region": classify(dD, advantages, values, region, tie_tol=tie_tol)}
    for p in PREDICTIVE:
        if p in values:
            dis = disagreement_set(values, advantages, region, p)
            res[f"disagreement:{p}"] = classify(dD, advantages, {RATIO: values[RATIO], p: values[p]}, dis,
                                                tie_tol=tie_tol)
    return res


def rate(counts: dict[str, int], name: str) -> float | None:
    """One rate from counts; None when its denominator is 0."""
    num, den = RATES[name]
    return counts[num] / counts[den] if counts[den] else None

