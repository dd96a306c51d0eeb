"""The pdmask FSDP *training* engine: verl's FSDP engine with the logits hook of :mod:`.actor`.

Not a rollout engine (those are in :mod:`pdmask.engine`). Imports verl's FSDP engine at
module level; :func:`.registration.register_engine` loads it.
"""

from __future__ import annotations

from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from .actor import NoTopKLossFunction, PdmaskLossFunction, has_rollout_topk


class PdmaskFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP LM engine; training micro-batches that carry the rollout top-K get their
    logits routed through :class:`.actor.PdmaskLossFunction` (model type
    ``pdmask_language_model``). Everything else is the stock engine."""

    def forward_step(self, micro_batch, loss_function, forward_only):
        if loss_function is not None and not forward_only and has_rollout_topk(micro_batch):
            if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
                raise ValueError("use_fused_kernels: the pdmask top-K modes need the logits; "
                                 "set actor_rollout_ref.model.use_fused_kernels=false")
            if tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False):
                raise ValueError("distillation: top-K distillation and the pdmask top-K modes both use "
                                 "verl's logits-processor hook; enable only one")
            # The flag routes the logits through the loss function (the hook verl built for
            # top-K distillation); the wrapper answers both calls.
            tu.assign_non_tensor(micro_batch, distillation_use_topk=True)
            loss_function = PdmaskLossFunction(loss_function)
        elif loss_function is not None and not forward_only:
            loss_function = NoTopKLossFunction(loss_function)
        return super().forward_step(micro_batch, loss_function, forward_only)
