"""Judging the batch-aware mask by the audit: what one masked batch step
does to the out-of-region divergence ``Phi = sum_{s in O} D_s`` (O fixed at theta).

Per seed, on the audit's rollout batch (:func:`pdmask_lab.audit.source.build_source`, so the
same batches as every other audit of the checkpoint) and from a warm optimizer state (a
run directory's AdamW, or the state after ``--lag`` steps):

1. **Scores.** For every token: ``ratio`` ``A log r``; ``pdm-exact`` ``A Ddot`` (the
   per-token predictive direction, exact top-K estimator); ``pdm-batch`` ``c_t`` of
   :class:`pdmask_lab.batchmask.BatchMask` (``params="all"``, and ``pdm-batch-lastN`` for
   each ``N`` asked for); ``random`` (a seeded random ranking, the reference). A score
   > 0 means "outward".
2. **Matched masked fraction.** For ``m = max(1, round(f |O|))`` and each ``f``, every
   criterion masks its ``m`` highest-scoring tokens of O (:func:`top_m`); the step is
   taken without them and ``dPhi = Phi(theta'_{-E}) - Phi(theta)`` is recorded. Each
   criterion's own mask (every token of O it calls outward) is measured too, at its own
   size. A lower ``dPhi`` is a mask that keeps the drifted tokens from drifting further.
3. **Leave-one-out.** For a uniform sample of O (and of the active tokens outside O):
   ``LOO_t = Phi(theta') - Phi(theta'_{-t})``, the part of the step's change of Phi that
   masking t alone removes. A criterion's sign accuracy is the share of tokens with
   ``score_t * LOO_t > 0`` (tokens with ``LOO_t = 0`` exactly are ties, left out and
   counted). To first order ``LOO_t = a_t c_t`` (``a_t`` the aggregation weight of t).

The step is the trainer's: the surrogate ``-min(r, C) A log pi`` of mode ``none`` on every
unmasked token, aggregated by ``loss_agg`` with masked tokens still in the denominators
(as :func:`pdmask.policy_loss` masks), gradient clipping, AdamW from the warm state with
the trainer's lr / betas / weight decay. Everything runs in float64 on a copy of the
policy whose RMSNorms compute in float64 too (:func:`copy64`): one token's share of a
step over thousands moves Phi far below float32 rounding.

Leave-one-out machinery (:class:`PhiStep`): the loss is linear in the per-token terms,
``L = sum_s a_s l_s``, so the gradient without a set E is exactly ``G - g_E`` with
``g_E = grad sum_{s in E} a_s l_s``: G is computed once, and each E costs a backward of
E's rows, one optimizer step (replayed from the warm state) and a forward of O's rows.
Naive equivalent (what the tests compare with): two full steps, the second with
``A_s = 0`` for s in E.

Run it (resumable: one JSON per finished seed under ``OUT/seeds/``)::

    python -m pdmask_lab.audit.phi --model runs/phi-src/dppo-topk-kl-s0 --seeds 8 --out runs/audit-phi
"""

from __future__ import annotations

import copy
import json
import time
import types
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from pdmask._validate import check_choice
from pdmask.engine.hf import response_logits
from pdmask.loss import aggregate
from pdmask.masks import Thresholds, divergence_region
from pdmask.stats import token_stats
from pdmask.train.portable import portable_command, portable_config, portable_path
from pdmask.train.update import build_optimizer
from ..batchmask import BatchMask
from ..significance import DEFAULT_N_BOOT
from .config import audit_loss, default_delta
from .phi_report import markdown, summarize

F64 = torch.float64
#: the criteria every seed measures (plus ``pdm-batch-lastN`` per ``batch_lasts``)
BASE_CRITERIA = ("random", "ratio", "pdm-exact", "pdm-batch")


@dataclass
class PhiSettings:
    """The evaluation's own settings (the step's are the trainer config's).

    Attributes:
        divergence: ``topk_kl`` or ``topk_tv``: O, Phi and the batch direction's divergence.
        thresholds: O's :class:`pdmask.Thresholds` (``D > delta`` by the sign of A; None: the
            divergence's default delta on both sides, :func:`phi_thresholds`). The Phi step
            (mode ``none``) reads their deltas only.
        fractions: masked fractions of |O| for the matched comparison.
        loo_tokens: tokens of O per seed for the leave-one-out (uniform sample).
        loo_outside: active tokens outside O per seed for the leave-one-out.
        batch_lasts: also score with ``params=N`` for each N (the last-blocks variant).
        bootstrap, bootstrap_seed: seed-cluster bootstrap of the summary.
    """

    divergence: str = "topk_kl"
    thresholds: Thresholds | None = None
    fractions: tuple = (0.1, 0.25, 0.5)
    loo_tokens: int = 48
    loo_outside: int = 16
    batch_lasts: tuple = (1,)
    bootstrap: int = DEFAULT_N_BOOT
    bootstrap_seed: int = 0

    def validate(self) -> "PhiSettings":
        check_choice("divergence", self.divergence, ("topk_kl", "topk_tv"))
        if self.thresholds is not None and not isinstance(self.thresholds, Thresholds):
            raise ValueError(f"thresholds: must be a pdmask.Thresholds (or None), got {type(self.thresholds).__name__}")
        if not self.fractions or not all(0 < f <= 1 for f in self.fractions):
            raise ValueError(f"fractions: each must lie in (0, 1], got {list(self.fractions)}")
        for k in ("loo_tokens", "loo_outside"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k}: must be >= 0, got {getattr(self, k)}")
        if not all(isinstance(n, int) and n >= 1 for n in self.batch_lasts):
            raise ValueError(f"batch_lasts: each must be an int >= 1, got {list(self.batch_lasts)}")
        return self

    @property
    def criteria(self) -> tuple:
        return BASE_CRITERIA + tuple(f"pdm-batch-last{n}" for n in self.batch_lasts)


# ------------------------------------------------------------------ pieces
def _rms_norm_f64(self, hidden_states):
    var = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon))


def copy64(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` that really computes in float64: transformers' RMSNorm
    (Llama, Qwen3, ...) casts to float32 and back, so its forward is replaced on the copy
    by the same formula in the input's dtype. The caller's model is never touched."""
    m = copy.deepcopy(model).to(F64)
    for mod in m.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and hasattr(mod, "weight"):
            mod.forward = types.MethodType(_rms_norm_f64, mod)
    return m.eval()


def top_m(score: torch.Tensor, region: torch.Tensor, m: int) -> torch.Tensor:
    """(B, T) bool: the ``m`` tokens of ``region`` with the highest ``score`` (ties: the
    earlier position in row-major order first; all of the region when ``m >= |region|``)."""
    if score.shape != region.shape:
        raise ValueError(f"score: expected shape {tuple(region.shape)}, got {tuple(score.shape)}")
    if m < 0:
        raise ValueError(f"m: must be >= 0, got {m}")
    idx = region.reshape(-1).nonzero().squeeze(1)
    order = torch.argsort(-score.reshape(-1)[idx].double(), stable=True)
    out = torch.zeros(region.numel(), dtype=torch.bool)
    out[idx[order[:m]]] = True
    return out.reshape(region.shape)


def _rows(rb, rows: torch.Tensor):
    """The rollout batch restricted to ``rows`` (columns untouched, positions stay put)."""
    return rb[rows]


class PhiStep:
    """The trainer's batch step on a float64 copy of ``model``, replayable without any set
    of tokens, and Phi after it (see the module doc).

    Args:
        model: the policy (copied; never modified).
        rb: the rollout batch. advantages: (B,) or (B, T).
        tcfg: the trainer config: its whole loss spec with mode ``none`` (every token
            updates; :attr:`loss`), lr, weight_decay, grad_clip.
        optimizer_state: the AdamW ``state_dict()`` every step starts from (copied per step).
        divergence, thresholds: O and Phi (:func:`phi_loss`).
    """

    def __init__(self, model, rb, advantages, tcfg, optimizer_state: dict | None, *, divergence: str = "topk_kl",
                 thresholds: Thresholds | None = None):
        self.rb, self.tcfg, self.state, self.divergence = rb, tcfg, optimizer_state, divergence
        self.loss = phi_loss(tcfg, divergence, thresholds)
        self.model = copy64(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.theta0 = [p.detach().clone() for p in self.params]
        valid = rb.response_mask.bool()
        A = (advantages if advantages.dim() == 2 else advantages[:, None].expand(valid.shape)).to(F64)
        self.A = torch.where(valid, A, torch.zeros_like(A))  # (B, T)
        self.valid = valid
        logits = self._forward(self.model, torch.arange(valid.shape[0]))  # (B, T, V) float64
        self.stats = self._stats(logits.detach(), rb)
        self.O = divergence_region(divergence)(self.stats, self.A, self.loss.thresholds) & valid & (self.A != 0)  # (B, T)
        self.rows_O = self.O.any(1).nonzero().squeeze(1)
        self.phi0 = float((self.stats[divergence] * self.O).sum())
        x = torch.zeros(valid.shape, dtype=F64, requires_grad=True)
        (self.a,) = torch.autograd.grad(aggregate(x, valid, self.loss.aggregation), x)  # (B, T) aggregation weights
        per = self._token_loss(logits, rb, self.A)
        self.G = self._grad((self.a * per).sum())
        self._phi_full: float | None = None
        self.chunk = 8  # leave-one-out: tokens of a row whose gradients are held at once

    # -------------------------------------------------------------- internals
    def _forward(self, model, rows):
        sub = _rows(self.rb, rows)
        return response_logits(model, sub.sequences, sub.attention_mask, sub.prompt_len)

    def _rollout(self, rb):
        r = rb.rollout
        return r.replace(sampled_logprob=r.sampled_logprob.to(F64), topk_logprobs=r.topk_logprobs.to(F64), logits=None)

    def _stats(self, logits, rb):
        return token_stats(logits, self._rollout(rb), sampling=self.loss.sampling)

    def _token_loss(self, logits, rb, A):
        return self.loss(logits, self._rollout(rb), A).token_loss  # (R, T)

    def _grad(self, scalar, retain: bool = False):
        gs = torch.autograd.grad(scalar, self.params, allow_unused=True, retain_graph=retain)
        return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(self.params, gs)]

    def optimizer(self) -> torch.optim.AdamW:
        """The trainer's AdamW over the copy, holding (a copy of) the warm state (its moments
        cast to float64 by torch)."""
        return build_optimizer(self.params, lr=self.tcfg.lr, weight_decay=self.tcfg.weight_decay, state=self.state)

    # -------------------------------------------------------------- public
    def excluded_grad(self, exclude: torch.Tensor):
        """``g_E = grad sum_{s in E} a_s l_s`` for a (B, T) bool ``exclude`` (None if empty)."""
        if not bool(exclude.any()):
            return None
        rows = exclude.any(1).nonzero().squeeze(1)
        per = self._token_loss(self._forward(self.model, rows), _rows(self.rb, rows), self.A[rows])
        w = torch.where(exclude[rows], self.a[rows], torch.zeros_like(self.a[rows]))
        return self._grad((w * per).sum())

    @torch.no_grad()
    def phi_after(self, g_excluded=None) -> float:
        """Phi (O fixed) after the step from ``G - g_excluded`` (None: the full step); the
        copy's weights are restored afterwards."""
        if g_excluded is None and self._phi_full is not None:
            return self._phi_full
        opt = self.optimizer()
        try:
            for i, (p, p0) in enumerate(zip(self.params, self.theta0)):
                p.copy_(p0)
                p.grad = self.G[i].clone() if g_excluded is None else self.G[i] - g_excluded[i]
            if self.tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.grad_clip)
            opt.step()
            if self.rows_O.numel() == 0:
                phi = 0.0
            else:
                sub = _rows(self.rb, self.rows_O)
                D = self._stats(self._forward(self.model, self.rows_O), sub)[self.divergence]
                phi = float((D * self.O[self.rows_O]).sum())
        finally:
            for p, p0 in zip(self.params, self.theta0):
                p.copy_(p0)
                p.grad = None
        if g_excluded is None:
            self._phi_full = phi
        return phi

    def loo(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n,) float64 ``Phi(theta') - Phi(theta'_{-t})`` for each ``(b, t)`` row of ``tokens`` (n, 2)."""
        out = torch.zeros(tokens.shape[0], dtype=F64)
        if tokens.shape[0] == 0:
            return out
        full = self.phi_after(None)
        for b in tokens[:, 0].unique().tolist():
            idx = (tokens[:, 0] == b).nonzero().squeeze(1).tolist()
            row = torch.tensor([b])
            for s in range(0, len(idx), self.chunk):
                part = idx[s:s + self.chunk]
                per = self._token_loss(self._forward(self.model, row), _rows(self.rb, row), self.A[row])[0]  # (T,)
                grads = [self._grad(self.a[b, int(tokens[i, 1])] * per[int(tokens[i, 1])], retain=j < len(part) - 1)
                         for j, i in enumerate(part)]
                del per
                for i, g in zip(part, grads):
                    out[i] = full - self.phi_after(g)
        return out


def phi_thresholds(tcfg, divergence: str, delta: float | None = None) -> Thresholds:
    """O's thresholds as the audit's loss builder makes them: the trainer's, with ``delta`` on
    both sides (None: the divergence's default, never the trainer's own deltas)."""
    d = default_delta(divergence) if delta is None else delta
    return audit_loss(tcfg.loss_fields, deltas=(d, d), divergence=divergence, validate=False).thresholds


def phi_loss(tcfg, divergence: str, thresholds: Thresholds | None = None):
    """The Phi step's :class:`pdmask.PolicyLoss`: the trainer's whole loss spec with mode
    ``none`` and O's ``thresholds`` (None: :func:`phi_thresholds`; no input checks: the
    rollout is the engine's own). Refused in one line: truncated sampling (the batch mask
    scores the untruncated pi) and a weight normalised over the batch (the replays
    differentiate row slices)."""
    th = phi_thresholds(tcfg, divergence) if thresholds is None else thresholds
    spec = replace(audit_loss(tcfg.loss_fields, step_mode="none", divergence=divergence, validate=False),
                   thresholds=th)
    if spec.sampling.truncated:
        raise ValueError("loss.sampling: truncated sampling is not available in the Phi evaluation: the batch mask "
                         "computes its direction on the untruncated pi")
    if spec.corrections.is_batch_normalize:
        raise ValueError("loss.corrections.is_batch_normalize: the Phi evaluation replays the terms of row slices, "
                         "and a weight normalised over the batch makes a term depend on the other rows")
    return spec


# ------------------------------------------------------------------ one seed
def _sample(mask: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n (b, t) indices of the True entries of a (B, T) mask, uniformly, sorted."""
    idx = mask.reshape(-1).nonzero().squeeze(1)
    if idx.numel() > n:
        idx = idx[torch.randperm(idx.numel(), generator=gen)[:n]].sort().values
    T = mask.shape[1]
    return torch.stack([idx // T, idx % T], 1)


def scores_of(ps: PhiStep, settings: PhiSettings, seed: int) -> dict:
    """Every criterion's (B, T) float64 score on the seed's batch (> 0: outward)."""
    from pdmask.keys import ddot_key

    st, A = ps.stats, ps.A
    gen = torch.Generator().manual_seed(int(seed) * 7 + 3)
    out = {"random": torch.rand(A.shape, generator=gen, dtype=F64), "ratio": A * st["log_ratio"],
           "pdm-exact": A * st[ddot_key(settings.divergence, "exact")]}
    rb = ps.rb
    for name, params in [("pdm-batch", "all")] + [(f"pdm-batch-last{n}", n) for n in settings.batch_lasts]:
        bm = BatchMask(ps.model, params=params, optimizer=ps.optimizer(), divergence=settings.divergence,
                       thresholds=ps.loss.thresholds, scope="region", sampling=ps.loss.sampling,
                       is_cap=ps.loss.corrections.is_cap, all_tokens=True)
        res = bm(rb.sequences, rb.attention_mask, ps._rollout(rb), ps.A)
        if not torch.equal(res.out_of_region, ps.O):  # same statistics, same thresholds: must agree
            raise RuntimeError("pdm-batch: the batch mask's O differs from the evaluation's")
        out[name] = res.c.to(F64)
    return out


def evaluate_seed(model, rb, advantages, tcfg, optimizer_state, settings: PhiSettings, seed: int) -> dict:
    """Everything measured on one seed (JSON-ready; see the module doc)."""
    ps = PhiStep(model, rb, advantages, tcfg, optimizer_state, divergence=settings.divergence,
                 thresholds=settings.thresholds)
    O, nO = ps.O, int(ps.O.sum())
    rec = {"seed": int(seed), "n_tokens": int(ps.valid.sum()), "n_active": int((ps.valid & (ps.A != 0)).sum()),
           "n_out_of_region": nO, "phi0": ps.phi0}
    if nO == 0:
        return rec | {"phi_full": ps.phi0, "sweep": {}, "own_mask": {}, "loo": {}}
    sc = scores_of(ps, settings, seed)
    rec["phi_full"] = ps.phi_after(None)
    sweep = {}
    for f in settings.fractions:
        m = max(1, round(f * nO))
        sweep[f"{f:g}"] = {"m": m, **{c: ps.phi_after(ps.excluded_grad(top_m(sc[c], O, m))) - ps.phi0
                                      for c in settings.criteria}}
    own = {}
    for c in settings.criteria:
        if c == "random":
            continue
        E = O & (sc[c] > 0)
        own[c] = {"m": int(E.sum()), "dphi": ps.phi_after(ps.excluded_grad(E)) - ps.phi0}
    gen = torch.Generator().manual_seed(int(seed) * 7 + 5)
    toks = torch.cat([_sample(O, settings.loo_tokens, gen),
                      _sample(ps.valid & (ps.A != 0) & ~O, settings.loo_outside, gen)])
    loo = ps.loo(toks)
    bt = (toks[:, 0], toks[:, 1])
    rec.update(sweep=sweep, own_mask=own, loo={
        "b": toks[:, 0].tolist(), "t": toks[:, 1].tolist(), "in_O": O[bt].tolist(), "loo": loo.tolist(),
        "pred": (ps.a[bt] * sc["pdm-batch"][bt]).tolist(),
        "scores": {c: sc[c][bt].tolist() for c in settings.criteria if c != "random"}})
    return rec


# ------------------------------------------------------------------ running
def _in_current_terms(old: dict, new: dict) -> dict:
    """A stored ``settings.json`` in the current terms: one written before the settings held
    O's thresholds stored their deltas flat; they go into the current ``thresholds``, whose
    other fields are the trainer's (compared with its config) and are taken as they are."""
    if "thresholds" in old or not isinstance(new.get("thresholds"), dict):
        return old
    old = dict(old)
    flat = {k: old.pop(k) for k in list(new["thresholds"]) if k in old}
    return {**old, "thresholds": {**new["thresholds"], **flat}}


@dataclass
class PhiRun:
    """Where the per-seed results go; a rerun with the same settings skips finished seeds."""

    out: Path
    settings: dict = field(default_factory=dict)

    def open(self, tcfg=None) -> None:
        """Create the folder, or check that the settings it holds are these. The trainer
        config (``tcfg``) is compared as :func:`pdmask.train.config.config_diff` compares a
        stored run: in either version of its loss settings, results-neutral keys left out."""
        from pdmask.train.config import config_diff

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "seeds").mkdir(exist_ok=True)
        p = self.out / "settings.json"
        # compare as JSON reads them back (tuples become lists), else no rerun could ever resume
        self.settings = json.loads(json.dumps(self.settings, default=str))
        if p.exists():
            old = _in_current_terms(json.loads(p.read_text()), self.settings)
            diff = sorted(k for k in set(old) | set(self.settings)
                          if old.get(k) != self.settings.get(k) and (tcfg is None or k != "trainer_config"))
            if tcfg is not None:
                diff += [f"trainer_config.{k}" for k in config_diff(old.get("trainer_config", {}), tcfg)]
            if diff:
                raise ValueError(f"out: {str(self.out)!r} holds results of other settings ({', '.join(diff)}); "
                                 "use another --out")
        p.write_text(json.dumps(self.settings, indent=1, default=str))  # in the current code's terms

    def done(self, seed: int) -> dict | None:
        p = self.out / "seeds" / f"seed-{seed:05d}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def save(self, rec: dict) -> None:
        p = self.out / "seeds" / f"seed-{rec['seed']:05d}.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(p)


def run(tcfg, settings: PhiSettings, *, out, model: str = "", lag: int = 0, seeds: int = 8, seed_offset: int = 0,
        command: str = "", console=None) -> dict:
    """Evaluate ``seeds`` batches of the audit's source and write ``phi.json`` / ``phi.md``."""
    from pdmask.train.environment import environment
    from .source import build_source

    settings.validate()
    if settings.thresholds is None:  # resolved once: settings.json and the report state O's deltas
        settings = replace(settings, thresholds=phi_thresholds(tcfg, settings.divergence))
    if seeds < 1:
        raise ValueError(f"seeds: must be >= 1, got {seeds}")
    run_ = PhiRun(Path(out), {"settings": asdict(settings), "model": portable_path(model) if model else model, "lag": lag,
                              "trainer_config": portable_config(tcfg.to_dict())})
    run_.open(tcfg)
    src = build_source(tcfg, model=model, lag=lag, console=console)
    if src.optimizer_state is None:
        raise ValueError("model: the evaluation needs a warm optimizer state; pass a `pdmask train` run directory "
                         "(--model RUN_DIR) or --lag N")
    records = []
    for i, s in enumerate(range(seed_offset, seed_offset + seeds)):
        rec = run_.done(s)
        if rec is None:
            t0 = time.perf_counter()
            rb, adv, info = src.sample(s)
            rec = evaluate_seed(src.model, rb, adv, tcfg, src.optimizer_state, settings, s) | {"info": info}
            rec["time_s"] = time.perf_counter() - t0  # rollout + evaluation of this seed
            run_.save(rec)
        records.append(rec)
        if console is not None:
            console.print(f"seed {s} ({i + 1}/{seeds}): |O| = {rec['n_out_of_region']}, "
                          f"Phi {rec['phi0']:.4g} -> {rec.get('phi_full', rec['phi0']):.4g}")
    doc = {"settings": {**asdict(settings), "criteria": list(settings.criteria)},
           "run": {"command": command, **src.info, "environment": environment(),
                   "optimizer_state": src.info.get("optimizer_state", f"after the {lag} lag steps")},
           "summary": summarize(records, settings), "records": records}
    Path(out, "phi.json").write_text(json.dumps(doc, indent=1, default=str))
    Path(out, "phi.md").write_text(markdown(doc))
    return doc


def _floats(text: str, name: str) -> tuple:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name}: expected a comma-separated list of numbers, got {text!r}") from None


def main(argv=None) -> None:
    """``python -m pdmask_lab.audit.phi --help``."""
    import sys

    import typer

    def command(
        out: Path = typer.Option(Path("audit-phi"), "--out", "-o", help="output directory (resumable)"),
        model: str = typer.Option("", "--model", help="a `pdmask train` run directory (its AdamW state is the "
                                                      "warm state), or a HF model directory with --lag"),
        config: Path = typer.Option(None, "--config", help="trainer YAML (default: the run's config.yaml)"),
        set_: list[str] = typer.Option([], "--set", help="trainer config override key=value (repeatable)"),
        seeds: int = typer.Option(8, "--seeds", help="rollout batches"),
        seed_offset: int = typer.Option(0, "--seed-offset", help="first seed"),
        lag: int = typer.Option(0, "--lag", help="policy steps ahead of the engine before the evaluation"),
        divergence: str = typer.Option("topk_kl", "--divergence", help="topk_kl or topk_tv"),
        delta: float = typer.Option(None, "--delta", help="delta of O (default 0.05 KL, 0.15 TV)"),
        fractions: str = typer.Option("0.1,0.25,0.5", "--fractions", help="masked fractions of |O|"),
        loo_tokens: int = typer.Option(48, "--loo-tokens", help="leave-one-out tokens of O per seed"),
        loo_outside: int = typer.Option(16, "--loo-outside", help="leave-one-out tokens outside O per seed"),
        batch_lasts: str = typer.Option("1", "--batch-lasts", help="also score params=N for these N ('' none)"),
        bootstrap: int = typer.Option(DEFAULT_N_BOOT, "--bootstrap", help="bootstrap resamples"),
    ) -> None:
        from rich.console import Console

        from pdmask.train.checkpoint import is_run_dir
        from pdmask.train.config import load_config

        try:
            cfg_path = config if config is not None else (
                Path(model) / "config.yaml" if model and is_run_dir(model) else None)
            tcfg = load_config(cfg_path, list(set_) + ["progress=false"])
            settings = PhiSettings(divergence=divergence, thresholds=phi_thresholds(tcfg, divergence, delta),
                                   fractions=_floats(fractions, "fractions"), loo_tokens=loo_tokens,
                                   loo_outside=loo_outside, batch_lasts=tuple(int(x) for x in
                                                                              _floats(batch_lasts, "batch_lasts")),
                                   bootstrap=bootstrap)
            console = Console(stderr=True)
            run(tcfg, settings, out=out, model=model, lag=lag, seeds=seeds, seed_offset=seed_offset,
                command=portable_command("python -m pdmask_lab.audit.phi", sys.argv[1:]),
                console=console)
            console.print(f"wrote {out / 'phi.md'}")
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)

    app = typer.Typer(add_completion=False)
    app.command(help="Judge the batch-aware mask by Phi: sign accuracy against leave-one-out, dPhi at matched "
                     "masked fraction.")(command)
    app(argv, standalone_mode=True) if argv is not None else app()


if __name__ == "__main__":
    main()
