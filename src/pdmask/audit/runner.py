"""The audit of one rollout batch (:func:`audit_batch`) and of many seeds (:func:`run_audit`).

Per seed, on one batch sampled by the rollout engine:

1. per-token statistics at theta (``D``, ``log r``, every ``Ddot``) and the first-order
   entropy change ``Hdot``;
2. the batch step -> ``dD`` on every token; classification on O and on the
   disagreement sets (:mod:`.rates`);
3. the logit-space isolated step on every token of O;
4. the parameter-space isolated step on a seeded uniform sample of O plus a sample of
   the headline criterion's disagreement tokens;
5. estimator fidelity on the response tokens and on O (:mod:`.fidelity`).

The model's weights are identical before and after (every step is undone), so every
seed audits the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .config import AuditConfig
from .criteria import CRITERIA, RATIO, criterion_values, entropy_ddot, out_of_region, outward, predictive_name
from .fidelity import fidelity_counts, summarize_fidelity
from .rates import _stat, classify, classify_seed, disagreement_set, summarize
from .steps import Forward, batch_step, isolated_param_changes, logit_step_changes, rollout_stats


@dataclass
class SeedResult:
    """Everything measured on one seed. ``counts`` are Python ints; ``tokens`` holds
    per-token float64/int64 arrays of the out-of-region tokens (for plots and the raw dump)."""

    seed: int
    info: dict
    counts: dict  # step kind -> set -> criterion -> counts
    entropy: dict  # criterion -> {"kept": [sum, n, n_pos], "masked": [...]}
    fidelity: dict
    tokens: dict = field(default_factory=dict)


def _broadcast(advantages: torch.Tensor, shape) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages: must be a floating-point torch.Tensor")
    if advantages.shape == shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages[:, None].expand(shape)
    raise ValueError(f"advantages: expected shape {tuple(shape)} or ({shape[0]},), got {tuple(advantages.shape)}")


def _sample(mask_flat: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n indices of the True entries of a flat bool mask, uniformly without replacement."""
    idx = mask_flat.nonzero().squeeze(1)
    if idx.numel() <= n:
        return idx
    return idx[torch.randperm(idx.numel(), generator=gen)[:n]].sort().values


def audit_batch(model: torch.nn.Module, forward: Forward, rb, advantages: torch.Tensor, cfg: AuditConfig,
                *, seed: int = 0, info: dict | None = None, optimizer_state: dict | None = None) -> SeedResult:
    """Audit one rollout batch (``rb``: a :class:`pdmask.engine.base.RolloutBatch` with ``logits``).

    ``advantages``: (B,) or (B, T), as the trainer computes them. ``optimizer_state``:
    start the batch step's optimizer from this state (see :func:`.steps.batch_step`).
    """
    if rb.logits is None:
        raise ValueError("rb: the rollout batch has no engine logits; generate with return_logits=True "
                         "(the audit needs mu's full logits for the oracle and the fidelity sweep)")
    valid = rb.response_mask.bool()  # (B, T)
    A = _broadcast(advantages, valid.shape).float()
    A = torch.where(valid, A, torch.zeros_like(A))  # (B, T)
    T, div = cfg.temperature, cfg.divergence

    # 1. statistics at theta, the batch step, dD on every token
    logits0, out, logits1 = batch_step(model, forward, rb, A, cfg, optimizer_state=optimizer_state)
    # Every criterion and divergence of the audit in float64 (the step itself ran in the
    # model's dtype): tokens with pi ~ mu have |Ddot| ~ 1e-9, whose sign a float32
    # reduction would leave to rounding.
    st = rollout_stats(logits0.double(), rb, temperature=T)
    D0 = st[div]  # (B, T)
    dD = rollout_stats(logits1.double(), rb, temperature=T)[div] - D0  # (B, T)
    del logits1
    region = out_of_region(D0, A, valid, delta_low=cfg.delta_low, delta_high=cfg.delta_high)  # (B, T) O
    values = criterion_values(st, cfg.family)  # criterion -> (B, T)
    counts = {"batch": classify_seed(dD, A, values, region, tie_tol=cfg.tie_tol)}

    # 2. entropy side-effect of each criterion's mask (first order, per unit logit step)
    hdot = entropy_ddot(logits0.double(), rb.response_ids, temperature=T)  # (B, T)
    active = valid & (A != 0)
    ent = _entropy_counts(A, hdot, values, region, active)

    # 3. logit-space isolated step on every token of O (n tokens)
    bt = region.nonzero()  # (n, 2)
    sel = (bt[:, 0], bt[:, 1])
    vals_o = {c: v[sel] for c, v in values.items()}  # criterion -> (n,)
    A_o = A[sel].double()  # (n,)
    dD_logit = logit_step_changes(
        logits0[sel], rb.response_ids[sel], rb.sampled_logprob[sel], rb.topk_ids[sel], rb.topk_logprobs[sel],
        rb.logits[sel], A_o, divergence=div, step=cfg.logit_step, temperature=T)  # (n,)
    counts["logit"] = classify_seed(dD_logit, A_o, vals_o, torch.ones_like(A_o, dtype=torch.bool), tie_tol=0.0)

    # 4. parameter-space isolated steps: uniform sample of O + sample of disagreement tokens
    iso_counts, iso_tokens, uni, dis = _isolated_steps(model, forward, rb, A, bt, vals_o, A_o, cfg, seed)
    counts.update(iso_counts)

    # 5. estimator fidelity on the response tokens and on O
    fid = fidelity_counts(logits0, rb.response_ids, rb.logits, valid, {"response": active, "out_of_region": region},
                          family=cfg.family, ks=cfg.fidelity_ks, temperature=T)

    n = bt.shape[0]
    tokens = {"b": bt[:, 0], "t": bt[:, 1], "A": A_o.double(), "D": D0[sel].double(),
              "dD_batch": dD[sel].double(), "dD_logit": dD_logit.double(), **iso_tokens,
              "isolated_uniform": torch.zeros(n, dtype=torch.bool).index_fill_(0, uni, True),
              "isolated_disagreement": torch.zeros(n, dtype=torch.bool).index_fill_(0, dis, True),
              "hdot": hdot[sel].double(), **{f"c:{c}": v.double() for c, v in vals_o.items()}}
    base = _seed_info(counts, values, out.metrics, valid, active, region, D0, dD, uni, dis)
    return SeedResult(int(seed), {**base, **(info or {})}, counts, ent, fid, tokens)


def _entropy_counts(A: torch.Tensor, hdot: torch.Tensor, values: dict, region: torch.Tensor,
                    active: torch.Tensor) -> dict:
    """Per criterion, ``[sum A Hdot, n, n with A Hdot > 0]`` over the tokens it keeps and
    over those it masks (all (B, T)); ``none`` keeps every active token."""
    ah = A.double() * hdot.double()  # (B, T)
    ent = {}
    for c in CRITERIA:
        masked = region & outward(values[c], A)
        kept = active & ~masked
        ent[c] = {name: [float(torch.where(S, ah, 0).sum()), int(S.sum()), int((S & (ah > 0)).sum())]
                  for name, S in (("kept", kept), ("masked", masked))}
    ent["none"] = {"kept": [float(torch.where(active, ah, 0).sum()), int(active.sum()), int((active & (ah > 0)).sum())],
                   "masked": [0.0, 0, 0]}
    return ent


def _isolated_steps(model, forward: Forward, rb, A: torch.Tensor, bt: torch.Tensor, vals_o: dict,
                    A_o: torch.Tensor, cfg: AuditConfig, seed: int):
    """The parameter-space isolated steps on a seeded sample of O's ``n`` tokens (``bt``
    (n, 2), their criterion values ``vals_o`` and advantages ``A_o``): a uniform sample
    and a sample of the headline criterion's disagreement set, each token stepped once.

    Returns ``(counts, tokens, uni, dis)``: a count table per kind of step and one for its
    disagreement sample, the per-token ``dD`` of each kind ((n,), NaN where not sampled),
    and the indices into O of the two samples."""
    primary = predictive_name(cfg.estimator)
    ones = torch.ones_like(A_o, dtype=torch.bool)  # (n,)
    gen = torch.Generator().manual_seed(int(seed))
    dis_o = disagreement_set(vals_o, A_o, ones, primary)
    uni = _sample(ones, cfg.isolated_tokens, gen)
    dis = _sample(dis_o, cfg.isolated_disagreement, gen)
    chosen = torch.unique(torch.cat([uni, dis]))  # each sampled token stepped once
    pos = {int(i): j for j, i in enumerate(chosen.tolist())}
    in_uni = torch.tensor([pos[int(i)] for i in uni.tolist()], dtype=torch.long)
    in_dis = torch.tensor([pos[int(i)] for i in dis.tolist()], dtype=torch.long)
    A_c = A_o[chosen]
    v_c = {c: v[chosen] for c, v in vals_o.items()}
    counts, tokens = {}, {}
    for which in cfg.isolated_params:
        kind = isolated_kind(which)
        dD_iso_c = isolated_param_changes(model, forward, rb, A, bt[chosen], cfg, params=which)
        counts[kind] = classify_seed(
            dD_iso_c[in_uni], A_c[in_uni], {c: v[in_uni] for c, v in v_c.items()},
            torch.ones(in_uni.numel(), dtype=torch.bool), tie_tol=cfg.tie_tol)
        counts[f"{kind}_disagreement"] = {f"disagreement:{primary}": classify(
            dD_iso_c[in_dis], A_c[in_dis], {RATIO: v_c[RATIO][in_dis], primary: v_c[primary][in_dis]},
            torch.ones(in_dis.numel(), dtype=torch.bool), tie_tol=cfg.tie_tol)}
        full = torch.full((bt.shape[0],), float("nan"), dtype=torch.float64)
        full[chosen] = dD_iso_c  # NaN = not sampled for the isolated step (documented in the dump)
        tokens[f"dD_{kind}"] = full
    return counts, tokens, uni, dis


def _seed_info(counts: dict, values: dict, metrics: dict, valid, active, region, D0, dD, uni, dis) -> dict:
    """The seed's sizes (tokens, O, disagreement sets, samples) and headline numbers."""
    n_dis = {p: counts["batch"][f"disagreement:{p}"][RATIO]["n"] for p in values if p != RATIO}
    return {"n_response_tokens": int(valid.sum()), "n_active_tokens": int(active.sum()),
            "n_out_of_region": int(region.sum()), "n_disagreement": n_dis,
            "n_isolated_uniform": int(uni.numel()), "n_isolated_disagreement": int(dis.numel()),
            "n_sequences": int(valid.shape[0]), "loss": float(metrics["loss"]),
            "divergence_mean": float(torch.where(valid, D0, 0).sum() / valid.sum().clamp(min=1)),
            "divergence_max": float(torch.where(valid, D0, 0).max()) if valid.any() else 0.0,
            "dD_batch_abs_mean_O": float(dD[region].abs().mean()) if region.any() else 0.0,
            "step_kept_frac": float(metrics["kept_frac"])}


def isolated_kind(which: str) -> str:
    """Name of the count table of an isolated step: ``isolated`` (all parameters), ``isolated_head``."""
    return "isolated" if which == "all" else f"isolated_{which}"


SampleFn = Callable[[int], tuple]  # seed -> (rollout batch, advantages (B,) or (B, T), info dict)


def run_audit(model: torch.nn.Module, forward: Forward, sample: SampleFn, seeds: Iterable[int],
              cfg: AuditConfig, *, progress: bool = True, on_seed: Callable[[SeedResult], None] | None = None,
              optimizer_state: dict | None = None, console=None) -> list[SeedResult]:
    """Audit every seed (``sample(seed)`` draws the rollout batch), with a rich progress bar."""
    seeds = list(seeds)
    results: list[SeedResult] = []
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.progress import TimeRemainingColumn
        cols = (TextColumn("[bold]audit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
        with Progress(*cols, transient=False, console=console) as bar:
            task = bar.add_task("audit", total=len(seeds), note="")
            for s in seeds:
                r = _one(model, forward, sample, s, cfg, optimizer_state)
                results.append(r)
                if on_seed:
                    on_seed(r)
                bar.update(task, advance=1, note=f"seed {s}: |O|={r.info['n_out_of_region']} "
                                                 f"dis={r.info['n_disagreement'].get(predictive_name(cfg.estimator))}")
    else:
        for s in seeds:
            r = _one(model, forward, sample, s, cfg, optimizer_state)
            results.append(r)
            if on_seed:
                on_seed(r)
    return results


def _one(model, forward, sample, s, cfg, optimizer_state):
    rb, adv, info = sample(s)
    return audit_batch(model, forward, rb, adv, cfg, seed=s, info=info, optimizer_state=optimizer_state)


def summarize_entropy(results: list[SeedResult], *, n_boot: int, seed: int) -> dict:
    """Per criterion: mean ``A * Hdot`` per token over kept / masked tokens (per-seed means,
    averaged, with bootstrap interval), the share of them with ``A Hdot > 0`` (pooled), and
    the first-order entropy drift of the kept set per active token (``sum_kept A Hdot / n_active``)."""
    out = {}
    for c in results[0].entropy:
        e = {}
        for part in ("kept", "masked"):
            rows = [r.entropy[c][part] for r in results]
            e[part] = _stat([s / n for s, n, _ in rows if n > 0], n_boot, seed)
            tot_n = sum(n for _, n, _ in rows)
            e[part]["pooled"] = sum(s for s, _, _ in rows) / tot_n if tot_n else None
            e[part]["share_increasing"] = sum(p for _, _, p in rows) / tot_n if tot_n else None
            e[part]["n_tokens"] = tot_n
        drift = [r.entropy[c]["kept"][0] / r.info["n_active_tokens"] for r in results if r.info["n_active_tokens"]]
        e["drift_per_token"] = _stat(drift, n_boot, seed)
        out[c] = e
    return out


def summarize_all(results: list[SeedResult], cfg: AuditConfig) -> dict:
    """Across-seed summary of every count table, the entropy side-effect and the fidelity sweep."""
    if not results:
        raise ValueError("results: no seeds to summarize")
    nb, bs = cfg.bootstrap, cfg.bootstrap_seed
    summary = {}
    for kind in results[0].counts:
        summary[kind] = {sname: summarize([r.counts[kind][sname] for r in results], n_boot=nb, seed=bs)
                         for sname in results[0].counts[kind]}
    return {"rates": summary, "entropy": summarize_entropy(results, n_boot=nb, seed=bs),
            "fidelity": summarize_fidelity([r.fidelity for r in results], n_boot=nb, seed=bs),
            "per_seed": [{"seed": r.seed, **r.info} for r in results]}
