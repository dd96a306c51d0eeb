"""Settings of one direction audit, validated once, written verbatim into ``audit.json``.

The batch step's loss is one :class:`pdmask.PolicyLoss`, ``AuditConfig.loss``: the
trainer's whole loss spec (``pdmask audit --config``: corrections, sampling, aggregation,
clip range), with the audit's step mode, headline estimator and the deltas of its region
O (:func:`audit_loss`). What the audit cannot honour is refused in one line
(:meth:`AuditConfig.check_loss`). The optimizer's defaults are the trainer's
(:data:`pdmask.train.update.ADAMW_BETAS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdmask._validate import check_choice
from pdmask.keys import ESTIMATORS
from pdmask.loss import PolicyLoss
from pdmask.divergences import KL_DELTA
from pdmask.divergences import default_delta as _default_delta
from pdmask.masks import get_mode
from pdmask.train.loss_spec import build_loss, loss_fields, resolved_fields
from pdmask.train.update import ADAMW_BETAS, OPTIMIZERS
from ..significance import DEFAULT_N_BOOT

#: Divergences the audit can judge. The binary ones are excluded on purpose: their
#: predictive direction equals the ratio direction exactly (METHOD.md section 4), so
#: there is nothing to compare.
DIVERGENCES = ("topk_kl", "topk_tv", "full_kl", "full_tv")
#: per-token instruments, measured on a uniform sample of O plus the headline
#: disagreement set: ``param`` (step-free <grad D, grad A log pi> with its group split),
#: ``precond`` (the same through AdamW's preconditioner; needs an optimizer state),
#: ``own`` (own effect inside the batch, leave-one-out), ``isolated`` / ``isolated-head``
#: (a small parameter step on the token's loss: all parameters / the output embedding)
INSTRUMENTS = ("param", "precond", "own", "isolated", "isolated-head")
#: K values of the estimator-fidelity sweep (capped at the vocabulary size).
FIDELITY_KS = (1, 2, 5, 10, 20, 50, 100)
#: The same K list as the command line writes it.
FIDELITY_KS_ARG = ",".join(map(str, FIDELITY_KS))


def default_delta(divergence: str) -> float:
    """The default delta of an audited divergence (``topk_kl``, ``full_tv``, ...): the
    divergence's own (:func:`pdmask.divergences.default_delta`, the registry). An unknown name
    gets the KL default; the config's own check of ``divergence`` then refuses it with the
    list of valid names."""
    return _default_delta(divergence) if divergence in DIVERGENCES else KL_DELTA


def audit_loss(trainer_loss: dict | None = None, *, step_mode: str = "none", estimator: str = "exact",
               deltas: tuple = (None, None), divergence: str = "topk_kl", validate: bool = True) -> PolicyLoss:
    """The batch step's :class:`pdmask.PolicyLoss`: the trainer's loss fields
    (``TrainConfig.loss_fields``; None: the trainer's defaults) with the audit's step mode,
    headline estimator and region deltas ``(low, high)`` (a None side: the trainer's when
    it sets one, else the audited divergence's default), input checks on (``validate``).
    An error names the setting."""
    fields = loss_fields(trainer_loss)
    th = fields["thresholds"]
    keys = ("delta_low", "delta_high")
    for k, d in zip(keys, deltas):
        th[k] = d if d is not None else th[k] if th[k] is not None else default_delta(divergence)
    fields.update(mode=step_mode, estimator=estimator, validate=validate)
    names = {"mode": "step_mode", "estimator": "estimator"}
    return build_loss(fields, names)[0]


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"{name}: {msg}")


@dataclass
class AuditConfig:
    """Everything that decides an audit's numbers (the engine/model settings live with the runner).

    Attributes:
        divergence: the proximity divergence; the realized change is recomputed with it.
        estimator: the top-K estimator of the *headline* predictive criterion (every
            estimator is measured; this one is compared with the ratio in the summary).
        loss: the batch step's :class:`pdmask.PolicyLoss` (:func:`audit_loss`; None: the
            trainer's default loss with mode ``none``): its mode is the step mode (``none``:
            every token updates, so every criterion is judged on the same update), its
            thresholds' deltas define O (``D > delta_high`` for A > 0, ``D > delta_low`` for
            A < 0), its sampling temperature is ``pi = softmax(logits / T)``; corrections
            and aggregation are the step's.
        optimizer, lr, weight_decay, betas: the batch step's optimizer (fresh per seed,
            or loaded from a given optimizer state); ``betas`` default to the trainer's.
        grad_clip: global gradient-norm clip of the batch step (0: off), as the trainer.
        sample_tokens: size of the seeded uniform sample of O per seed on which the
            per-token instruments are measured (0: none).
        disagreement_tokens: the headline criterion's disagreement tokens per seed that
            the instruments measure as well (-1: all of them).
        instruments: which per-token instruments to measure (see :data:`INSTRUMENTS`).
        isolated_step: parameter-space length of the isolated step (normalised gradient);
            small enough for the first-order regime (the realized dD / step is flat below
            ~1e-4 on the built-in model) and far above float64 rounding.
        isolated_dtype: dtype of the model copy used for the isolated steps.
        logit_step: length of the logit-space isolated step along ``sign(A)(e_k - pi)``
            (tiny: second-order terms must stay below ``step * |Ddot|`` even for
            ``|Ddot| ~ 1e-6``; float64 keeps the change far above rounding).
        tie_tol: ``|dD| <= tie_tol`` counts as no change (neither unsafe nor corrective).
        fidelity_ks: K values of the estimator-fidelity sweep.
        delta_sweep: larger thresholds whose headline tables are recomputed from the
            records (a subset of O; see :func:`.tables.delta_sweep`).
        bootstrap: bootstrap resamples over seeds; bootstrap_seed seeds them.
    """

    divergence: str = "topk_kl"
    estimator: str = "exact"
    loss: PolicyLoss | None = None
    optimizer: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple = ADAMW_BETAS
    grad_clip: float = 1.0
    sample_tokens: int = 32
    disagreement_tokens: int = -1
    instruments: tuple = ("param", "precond", "own", "isolated")
    isolated_step: float = 1e-5
    isolated_dtype: str = "float64"
    logit_step: float = 1e-7
    tie_tol: float = 0.0
    fidelity_ks: tuple = field(default_factory=lambda: FIDELITY_KS)
    delta_sweep: tuple = ()
    bootstrap: int = DEFAULT_N_BOOT
    bootstrap_seed: int = 0

    def __post_init__(self) -> None:
        if str(self.divergence).startswith("binary"):
            _fail("divergence", f"{self.divergence!r} is not audited: the predictive direction of a binary "
                  "divergence equals the ratio's exactly (METHOD.md section 4)")
        check_choice("divergence", self.divergence, DIVERGENCES)
        check_choice("estimator", self.estimator, ESTIMATORS)
        if self.loss is None:
            self.loss = audit_loss(divergence=self.divergence, estimator=self.estimator)
        if not isinstance(self.loss, PolicyLoss):
            _fail("loss", f"must be a pdmask.PolicyLoss (audit_loss), got {type(self.loss).__name__}")
        self.check_loss()
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        ins = (self.instruments,) if isinstance(self.instruments, str) else tuple(self.instruments)
        if any(x not in INSTRUMENTS for x in ins) or len(set(ins)) != len(ins):
            _fail("instruments", f"must be a list of distinct values from {', '.join(INSTRUMENTS)}, "
                  f"got {self.instruments!r}")
        self.instruments = ins
        check_choice("isolated_dtype", self.isolated_dtype, ("float32", "float64"))
        for name in ("lr", "isolated_step", "logit_step"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                _fail(name, f"must be a positive finite number, got {v!r}")
        for name in ("weight_decay", "tie_tol", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                _fail(name, f"must be a non-negative finite number, got {v!r}")
        for name in ("sample_tokens", "bootstrap_seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(name, f"must be a non-negative int, got {v!r}")
        v = self.disagreement_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < -1:
            _fail("disagreement_tokens", f"must be an int >= 0, or -1 for all, got {v!r}")
        if not isinstance(self.bootstrap, int) or self.bootstrap < 1:
            _fail("bootstrap", f"must be a positive int, got {self.bootstrap!r}")
        self._check_sweeps()
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(float(b) for b in self.betas)

    def check_loss(self) -> None:
        """What the audit cannot honour of a loss spec, refused in one line naming it: a mode
        that needs an external batch direction; truncated sampling (the audit's oracle and
        fidelity sweep read the engine's full logits, whose terms are those of the
        untruncated mu); a temperature that is not positive finite (checked by the spec)."""
        mode = get_mode(self.loss.mode)
        if mode.extras:
            _fail("step_mode", f"{mode.name!r} needs an external batch direction (the batch mask); the audit's "
                  "batch step supports the per-token modes")
        if self.loss.sampling.truncated:
            _fail("loss.sampling", "truncated sampling cannot be audited: the audit's oracle and fidelity sweep read "
                  "the engine's full logits, which belong to the untruncated mu; audit without top_k / top_p / min_p")

    def _check_sweeps(self) -> None:
        sw = tuple(self.delta_sweep)
        th = self.loss.thresholds
        lo = min(th.delta_low, th.delta_high)
        if any(not isinstance(d, (int, float)) or not math.isfinite(d) or d < lo for d in sw):
            _fail("delta_sweep", f"must be numbers >= the audited delta ({lo}): an audit records only the tokens "
                  f"above its own delta; got {self.delta_sweep!r}")
        self.delta_sweep = tuple(sorted(set(float(d) for d in sw)))
        ks = tuple(self.fidelity_ks)
        if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
            _fail("fidelity_ks", f"must be a non-empty list of positive ints, got {self.fidelity_ks!r}")
        self.fidelity_ks = tuple(sorted(set(ks)))

    @property
    def temperature(self) -> float:
        """The sampling temperature: ``pi = softmax(logits / T)`` (the loss spec's)."""
        return self.loss.sampling.temperature

    @property
    def family(self) -> str:
        """``kl`` or ``tv``: which Ddot family the predictive criteria use."""
        return self.divergence.rsplit("_", 1)[1]

    def to_dict(self) -> dict:
        """JSON-ready: the loss as the fields it resolves to (the deltas of O, the IS cap in
        force), an infinite number as ``"inf"``."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "loss"}
        d["loss"] = _finite(resolved_fields(self.loss))
        d["betas"], d["fidelity_ks"] = list(self.betas), list(self.fidelity_ks)
        d["instruments"] = list(self.instruments)
        d["delta_sweep"] = list(self.delta_sweep)
        return {k: d[k] for k in self.__dataclass_fields__}


def _finite(x):
    """``x`` with infinite floats as ``"inf"`` / ``"-inf"`` (JSON has no infinity)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x
