"""The batch-aware predictive mask (docs/batch_mask.md).

A per-token direction test asks what a token's update does to its own divergence. This
one asks what it does to the out-of-region divergence of the whole batch,
``Phi = sum_{s in O} D_s``, through the model's parameters and the optimizer's
preconditioner: ``c_t = A_t w_t <grad log pi_t, P grad Phi>``, for all tokens from one
backward and one forward-mode pass. Importing this package registers the ``pdm-batch-*``
modes, which read that direction as the per-token extra ``ddot_batch``:
``policy_loss(..., **out.loss_kwargs())`` (``extras={"ddot_batch": out.ddot}``).

- :func:`batch_mask`, :class:`BatchMask`, :class:`BatchMaskOutput` (:mod:`.mask`)
- :func:`select_params`, :class:`ParamSubset` (:mod:`.params`): ``params=``
- :func:`preconditioner` (:mod:`.precondition`): the optimizer's P
- :func:`out_of_region_divergence` (:mod:`.phi`): Phi with its chunked closed-form gradient
- :mod:`.trainer`: the ``pdm-batch-*`` modes' forward in the built-in trainer, registered
  with :func:`pdmask.train.forwards.register_forward` when this package is imported
"""

from .mask import DDOT, METHODS, SCOPES, BatchMask, BatchMaskOutput, batch_mask
from .params import ParamSubset, select_params
from .phi import PHI_DIVERGENCES, out_of_region_divergence
from .precondition import preconditioner
from . import trainer  # noqa: F401,E402  (registers the trainer forward of the pdm-batch-* modes)

__all__ = ["DDOT", "METHODS", "PHI_DIVERGENCES", "SCOPES", "BatchMask", "BatchMaskOutput", "ParamSubset", "batch_mask",
           "out_of_region_divergence", "preconditioner", "select_params"]
