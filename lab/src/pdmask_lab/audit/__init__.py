"""The direction audit: does a direction criterion predict the divergence change?

METHOD.md section 5. Pure functions over tensors (:mod:`.criteria`,
:mod:`.rates`, :mod:`.fidelity`, :mod:`.steps`), the step-free parameter-space
instruments (:mod:`.instruments`), the leave-one-out batch step (:mod:`.loo`), the
per-batch and per-seed runner (:mod:`.runner`), the tables computed from the per-token
records (:mod:`.tables`), the report (:mod:`.report`, :mod:`.plots`, the paper's
figures in :mod:`.paper`), the grid over model shapes (:mod:`.grid`) and the
``pdmask audit`` / ``pdmask audit-grid`` commands (:mod:`.cli`).
"""

from .config import DIVERGENCES, FIDELITY_KS, INSTRUMENTS, AuditConfig, audit_loss
from .criteria import CRITERIA, PREDICTIVE, RATIO, criterion_values, entropy_ddot
from .fidelity import fidelity_counts, summarize_fidelity
from .instruments import inner_products, optimizer_preconditioner
from .loo import BatchStep
from .rates import classify, classify_seed, rate
from .runner import SeedResult, audit_batch, run_audit, summarize_all
from .steps import batch_step, isolated_param_changes, logit_step_changes
from .tables import tables

__all__ = [
    "AuditConfig", "BatchStep", "audit_loss", "CRITERIA", "DIVERGENCES", "FIDELITY_KS", "INSTRUMENTS", "PREDICTIVE", "RATIO",
    "SeedResult", "audit_batch", "batch_step", "classify", "classify_seed", "criterion_values", "entropy_ddot",
    "fidelity_counts", "inner_products", "isolated_param_changes", "logit_step_changes", "optimizer_preconditioner",
    "rate", "run_audit", "summarize_all", "summarize_fidelity", "tables",
]
