"""verl's actor worker stack on CPU, without Ray and without FSDP wrapping.

``ActorRolloutRefWorker.update_actor`` -> (``tqbridge``: ``KVBatchMeta`` -> ``TensorDict``)
-> ``TrainingWorker.train_mini_batch`` (mini-batch iterator) -> ``train_batch`` ->
``PdmaskFSDPEngine.train_batch`` -> ``forward_backward_batch`` (global token count,
``prepare_micro_batches``) -> ``forward_step`` -> the loss: every method is verl's own
(the pdmask engine's ``forward_step`` included). What is replaced is only what needs a GPU
or a cluster: the workers are built with ``object.__new__`` and given the attributes their
``__init__`` / ``init_model`` would set from the config (a plain ``nn.Module`` instead of an
FSDP-wrapped one, a single-process gloo group, a profiler and FLOPs counter that do nothing,
an optimizer that records the gradients it is asked to apply).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch


class RecordingSGD(torch.optim.SGD):
    """SGD with lr 0 (the weights stay put, so the reference sees the same model) that keeps
    a copy of the gradients of every ``step``."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.steps: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.steps.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


class _Profiler:
    rank = 0

    def check_enable(self):
        return False

    def check_this_step(self):
        return False

    def check_this_rank(self):
        return False

    def step(self):
        pass


class _Flops:
    def estimate_flops(self, *args, **kwargs):
        return 1.0, 1.0


def actor_stack(monkeypatch, cfg, model):
    """An ``ActorRolloutRefWorker`` whose actor trains ``model`` with the pdmask engine.

    ``cfg``: the composed ``ppo_trainer`` config (``compose_config``). Returns
    ``(worker, engine)``; ``engine.optimizer.steps`` holds the gradients of each update.
    """
    import verl.workers.engine.fsdp.transformer_impl as impl
    import verl.workers.engine_workers as ew
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    from pdmask.integrations.verl.training_engine import PdmaskFSDPEngine

    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(ew, "get_torch_device", lambda: SimpleNamespace(max_memory_allocated=lambda: 0,
                                                                        max_memory_reserved=lambda: 0))
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # the key a GPU worker looks the engine up with
    model_type = cfg.actor_rollout_ref.model.get("model_type", "language_model")
    engine_cls = EngineRegistry.get_engine_cls(model_type, cfg.actor_rollout_ref.actor.strategy)
    assert engine_cls is PdmaskFSDPEngine, engine_cls

    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    # ActorRolloutRefWorker.init_model: engine settings from the actor / rollout config
    engine_cfg = actor_cfg.engine
    engine_cfg.use_dynamic_bsz = actor_cfg.use_dynamic_bsz
    engine_cfg.micro_batch_size_per_gpu = actor_cfg.ppo_micro_batch_size_per_gpu
    engine_cfg.max_token_len_per_gpu = actor_cfg.ppo_max_token_len_per_gpu
    # the old-log-prob pass (decoupled mode): the rollout's log-prob batch sizes, as init_model sets
    # them (the test configs leave log_prob_micro_batch_size_per_gpu unset: the update's size)
    ro = cfg.actor_rollout_ref.rollout
    engine_cfg.infer_micro_batch_size_per_gpu = ro.log_prob_micro_batch_size_per_gpu or \
        actor_cfg.ppo_micro_batch_size_per_gpu
    engine_cfg.infer_max_token_len_per_gpu = ro.log_prob_max_token_len_per_gpu
    use_rmpad = bool(cfg.actor_rollout_ref.model.use_remove_padding)

    eng = object.__new__(engine_cls)
    eng.engine_config = engine_cfg
    eng.optimizer_config = SimpleNamespace(clip_grad=1e12)
    eng.module = model
    eng.optimizer = RecordingSGD(model.parameters())
    eng.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda _: 1.0)
    eng._autocast_dtype = torch.float32
    eng._is_offload_param = eng._is_offload_optimizer = False
    eng._qat_enabled = False
    eng.use_ulysses_sp, eng.ulysses_sequence_parallel_size = False, 1
    eng.ulysses_device_mesh = eng.ulysses_parallel_group = None
    eng.pad_to_length = None
    eng.mode = None
    import verl.utils.torch_functional as verl_F

    eng.compute_entropy_from_logits = verl_F.entropy_from_logits  # __init__'s, without torch.compile

    actor = object.__new__(ew.TrainingWorker)
    actor.engine = eng
    actor.engine_config = engine_cfg
    actor.model_config = {"use_remove_padding": use_rmpad}
    actor.loss_fn = partial(ppo_loss, config=actor_cfg)  # as init_model builds it
    actor.profiler = _Profiler()
    actor.flops_counter = _Flops()
    actor.device_name = "cpu"

    worker = object.__new__(ew.ActorRolloutRefWorker)
    worker._Worker__dispatch_dp_rank, worker._Worker__collect_dp_rank = {}, {}
    worker._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    worker.actor = actor
    worker.enable_routing_replay = False
    return worker, eng


def gloo_group(tmp_path):
    """A single-process gloo group (verl's engine all-reduces token counts over its DP group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    return dist
