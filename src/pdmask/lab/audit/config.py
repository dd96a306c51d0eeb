"""Settings of one direction audit, validated once, written verbatim into ``audit.json``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..._validate import ESTIMATORS, LOSS_AGGS
from ...masks import MODES, MaskMode
from ..significance import DEFAULT_N_BOOT

#: Divergences the audit can judge. The binary ones are excluded on purpose: their
#: predictive direction equals the ratio direction exactly (METHOD.md section 4), so
#: there is nothing to compare.
DIVERGENCES = ("topk_kl", "topk_tv", "full_kl", "full_tv")
OPTIMIZERS = ("adamw", "adam", "sgd")
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
    """The default delta of an audited divergence (``topk_kl``, ``full_tv``, ...): its
    ``pdm-*`` mode's. An unknown name gets :class:`pdmask.MaskMode`'s default; the config's
    own check of ``divergence`` then refuses it with the list of valid names."""
    mode = MODES.get("pdm-" + str(divergence).replace("_", "-"))
    return MaskMode.default_delta if mode is None else mode.default_delta


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
        if "batch" in MODES[self.step_mode].needs:
            _fail("step_mode", f"{self.step_mode!r} needs an external batch direction (batch_ddot); the audit's "
                  "batch step supports the per-token modes")
        ins = (self.instruments,) if isinstance(self.instruments, str) else tuple(self.instruments)
        if any(x not in INSTRUMENTS for x in ins) or len(set(ins)) != len(ins):
            _fail("instruments", f"must be a list of distinct values from {', '.join(INSTRUMENTS)}, "
                  f"got {self.instruments!r}")
        self.instruments = ins
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
        for name in ("sample_tokens", "bootstrap_seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(name, f"must be a non-negative int, got {v!r}")
        v = self.disagreement_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < -1:
            _fail("disagreement_tokens", f"must be an int >= 0, or -1 for all, got {v!r}")
        if not isinstance(self.bootstrap, int) or self.bootstrap < 1:
            _fail("bootstrap", f"must be a positive int, got {self.bootstrap!r}")
        sw = tuple(self.delta_sweep)
        lo = min(self.delta_low, self.delta_high)
        if any(not isinstance(d, (int, float)) or not math.isfinite(d) or d < lo for d in sw):
            _fail("delta_sweep", f"must be numbers >= the audited delta ({lo}): an audit records only the tokens "
                  f"above its own delta; got {self.delta_sweep!r}")
        self.delta_sweep = tuple(sorted(set(float(d) for d in sw)))
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
        d["instruments"] = list(self.instruments)
        d["delta_sweep"] = list(self.delta_sweep)
        d["is_cap"] = self.is_cap if math.isfinite(self.is_cap) else "inf"
        return d
