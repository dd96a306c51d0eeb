"""Settings of one direction audit, validated once, written verbatim into ``audit.json``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .._validate import ESTIMATORS, LOSS_AGGS
from ..masks import MODES

#: Divergences the audit can judge. The binary ones are excluded on purpose: their
#: predictive direction equals the ratio direction exactly (METHOD.md section 4), so
#: there is nothing to compare.
DIVERGENCES = ("topk_kl", "topk_tv", "full_kl", "full_tv")
OPTIMIZERS = ("adamw", "adam", "sgd")
ISOLATED_PARAMS = ("all", "head")
#: K values of the estimator-fidelity sweep (capped at the vocabulary size).
FIDELITY_KS = (1, 2, 5, 10, 20, 50, 100)


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"{name}: {msg}")


@dataclass
class AuditConfig:
    """Everything that decides an audit's numbers (the engine/model settings live with the runner).

    Attributes:
        divergence: the proximity divergence; the realized change is recomputed with it.
        delta_low, delta_high: thresholds for A < 0 / A > 0 (``D > delta`` is out of region).
        estimator: the top-K estimator of the *headline* predictive criterion (every
            estimator is measured; this one is compared with the ratio in the summary).
        step_mode: mask mode of the batch step itself (``none``: every token updates, so
            every criterion is judged on the same update).
        optimizer, lr, weight_decay, betas: the batch step's optimizer (fresh per seed,
            or loaded from a given optimizer state).
        grad_clip: global gradient-norm clip of the batch step (0: off), as the trainer.
        is_cap, loss_agg, eps_low, eps_high: loss settings of the batch step.
        temperature: sampling temperature; ``pi = softmax(logits / T)``.
        isolated_tokens: uniform sample of out-of-region tokens per seed that get an
            isolated parameter-space step (0 disables).
        isolated_disagreement: additionally, up to this many disagreement tokens per seed.
        isolated_step: parameter-space length of the isolated step (normalised gradient);
            small enough for the first-order regime (the realized dD / step is flat below
            ~1e-4 on the built-in model) and far above float64 rounding.
        isolated_params: which parameters the isolated step moves, one measurement each:
            ``all`` (the whole network) and/or ``head`` (only the output embedding, whose
            gradient moves the logits exactly along ``e_k - pi`` when it is not tied).
        isolated_dtype: dtype of the model copy used for the isolated steps.
        logit_step: length of the logit-space isolated step along ``sign(A)(e_k - pi)``
            (tiny: second-order terms must stay below ``step * |Ddot|`` even for
            ``|Ddot| ~ 1e-6``; float64 keeps the change far above rounding).
        tie_tol: ``|dD| <= tie_tol`` counts as no change (neither unsafe nor corrective).
        fidelity_ks: K values of the estimator-fidelity sweep.
        bootstrap: bootstrap resamples over seeds; bootstrap_seed seeds them.
    """

    divergence: str = "topk_kl"
    delta_low: float = 0.05
    delta_high: float = 0.05
    estimator: str = "exact"
    step_mode: str = "none"
    optimizer: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 1.0
    is_cap: float = 5.0
    loss_agg: str = "token-mean"
    eps_low: float = 0.2
    eps_high: float = 0.2
    temperature: float = 1.0
    isolated_tokens: int = 32
    isolated_disagreement: int = 32
    isolated_step: float = 1e-5
    isolated_params: tuple = ("all",)
    isolated_dtype: str = "float64"
    logit_step: float = 1e-7
    tie_tol: float = 0.0
    fidelity_ks: tuple = field(default_factory=lambda: FIDELITY_KS)
    bootstrap: int = 10000
    bootstrap_seed: int = 0

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            _fail("divergence", f"unknown value {self.divergence!r}; valid values are: {', '.join(DIVERGENCES)}"
                  " (binary divergences are not audited: their predictive direction equals the ratio's)")
        if self.estimator not in ESTIMATORS:
            _fail("estimator", f"unknown value {self.estimator!r}; valid values are: {', '.join(ESTIMATORS)}")
        if self.step_mode not in MODES:
            _fail("step_mode", f"unknown mode {self.step_mode!r}; valid modes are: {', '.join(MODES)}")
        if self.optimizer not in OPTIMIZERS:
            _fail("optimizer", f"unknown value {self.optimizer!r}; valid values are: {', '.join(OPTIMIZERS)}")
        if self.loss_agg not in LOSS_AGGS:
            _fail("loss_agg", f"unknown value {self.loss_agg!r}; valid values are: {', '.join(LOSS_AGGS)}")
        ip = (self.isolated_params,) if isinstance(self.isolated_params, str) else tuple(self.isolated_params)
        if not ip or any(x not in ISOLATED_PARAMS for x in ip) or len(set(ip)) != len(ip):
            _fail("isolated_params", f"must be a non-empty list of distinct values from {', '.join(ISOLATED_PARAMS)}, "
                  f"got {self.isolated_params!r}")
        self.isolated_params = ip
        if self.isolated_dtype not in ("float32", "float64"):
            _fail("isolated_dtype", f"must be 'float32' or 'float64', got {self.isolated_dtype!r}")
        for name in ("delta_low", "delta_high", "lr", "isolated_step", "logit_step", "temperature",
                     "eps_low", "eps_high"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                _fail(name, f"must be a positive finite number, got {v!r}")
        if not isinstance(self.is_cap, (int, float)) or math.isnan(self.is_cap) or self.is_cap <= 0:
            _fail("is_cap", f"must be a positive number (inf disables the cap), got {self.is_cap!r}")
        for name in ("weight_decay", "tie_tol", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                _fail(name, f"must be a non-negative finite number, got {v!r}")
        for name in ("isolated_tokens", "isolated_disagreement", "bootstrap_seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                _fail(name, f"must be a non-negative int, got {v!r}")
        if not isinstance(self.bootstrap, int) or self.bootstrap < 1:
            _fail("bootstrap", f"must be a positive int, got {self.bootstrap!r}")
        ks = tuple(self.fidelity_ks)
        if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
            _fail("fidelity_ks", f"must be a non-empty list of positive ints, got {self.fidelity_ks!r}")
        self.fidelity_ks = tuple(sorted(set(ks)))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(float(b) for b in self.betas)

    @property
    def family(self) -> str:
        """``kl`` or ``tv``: which Ddot family the predictive criteria use."""
        return self.divergence.rsplit("_", 1)[1]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"], d["fidelity_ks"] = list(self.betas), list(self.fidelity_ks)
        d["isolated_params"] = list(self.isolated_params)
        d["is_cap"] = self.is_cap if math.isfinite(self.is_cap) else "inf"
        return d
