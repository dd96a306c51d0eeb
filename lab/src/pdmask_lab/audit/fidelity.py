"""Estimator fidelity: how well a top-K view of mu reproduces the full-vocabulary answers.

For each K (capped at V) the top-K view is the first K entries of the engine's top
``max(K)`` (taken from its full logits, so every K sees the same, consistent mu), and
for every top-K estimator we count the tokens where ``sign(Ddot_topK)`` equals
``sign(Ddot_full)`` of the same family. We also add up the top-K and full divergences,
so the share of the full KL (and TV) that the top-K form captures is
``sum topk_kl / sum full_kl`` over the token set (both are >= 0; top-K is a lower bound).
Everything here is computed in float64.
"""

from __future__ import annotations

import torch

from pdmask.keys import ESTIMATORS, ddot_key
from pdmask.ops import Sampling
from pdmask.rollout import Rollout
from pdmask.stats import token_stats
from ..significance import DEFAULT_N_BOOT, pooled_ratio


def effective_ks(ks, vocab_size: int) -> list[int]:
    """The sweep's K values capped at V (duplicates after capping removed)."""
    return sorted({min(int(k), vocab_size) for k in ks})


@torch.no_grad()
def fidelity_counts(
    logits: torch.Tensor,  # (B, T, V) trainer logits (detached)
    sampled_ids: torch.Tensor,  # (B, T)
    rollout_logits: torch.Tensor,  # (B, T, V) engine logits
    response_mask: torch.Tensor,  # (B, T)
    token_sets: dict[str, torch.Tensor],  # name -> (B, T) bool
    *,
    family: str,
    ks,
    sampling: Sampling | None = None,
) -> dict:
    """Per-seed fidelity counts: ``{set: {"K": {k: {est: [agree, n]}}, "sums": {...},
    "agg_vs_uniform": {k: [agree, n]}}}`` (Python numbers). ``sampling``: the loss spec's
    (its temperature; None: temperature 1)."""
    V = logits.shape[-1]
    ks = effective_ks(ks, V)
    # float64 throughout: away from O most tokens have pi ~ mu, where Ddot is ~1e-6 and
    # a float32 reduction would decide its sign by rounding (costs a float64 copy of
    # both (B, T, V) tensors; this is an analysis path)
    logits, rollout_logits = logits.detach().double(), rollout_logits.double()
    T = 1.0 if sampling is None else sampling.temperature
    logm = torch.log_softmax(rollout_logits / T, -1)  # (B, T, V)
    tk_lp, tk_ids = logm.topk(max(ks), dim=-1)  # (B, T, Kmax), descending
    rlp = logm.gather(-1, sampled_ids[..., None].long()).squeeze(-1)
    base = Rollout(sampled_ids, rlp, response_mask=response_mask)
    full = token_stats(logits.detach(), base.replace(logits=rollout_logits), sampling=sampling)
    full_dir = torch.sign(full[ddot_key(f"full_{family}")])
    out = {name: {"K": {}, "sums": {}, "agg_vs_uniform": {}} for name in token_sets}
    for k in ks:
        st = token_stats(logits.detach(), base.replace(topk_ids=tk_ids[..., :k].contiguous(),
                                                       topk_logprobs=tk_lp[..., :k].contiguous()), sampling=sampling)
        signs = {e: torch.sign(st[ddot_key(f"topk_{family}", e)]) for e in ESTIMATORS}
        for name, S in token_sets.items():
            n = int(S.sum())
            rows = torch.stack([(S & (signs[e] == full_dir)).sum() for e in ESTIMATORS]
                               + [(S & (signs["aggregated"] == signs["uniform"])).sum()]).tolist()
            out[name]["K"][k] = {e: [int(a), n] for e, a in zip(ESTIMATORS, rows)}
            out[name]["agg_vs_uniform"][k] = [int(rows[-1]), n]
            sums = torch.stack([torch.where(S, st["topk_kl"], 0).sum(), torch.where(S, full["full_kl"], 0).sum(),
                                torch.where(S, st["topk_tv"], 0).sum(), torch.where(S, full["full_tv"], 0).sum()]
                               ).double().tolist()
            out[name]["sums"][k] = dict(zip(("topk_kl", "full_kl", "topk_tv", "full_tv"), sums))
    return out


def summarize_fidelity(per_seed: list[dict], *, n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> dict:
    """Across seeds: sign agreement per (set, K, estimator), aggregated = uniform, and the
    KL/TV shares, each a pooled ratio (sum over seeds / sum over seeds) with its
    seed-cluster bootstrap interval (:func:`pdmask_lab.significance.pooled_ratio` dicts)."""
    if not per_seed:
        return {}
    res: dict = {}
    for name in per_seed[0]:
        ks = sorted(per_seed[0][name]["K"])
        entry = {"sign_agreement": {}, "agg_vs_uniform": {}, "kl_share": {}, "tv_share": {}}
        for k in ks:
            entry["sign_agreement"][k] = {}
            for e in ESTIMATORS:
                pairs = [s[name]["K"][k][e] for s in per_seed]
                entry["sign_agreement"][k][e] = _ratio_stat(pairs, n_boot, seed)
            entry["agg_vs_uniform"][k] = _ratio_stat([s[name]["agg_vs_uniform"][k] for s in per_seed], n_boot, seed)
            for div in ("kl", "tv"):
                pairs = [[s[name]["sums"][k][f"topk_{div}"], s[name]["sums"][k][f"full_{div}"]] for s in per_seed]
                entry[f"{div}_share"][k] = _ratio_stat(pairs, n_boot, seed)
        res[name] = entry
    return res


def _ratio_stat(pairs, n_boot, seed) -> dict:
    num = [float(a) for a, _ in pairs]
    den = [float(b) for _, b in pairs]
    return pooled_ratio(num, den, n_boot=n_boot, seed=seed).to_dict()
