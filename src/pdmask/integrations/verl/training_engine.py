"""The pdmask FSDP *training* engine: verl's FSDP engine with the logits hook of :mod:`.actor`.

Not a rollout engine (those are in :mod:`pdmask.engine`). Imports verl's FSDP engine at
module level; :func:`.registration.register_engine` loads it.
"""

from __future__ import annotations

from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from .actor import NoTopKLossFunction, OldPolicyCapture, PdmaskLossFunction, has_rollout_topk
from .losses import update_index


def is_old_policy_pass(micro_batch, loss_function, forward_only) -> bool:
    """The old-log-prob pass of decoupled mode on a batch with the rollout top-K: forward only,
    no loss function (``compute_loss=False``) and entropy requested -- verl 0.9.1's trainers
    ask for the entropy in that pass (``_compute_old_log_prob``), not in the reference pass."""
    return (forward_only and loss_function is None and has_rollout_topk(micro_batch)
            and bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)))


class PdmaskFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP LM engine; training micro-batches that carry the rollout top-K get their
    logits routed through :class:`.actor.PdmaskLossFunction`, and the decoupled-mode
    old-log-prob pass over them through :class:`.actor.OldPolicyCapture` (model type
    ``pdmask_language_model``). Everything else is the stock engine. ``train_batch`` counts the
    updates since the last old-log-prob pass (:func:`.losses.update_index`)."""

    def _route_logits(self, micro_batch) -> None:
        if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            raise ValueError("use_fused_kernels: the pdmask top-K modes need the logits; "
                             "set actor_rollout_ref.model.use_fused_kernels=false")
        if tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False):
            raise ValueError("distillation: top-K distillation and the pdmask top-K modes both use "
                             "verl's logits-processor hook; enable only one")
        # The flag routes the logits through the loss function (the hook verl built for
        # top-K distillation); the wrapper answers both calls.
        tu.assign_non_tensor(micro_batch, distillation_use_topk=True)

    def forward_step(self, micro_batch, loss_function, forward_only):
        if loss_function is not None and not forward_only and has_rollout_topk(micro_batch):
            self._route_logits(micro_batch)
            loss_function = PdmaskLossFunction(loss_function)
        elif is_old_policy_pass(micro_batch, loss_function, forward_only):
            self._route_logits(micro_batch)
            loss_function = OldPolicyCapture()
            self._pdmask_updates = 0  # a new step: its pi_old is being scored
        elif loss_function is not None and not forward_only:
            loss_function = NoTopKLossFunction(loss_function)
        return super().forward_step(micro_batch, loss_function, forward_only)

    def train_batch(self, data, loss_function):
        """One update (a mini-batch): its index since the step's old-log-prob pass is visible
        to the loss (decoupled mode; None without such a pass)."""
        n = getattr(self, "_pdmask_updates", None)
        self._pdmask_updates = None if n is None else n + 1
        with update_index(self._pdmask_updates):
            return super().train_batch(data, loss_function)
