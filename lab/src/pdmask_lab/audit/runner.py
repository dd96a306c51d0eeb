"""The audit of one rollout batch (:func:`audit_batch`) and of many seeds (:func:`run_audit`).

Per seed, on one batch sampled by the rollout engine:

1. per-token statistics at theta (``D``, ``log r``, every ``Ddot``) and the first-order
   entropy change ``Hdot``;
2. the batch step -> ``dD`` on every token; the out-of-region set O and the
   disagreement sets;
3. the logit-space step on every token of O;
4. the per-token instruments (:data:`.config.INSTRUMENTS`) on a seeded uniform sample of
   O plus the headline criterion's disagreement tokens: the step-free inner products
   (:mod:`.instruments`), the own effect inside the batch (:mod:`.loo`), the isolated
   parameter steps (:mod:`.steps`);
5. estimator fidelity on the response tokens and on O (:mod:`.fidelity`).

Everything per token lands in the seed's records (one row per token of O); every rate
table is computed from the records (:mod:`.tables`). The model's weights are identical
before and after (every step is undone or made on a copy), so every seed audits the
same checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from .config import AuditConfig
from pdmask.masks import delta_by_sign, divergence_region, outward
from .criteria import CRITERIA, RATIO, criterion_values, entropy_ddot, predictive_name
from .fidelity import fidelity_counts, summarize_fidelity
from .steps import Forward, batch_step, copy_in, isolated_param_changes, logit_step_changes, rollout_stats

F64 = torch.float64


@dataclass
class SeedResult:
    """Everything measured on one seed. ``tokens``: the per-token records of O (numpy
    arrays, the schema of docs/audit.md); ``entropy`` / ``fidelity``: per-seed sums."""

    seed: int
    info: dict
    tokens: dict
    entropy: dict  # criterion -> {"kept": [sum, n, n_pos], "masked": [...]}
    fidelity: dict

    @property
    def counts(self) -> dict:
        """This seed's counts ``{kind: {set: {criterion: {count: int}}}}`` (from the records)."""
        from .tables import KINDS, counts, token_sets

        headline = predictive_name(self.info.get("headline_estimator", "exact"))
        rec, seeds, out = self.tokens, np.array([self.seed]), {}
        for kind, (col, _, _) in KINDS.items():
            if col not in rec:
                continue
            out[kind] = {}
            for sname, S in token_sets(rec, kind, headline).items():
                crit = [c for c in CRITERIA if f"c_{c}" in rec] if sname == "out_of_region" \
                    else [RATIO, sname.split(":", 1)[1]]
                cnt = counts(rec, rec[col], S, crit, seeds, self.info.get("tie_tol", 0.0))
                out[kind][sname] = {c: {k: int(v[0]) for k, v in d.items()} for c, d in cnt.items()}
        return out


def _broadcast(advantages: torch.Tensor, shape) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages: must be a floating-point torch.Tensor")
    if advantages.shape == shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages[:, None].expand(shape)
    raise ValueError(f"advantages: expected shape {tuple(shape)} or ({shape[0]},), got {tuple(advantages.shape)}")


def _sample(mask_flat: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n indices of the True entries of a flat bool mask, uniformly without
    replacement (n < 0: all of them)."""
    idx = mask_flat.nonzero().squeeze(1)
    if n < 0 or idx.numel() <= n:
        return idx
    return idx[torch.randperm(idx.numel(), generator=gen)[:n]].sort().values


class Probe:
    """What the per-token instruments share across seeds: the float64 copy of the policy
    and the optimizer's preconditioner (both depend only on the checkpoint)."""

    def __init__(self, model: torch.nn.Module, cfg: AuditConfig, optimizer_state: dict | None):
        from .instruments import optimizer_preconditioner
        from .steps import trainable

        self.model64 = copy_in(model, F64)
        self.model64.eval()
        self.has_state = optimizer_state is not None
        self.P = None
        if "precond" in cfg.instruments and self.has_state:
            self.P = optimizer_preconditioner(trainable(self.model64), cfg, optimizer_state)


def audit_batch(model: torch.nn.Module, forward: Forward, rb, advantages: torch.Tensor, cfg: AuditConfig,
                *, seed: int = 0, info: dict | None = None, optimizer_state: dict | None = None,
                probe: Probe | None = None) -> SeedResult:
    """Audit one rollout batch (``rb``: a :class:`pdmask.engine.base.RolloutBatch` with ``logits``).

    ``advantages``: (B,) or (B, T), as the trainer computes them. ``optimizer_state``:
    start the batch steps' optimizer from this state (see :func:`.steps.batch_step`) and
    precondition with it. ``probe``: a :class:`Probe` shared across seeds (made here if None).
    """
    if rb.rollout.logits is None:
        raise ValueError("rb: the rollout batch has no engine logits; generate with return_logits=True "
                         "(the audit needs mu's full logits for the oracle and the fidelity sweep)")
    valid = rb.response_mask.bool()  # (B, T)
    A = _broadcast(advantages, valid.shape).float()
    A = torch.where(valid, A, torch.zeros_like(A))  # (B, T)
    T, div, th = cfg.temperature, cfg.divergence, cfg.loss.thresholds
    clock: dict[str, float] = {}
    t0 = time.perf_counter()

    # 1. statistics at theta, the batch step, dD on every token
    logits0, out, logits1 = batch_step(model, forward, rb, A, cfg, optimizer_state=optimizer_state)
    # Every criterion and divergence of the audit in float64 (the step itself ran in the
    # model's dtype): tokens with pi ~ mu have |Ddot| ~ 1e-9, whose sign a float32
    # reduction would leave to rounding.
    st = rollout_stats(logits0.double(), rb, sampling=cfg.loss.sampling)
    D0 = st[div]  # (B, T)
    dD = rollout_stats(logits1.double(), rb, sampling=cfg.loss.sampling)[div] - D0  # (B, T)
    del logits1
    region = divergence_region(div)(st, A, th) & valid  # (B, T) O: the masks' region of the loss's thresholds
    values = criterion_values(st, cfg.family)  # criterion -> (B, T)
    clock["batch"] = time.perf_counter() - t0

    # 2. entropy side-effect of each criterion's mask (first order, per unit logit step)
    hdot = entropy_ddot(logits0.double(), rb.response_ids, temperature=T)  # (B, T)
    active = valid & (A != 0)
    ent = _entropy_counts(A, hdot, values, region, active)

    # 3. logit-space step on every token of O (n tokens)
    t1 = time.perf_counter()
    bt = region.nonzero()  # (n, 2)
    sel = (bt[:, 0], bt[:, 1])
    vals_o = {c: v[sel] for c, v in values.items()}  # criterion -> (n,)
    A_o = A[sel].double()  # (n,)
    dD_logit = logit_step_changes(logits0[sel], rb.rollout[sel], A_o, divergence=div, step=cfg.logit_step,
                                  temperature=T)  # (n,)
    clock["logit"] = time.perf_counter() - t1

    # 4. per-token instruments on a uniform sample of O + the headline disagreement tokens
    n = bt.shape[0]
    headline = predictive_name(cfg.estimator)
    gen = torch.Generator().manual_seed(int(seed))
    dis_o = outward(vals_o[RATIO], A_o) != outward(vals_o[headline], A_o)  # (n,)
    uni = _sample(torch.ones(n, dtype=torch.bool), cfg.sample_tokens, gen)
    dis = _sample(dis_o, cfg.disagreement_tokens, gen)
    chosen = torch.unique(torch.cat([uni, dis]))  # indices into O, each measured once
    inst = _instruments(model, forward, rb, A, bt[chosen], cfg, optimizer_state, probe, clock)

    # 5. estimator fidelity on the response tokens and on O
    t4 = time.perf_counter()
    fid = fidelity_counts(logits0, rb.response_ids, rb.rollout.logits, valid, {"response": active, "out_of_region": region},
                          family=cfg.family, ks=cfg.fidelity_ks, sampling=cfg.loss.sampling)
    clock["fidelity"] = time.perf_counter() - t4

    def flag(ix):
        return torch.zeros(n, dtype=torch.bool).index_fill_(0, ix, True).numpy()

    def spread(x):  # (len(chosen),) -> (n,) with NaN where not measured
        full = torch.full((n,), float("nan"), dtype=F64)
        full[chosen] = x.to(F64)
        return full.numpy()

    delta = delta_by_sign(A_o, th.delta_low, th.delta_high)  # (n,) float64: the masks' rule
    tokens = {"seed": np.full(n, int(seed), dtype=np.int64), "b": bt[:, 0].numpy(), "t": bt[:, 1].numpy(),
              "A": A_o.numpy(), "D": D0[sel].double().numpy(), "delta": delta.numpy(),
              **{f"c_{c}": v.double().numpy() for c, v in vals_o.items()}, "hdot": hdot[sel].double().numpy(),
              "in_sample": flag(uni), "in_disagreement": dis_o.numpy(), "measured": flag(chosen),
              "dD_batch": dD[sel].double().numpy(), "dD_logit": dD_logit.double().numpy(),
              **{k: spread(v) for k, v in inst.items()}}
    base = _seed_info(values, A, out.metrics, valid, active, region, D0, dD, uni, dis, chosen)
    base.update(headline_estimator=cfg.estimator, tie_tol=cfg.tie_tol,
                time_s={k: round(v, 3) for k, v in clock.items()},
                time_total_s=round(time.perf_counter() - t0, 3))
    return SeedResult(int(seed), {**base, **(info or {})}, tokens, ent, fid)


def _instruments(model, forward, rb, A, bt_c: torch.Tensor, cfg: AuditConfig, optimizer_state, probe, clock) -> dict:
    """The per-token instruments on the chosen tokens ``bt_c`` (m, 2): {column: (m,)}."""
    from .instruments import inner_products
    from .loo import BatchStep

    out: dict = {}
    if bt_c.shape[0] == 0 or not cfg.instruments:
        return out
    A64 = A.to(F64)
    if "param" in cfg.instruments or "precond" in cfg.instruments:
        t = time.perf_counter()
        probe = probe or Probe(model, cfg, optimizer_state)
        P = probe.P if "precond" in cfg.instruments else None
        ip = inner_products(probe.model64, forward, rb, A64, bt_c, cfg, P=P)
        out.update({k: v for k, v in ip.items() if k.startswith("pip") or "param" in cfg.instruments})
        clock["param"] = time.perf_counter() - t
    if "own" in cfg.instruments:
        t = time.perf_counter()
        bs = BatchStep(model, forward, rb, A64, cfg, optimizer_state=optimizer_state)
        out["own"] = bs.own_effect(bt_c)
        out["dD_batch64"] = (bs.after_full - bs.D0[bt_c[:, 0], bt_c[:, 1]]).detach()
        clock["own"] = time.perf_counter() - t
    for which, col in (("isolated", "dD_isolated"), ("isolated-head", "dD_isolated_head")):
        if which in cfg.instruments:
            t = time.perf_counter()
            out[col] = isolated_param_changes(model, forward, rb, A, bt_c, cfg,
                                              params="all" if which == "isolated" else "head")
            clock[which] = time.perf_counter() - t
    return out


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


def _seed_info(values: dict, A, metrics: dict, valid, active, region, D0, dD, uni, dis, chosen) -> dict:
    """The seed's sizes (tokens, O, disagreement sets, samples) and headline numbers."""
    n_dis = {p: int((region & (outward(values[RATIO], A) != outward(values[p], A))).sum())
             for p in values if p != RATIO}
    return {"n_response_tokens": int(valid.sum()), "n_active_tokens": int(active.sum()),
            "n_out_of_region": int(region.sum()), "n_disagreement": n_dis,
            "n_sample": int(uni.numel()), "n_disagreement_measured": int(dis.numel()), "n_measured": int(chosen.numel()),
            "n_sequences": int(valid.shape[0]), "loss": float(metrics["loss"]),
            "divergence_mean": float(torch.where(valid, D0, 0).sum() / valid.sum().clamp(min=1)),
            "divergence_max": float(torch.where(valid, D0, 0).max()) if valid.any() else 0.0,
            "dD_batch_abs_mean_O": float(dD[region].abs().mean()) if region.any() else 0.0,
            "step_kept_frac": float(metrics["kept_frac"])}


SampleFn = Callable[[int], tuple]  # seed -> (rollout batch, advantages (B,) or (B, T), info dict)


def run_audit(model: torch.nn.Module, forward: Forward, sample: SampleFn, seeds: Iterable[int],
              cfg: AuditConfig, *, progress: bool = True, on_seed: Callable[[SeedResult], None] | None = None,
              optimizer_state: dict | None = None, console=None) -> list[SeedResult]:
    """Audit every seed (``sample(seed)`` draws the rollout batch), with a rich progress bar."""
    seeds = list(seeds)
    results: list[SeedResult] = []
    probe = Probe(model, cfg, optimizer_state) if {"param", "precond"} & set(cfg.instruments) else None
    headline = predictive_name(cfg.estimator)

    def one(s):
        t0 = time.perf_counter()
        rb, adv, info = sample(s)
        info = {**info, "time_rollout_s": round(time.perf_counter() - t0, 3)}
        r = audit_batch(model, forward, rb, adv, cfg, seed=s, info=info, optimizer_state=optimizer_state, probe=probe)
        results.append(r)
        if on_seed:
            on_seed(r)
        return r

    if not progress:
        for s in seeds:
            one(s)
        return results
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.progress import TimeRemainingColumn
    cols = (TextColumn("[bold]audit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*cols, transient=False, console=console) as bar:
        task = bar.add_task("audit", total=len(seeds), note="")
        for s in seeds:
            r = one(s)
            bar.update(task, advance=1, note=f"seed {s}: |O|={r.info['n_out_of_region']} "
                                             f"dis={r.info['n_disagreement'].get(headline)}")
    return results


def concat_tokens(results: list[SeedResult]) -> dict[str, np.ndarray]:
    """The records of all seeds, one array per column (columns missing in a seed: NaN)."""
    if not results:
        return {}
    keys = list(dict.fromkeys(k for r in results for k in r.tokens))
    out = {}
    for k in keys:
        parts = []
        for r in results:
            n = r.tokens["A"].shape[0]
            parts.append(r.tokens[k] if k in r.tokens else np.full(n, np.nan))
        out[k] = np.concatenate(parts)
    return out


def summarize_entropy(results: list[SeedResult], *, n_boot: int, seed: int) -> dict:
    """Per criterion, pooled over seeds with the cluster bootstrap: mean ``A * Hdot`` per
    token over the kept / masked tokens, the share of them with ``A Hdot > 0``, and the
    first-order entropy drift of the kept set per active token (``sum_kept A Hdot / n_active``)."""
    from ..significance import pooled_ratio

    out = {}
    n_active = [r.info["n_active_tokens"] for r in results]
    for c in results[0].entropy:
        e = {}
        for part in ("kept", "masked"):
            rows = [r.entropy[c][part] for r in results]
            e[part] = pooled_ratio([s for s, _, _ in rows], [n for _, n, _ in rows], n_boot=n_boot, seed=seed).to_dict()
            e[part]["share_increasing"] = pooled_ratio([p for _, _, p in rows], [n for _, n, _ in rows],
                                                       n_boot=n_boot, seed=seed).to_dict()
        e["drift_per_token"] = pooled_ratio([r.entropy[c]["kept"][0] for r in results], n_active,
                                            n_boot=n_boot, seed=seed).to_dict()
        out[c] = e
    return out


def summarize_all(results: list[SeedResult], cfg: AuditConfig) -> dict:
    """Every table of the report: the rate tables from the per-token records
    (:func:`.tables.tables`), the entropy side-effect, the fidelity sweep, per-seed info."""
    from .tables import tables

    if not results:
        raise ValueError("results: no seeds to summarize")
    nb, bs = cfg.bootstrap, cfg.bootstrap_seed
    rec = concat_tokens(results)
    t = tables(rec, [r.seed for r in results], headline=predictive_name(cfg.estimator), tie_tol=cfg.tie_tol,
               n_boot=nb, boot_seed=bs)
    if cfg.delta_sweep:
        from .tables import delta_sweep
        t["delta_sweep"] = delta_sweep(rec, [r.seed for r in results], cfg.delta_sweep,
                                       headline=predictive_name(cfg.estimator), tie_tol=cfg.tie_tol,
                                       n_boot=min(nb, 2000), boot_seed=bs)
    return {**t, "entropy": summarize_entropy(results, n_boot=nb, seed=bs),
            "fidelity": summarize_fidelity([r.fidelity for r in results], n_boot=min(nb, 2000), seed=bs),
            "per_seed": [{"seed": r.seed, **r.info} for r in results]}
