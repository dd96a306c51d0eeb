"""The research lab: experiments run on top of the library, kept apart from it.

``import pdmask`` loads none of this package, and no library module imports it
(``tests/test_layers.py`` checks both). What lives here:

- :mod:`pdmask_lab.audit` — the direction audit (METHOD section 5) and the Phi audit of
  the batch mask (``pdmask audit``, ``pdmask audit-grid``).
- :mod:`pdmask_lab.batchmask` — the experimental batch-aware mask (needs the model and
  the optimizer, not only logits); importing it registers its trainer forward.
- :mod:`pdmask_lab.significance`, :mod:`pdmask_lab.power` — the project's statistics
  (seed-cluster bootstrap, exact tests, the detectable difference of a seed design).
- experiments over training runs: :mod:`pdmask_lab.compare` (``pdmask compare``),
  :mod:`pdmask_lab.ladder` with its report, figure and pooled comparison
  (``pdmask ladder``), :mod:`pdmask_lab.prefix`, :mod:`pdmask_lab.report` and
  :mod:`pdmask_lab.seed_summary` (``pdmask report``), :mod:`pdmask_lab.task_stats`
  (``pdmask task-stats``).
"""

# the pdm-batch-* modes' trainer forward is registered when the batch mask is imported: every
# use of the lab (the command line, compare, the ladder, the audit) can then train them
from . import batchmask  # noqa: E402,F401
