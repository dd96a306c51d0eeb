"""The top-K modes end to end through verl's real FSDP-engine code on CPU.

A micro-batch is built the way verl builds one (agent-loop layout -> ``DataProto`` ->
``to_tensordict`` -> ``left_right_2_no_padding``) with the replica's per-sample top-K
arrays in the non-tensor batch; :class:`PdmaskFSDPEngine.forward_step` (verl's
``prepare_model_inputs`` / ``prepare_model_outputs`` with the logits-processor hook /
``ppo_loss`` / ``agg_loss``) runs on a tiny model whose logits are known in closed
form, and the loss, its gradient and the metrics must equal ``pdmask.policy_loss`` on
the same logits.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_helpers import actor_config, needs_verl
from verl_rollout import TEMP, V, Rollout, build, reference

pytestmark = needs_verl


def _build(seed=0, *, mode_shift=1.5):
    r = build(seed, mode_shift=mode_shift)
    return r.model, r.prompts, r.responses, r.fields, r.adv


def _reference(model, prompts, responses, fields, adv, mode, estimator, **kw):
    return reference(Rollout(model, prompts, responses, fields, adv), adv, mode, estimator, **kw)


def _micro_batch(prompts, responses, fields, adv, *, use_remove_padding):
    from verl import DataProto
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = len(prompts)
    P, T = max(map(len, prompts)), max(map(len, responses))
    pr = torch.zeros(B, P, dtype=torch.long)
    rs = torch.zeros(B, T, dtype=torch.long)
    am = torch.zeros(B, P + T, dtype=torch.long)
    for b in range(B):
        pr[b, P - len(prompts[b]):] = torch.tensor(prompts[b])
        rs[b, :len(responses[b])] = torch.tensor(responses[b])
        am[b, P - len(prompts[b]):P + len(responses[b])] = 1
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    resp_mask = am[:, P:].clone()
    batch = TensorDict({
        "prompts": pr, "responses": rs, "input_ids": torch.cat([pr, rs], 1), "attention_mask": am,
        "position_ids": pos, "response_mask": resp_mask,
        "old_log_probs": torch.zeros(B, T, dtype=torch.float32), "advantages": adv.float(),
    }, batch_size=B)
    nt = {}
    for key in fields[0]:
        arr = np.empty(B, dtype=object)
        arr[:] = [f[key] for f in fields]
        nt[key] = arr
    td = left_right_2_no_padding(DataProto(batch=batch, non_tensor_batch=nt, meta_info={}).to_tensordict())
    tu.assign_non_tensor(td, temperature=TEMP, use_remove_padding=use_remove_padding, use_fused_kernels=False,
                         calculate_entropy=False, dp_size=1, batch_num_tokens=int(resp_mask.sum()),
                         global_batch_size=B)
    return td


def _engine(monkeypatch, model):
    import verl.workers.engine.fsdp.transformer_impl as impl
    from pdmask.integrations.verl.training_engine import PdmaskFSDPEngine

    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")
    eng = object.__new__(PdmaskFSDPEngine)  # no process group, no FSDP wrapping: the module is plain
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    eng.use_ulysses_sp, eng.ulysses_sequence_parallel_size, eng.pad_to_length = False, 1, None
    eng.module, eng._autocast_dtype = model, torch.float32
    eng.get_data_parallel_group = lambda: None
    return eng


@pytest.mark.parametrize("use_remove_padding", [True, False])
@pytest.mark.parametrize("name,mode,estimator", [
    ("pdmask_pdm_topk_kl", "pdm-topk-kl", "exact"),
    ("pdmask_pdm_topk_kl_aggregated", "pdm-topk-kl", "aggregated"),
    ("pdmask_pdm_topk_tv", "pdm-topk-tv", "exact"),
    ("pdmask_dppo_topk_kl", "dppo-topk-kl", "exact"),
])
def test_engine_forward_step_equals_pdmask(monkeypatch, use_remove_padding, name, mode, estimator):
    from verl.utils.metric import Metric
    from verl.workers.utils.losses import ppo_loss

    model, prompts, responses, fields, adv = _build(seed=1)
    mb = _micro_batch(prompts, responses, fields, adv, use_remove_padding=use_remove_padding)
    cfg = actor_config(loss_mode=name)
    eng = _engine(monkeypatch, model)
    loss, out = eng.forward_step(mb, loss_function=partial(ppo_loss, config=cfg), forward_only=False)
    grads = torch.autograd.grad(loss, [model.E, model.Pe])

    # the advantages travel as float32 in verl's batch: give the reference the same values
    ref = _reference(model, prompts, responses, fields, adv.float().double(), mode, estimator)
    ref_grads = torch.autograd.grad(ref.loss, [model.E, model.Pe])
    torch.testing.assert_close(loss, ref.loss, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    m = {k: (v.aggregate() if isinstance(v, Metric) else v) for k, v in out["metrics"].items()}
    for k in ("kept_frac", "masked_frac", "out_of_region_frac", "disagreement_frac", "divergence_mean",
              "rollout_tail_mass_mean", "entropy_mean"):
        assert m[f"pdmask/{k}"] == pytest.approx(float(ref.metrics[k]), rel=1e-5, abs=1e-6), k
    assert 0 < float(ref.metrics["masked_frac"]) < 1, "the batch must mask some tokens, not all"


def test_pdm_and_ratio_masks_differ_somewhere(monkeypatch):
    """The point of the predictive mask: on a batch with disagreement tokens the pdm and
    dppo losses must differ (otherwise the engine path could be ignoring the direction)."""
    from verl.workers.utils.losses import ppo_loss

    for seed in range(2, 12):
        model, prompts, responses, fields, adv = _build(seed=seed, mode_shift=2.5)
        ref = _reference(model, prompts, responses, fields, adv, "pdm-topk-kl", "exact")
        if int(ref.metrics["num_disagreement"]) > 0:
            break
    else:
        pytest.fail("no seed produced a disagreement token")
    losses = []
    for name in ("pdmask_pdm_topk_kl", "pdmask_dppo_topk_kl"):
        mb = _micro_batch(prompts, responses, fields, adv, use_remove_padding=True)
        loss, _ = _engine(monkeypatch, model).forward_step(
            mb, loss_function=partial(ppo_loss, config=actor_config(loss_mode=name)), forward_only=False)
        losses.append(float(loss.detach()))
    assert losses[0] != pytest.approx(losses[1], rel=1e-9)


def test_misaligned_topk_is_refused(monkeypatch):
    from verl.workers.utils.losses import ppo_loss

    model, prompts, responses, fields, adv = _build(seed=3)
    fields[1] = dict(fields[1])
    bad = fields[1]["pdmask_sampled_ids"].copy()
    bad[0] = (bad[0] + 1) % V
    fields[1]["pdmask_sampled_ids"] = bad
    mb = _micro_batch(prompts, responses, fields, adv, use_remove_padding=True)
    with pytest.raises(ValueError, match="pdmask_sampled_ids"):
        _engine(monkeypatch, model).forward_step(
            mb, loss_function=partial(ppo_loss, config=actor_config(loss_mode="pdmask_pdm_topk_kl")),
            forward_only=False)


def test_short_topk_is_refused(monkeypatch):
    from verl.workers.utils.losses import ppo_loss

    model, prompts, responses, fields, adv = _build(seed=4)
    fields[2] = {k: v[:-1] for k, v in fields[2].items()}
    mb = _micro_batch(prompts, responses, fields, adv, use_remove_padding=True)
    with pytest.raises(ValueError, match="multi-turn"):
        _engine(monkeypatch, model).forward_step(
            mb, loss_function=partial(ppo_loss, config=actor_config(loss_mode="pdmask_pdm_topk_kl")),
            forward_only=False)


def test_batches_without_topk_use_the_stock_engine(monkeypatch):
    """Reference / old-log-prob passes (no loss function) and batches without the arrays
    must not touch the hook."""
    from pdmask.integrations.verl.actor import has_rollout_topk

    model, prompts, responses, fields, adv = _build(seed=5)
    mb = _micro_batch(prompts, responses, fields, adv, use_remove_padding=True)
    assert has_rollout_topk(mb)
    eng = _engine(monkeypatch, model)
    _, out = eng.forward_step(mb, loss_function=None, forward_only=True)
    assert set(out["model_output"]) == {"log_probs"}
    from verl.utils import tensordict_utils as tu
    assert not tu.get_non_tensor_data(data=mb, key="distillation_use_topk", default=False)
