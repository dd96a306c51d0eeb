"""Per-token criteria of the audit, read from :func:`pdmask.token_stats` output.

A *criterion* is a signed per-token value ``c_t`` whose product with the advantage
predicts the sign of the divergence change of the token's own update: the criterion
calls the update *outward* iff ``A_t c_t > 0`` (METHOD.md section 4).

==================  ==========================================================
criterion           ``c_t``
==================  ==========================================================
ratio               ``log r = log pi_k - log mu_k`` (PPO, DPPO)
pred-exact          ``Ddot`` of the top-K divergence, exact tail (``sum pi^2``)
pred-aggregated     ``Ddot`` with the tail as one token (the paper)
pred-uniform        ``Ddot`` with the tail spread evenly (the paper)
pred-truncated      ``Ddot`` with the tail ignored (baseline)
pred-full           ``Ddot`` of the full-vocabulary divergence (needs mu's logits)
==================  ==========================================================

The top-K and full criteria of one family (KL or TV) are used whatever the proximity
divergence of that family is, so e.g. with ``full_kl`` the four top-K estimators are
judged as approximations of the full-vocabulary direction.
"""

from __future__ import annotations

import torch

from pdmask.keys import ESTIMATORS, ddot_key
from pdmask.ops import compute_dtype, rows_per_chunk

RATIO = "ratio"
FULL = "pred-full"
PREDICTIVE = tuple(f"pred-{e}" for e in ESTIMATORS) + (FULL,)
CRITERIA = (RATIO,) + PREDICTIVE


def predictive_name(estimator: str) -> str:
    return f"pred-{estimator}"


def criterion_values(stats: dict, family: str) -> dict[str, torch.Tensor]:
    """Signed criterion values (same shape as the stats) for every criterion of the family."""
    out = {RATIO: stats["log_ratio"].detach()}
    for est in ESTIMATORS:
        out[predictive_name(est)] = stats[ddot_key(f"topk_{family}", est)].detach()
    out[FULL] = stats[ddot_key(f"full_{family}")].detach()
    return out


@torch.no_grad()
def entropy_ddot(logits: torch.Tensor, sampled_ids: torch.Tensor, *, temperature: float = 1.0,
                 chunk_size: int | None = None) -> torch.Tensor:
    """First-order entropy change along the token's logit step: ``Hdot = grad_z H . (e_k - pi)``.

    With ``pi = softmax(z)`` (``z = logits / T``) and ``H = -sum_i pi_i log pi_i``::

        dH/dz_j = -sum_i (dpi_i/dz_j)(log pi_i + 1),  dpi_i/dz_j = pi_i (delta_ij - pi_j)
                = -pi_j (log pi_j + 1) + pi_j sum_i pi_i (log pi_i + 1)
                = -pi_j (log pi_j + H)

    so, with ``e_k - pi`` as the direction::

        Hdot = -pi_k (log pi_k + H) + sum_j pi_j^2 (log pi_j + H)

    The token's update changes the entropy by ``A w Hdot`` to first order (``w > 0``).
    Naive torch: ``autograd.grad(H(z), z) @ (e_k - pi)``. Needs ``sum_j pi_j^2 log pi_j``,
    a vocabulary reduction the core statistics do not make, so it is done here in row
    chunks (the audit is an analysis path, not the training hot path).

    Args:
        logits: (..., V) raw logits; sampled_ids: (...) token ids. Returns (...) in
        float32 (float64 for float64 logits).
    """
    lead, V = logits.shape[:-1], logits.shape[-1]
    z_all = logits.reshape(-1, V)
    ids = sampled_ids.reshape(-1).long()
    cdt = compute_dtype(logits.dtype)
    step = rows_per_chunk(V, chunk_size, logits.device)
    out = []
    for s in range(0, z_all.shape[0], step):
        logq = torch.log_softmax(z_all[s:s + step].to(cdt) / temperature, -1)  # (c, V)
        p = logq.exp()
        plogp = torch.where(p > 0, p * logq, torch.zeros_like(p))
        H = -plogp.sum(-1)  # (c,)
        p2logp = (p * plogp).sum(-1)  # sum_j pi_j^2 log pi_j
        sum_p2 = (p * p).sum(-1)
        lk = logq.gather(1, ids[s:s + step, None]).squeeze(1)
        out.append(-lk.exp() * (lk + H) + p2logp + H * sum_p2)
    return torch.cat(out).reshape(lead)
