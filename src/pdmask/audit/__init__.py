"""The direction audit: does a direction criterion predict the realized divergence change?

METHOD.md section 5. Pure functions over tensors (:mod:`.criteria`, :mod:`.rates`,
:mod:`.fidelity`, :mod:`.steps`), the per-batch and per-seed runner (:mod:`.runner`),
the report (:mod:`.report`, :mod:`.plots`, the paper's figures in :mod:`.paper`) and the
``pdmask audit`` command (:mod:`.cli`).
"""

from .config import DIVERGENCES, FIDELITY_KS, AuditConfig
from .criteria import CRITERIA, PREDICTIVE, RATIO, criterion_values, entropy_ddot, out_of_region
from .fidelity import fidelity_counts, summarize_fidelity
from .rates import bootstrap_ci, classify, classify_seed, rate, summarize
from .runner import SeedResult, audit_batch, run_audit, summarize_all
from .steps import batch_step, isolated_param_changes, logit_step_changes

__all__ = [
    "AuditConfig", "CRITERIA", "DIVERGENCES", "FIDELITY_KS", "PREDICTIVE", "RATIO", "SeedResult",
    "audit_batch", "batch_step", "bootstrap_ci", "classify", "classify_seed", "criterion_values",
    "entropy_ddot", "fidelity_counts", "isolated_param_changes", "logit_step_changes", "out_of_region",
    "rate", "run_audit", "summarize", "summarize_all", "summarize_fidelity",
]
