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


def _micro_batch(prompts, responses, fields, adv, *, use_remove_padding, response_mask=None, extra=None):
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
    if response_mask is not None:  # verl's rejection removes tokens from the response mask
        resp_mask = resp_mask * response_mask.to(resp_mask.dtype)
    batch = TensorDict({
        "prompts": pr, "responses": rs, "input_ids": torch.cat([pr, rs], 1), "attention_mask": am,
        "position_ids": pos, "response_mask": resp_mask,
        "old_log_probs": torch.zeros(B, T, dtype=torch.float32), "advantages": adv.float(),
        **(extra or {}),
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
    ("pdmask_pdm_smooth_topk_kl", "pdm-smooth-topk-kl", "exact"),
    ("pdmask_pdm_smooth_topk_tv_aggregated", "pdm-smooth-topk-tv", "aggregated"),
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
    # the hook hands the top-K statistics to the loss as float32 (actor.py): a hard mask reads only
    # their sign, the smooth weight 1 - sign(A Ddot) D / delta their value, so there the loss and
    # gradient carry D's float32 rounding, 2^-24 * D / delta relative to the token's term
    tol = dict(rtol=1e-6, atol=1e-9) if "smooth" in mode else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss, ref.loss, **tol)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **tol)
    m = {k: (v.aggregate() if isinstance(v, Metric) else v) for k, v in out["metrics"].items()}
    for k in ("kept_frac", "masked_frac", "out_of_region_frac", "disagreement_frac", "divergence_mean",
              "rollout_tail_mass_mean", "entropy_mean"):
        assert m[f"pdmask/{k}"] == pytest.approx(float(ref.metrics[k]), rel=1e-5, abs=1e-6), k
    if "smooth" in mode:  # no mask: the weight turns corrective on the tokens the hard mask would zero
        assert float(ref.metrics["masked_frac"]) == 0 and float(ref.metrics["corrective_frac"]) > 0
        for k in ("smooth_weight_mean", "smooth_weight_min", "corrective_frac"):
            assert m[f"pdmask/{k}"] == pytest.approx(float(ref.metrics[k]), rel=1e-5, abs=1e-6), k
    else:
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


#: algorithm.rollout_correction settings -> the core's keywords on the same tensors
CORRECTIONS = [
    (dict(rollout_is="token", rollout_is_threshold=1.2), dict(is_level="token", is_cap=1.2)),
    (dict(rollout_is="sequence", rollout_is_threshold=1.5), dict(is_level="sequence", is_cap=1.5)),
    (dict(rollout_is="token", rollout_is_threshold="0.8_1.25"),
     dict(is_level="token", is_mask=True, is_floor=0.8, is_cap=1.25)),
    (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
     dict(is_level="token", is_cap=2.0, is_batch_normalize=True)),
    (dict(rollout_is=None, rollout_rs="token_k3", rollout_rs_threshold=0.02), dict(is_level="token")),
    (dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"),
     dict(is_level="token", is_cap=1.5)),
]


@pytest.mark.parametrize("corr,core", CORRECTIONS, ids=[str(i) for i in range(len(CORRECTIONS))])
def test_rollout_correction_decoupled_equals_core(monkeypatch, corr, core):
    """``algorithm.rollout_correction`` in decoupled mode: verl's driver (``compute_rollout_correction_and_add_to_batch``
    with verl's ``RolloutCorrectionConfig``) turns pi_old vs mu into ``rollout_is_weights`` and a
    rejected-token ``response_mask``; the engine step with the top-K loss then equals
    ``pdmask.policy_loss`` with the corresponding IS keywords, on the rejected mask (verl drops a
    rejected token from the denominators). pi_old = pi here (the first update of a batch), so
    verl's weights are the core's weights on the same tensors. Without weights (rollout_is null)
    the loss keeps the mask's own min(pi/mu, C)."""
    from verl import DataProto
    from tensordict import TensorDict
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.workers.utils.losses import ppo_loss

    model, prompts, responses, fields, adv = _build(seed=1, mode_shift=0.6)
    mode, name = "pdm-topk-kl", "pdmask_pdm_topk_kl"
    base = _reference(model, prompts, responses, fields, adv.float().double(), mode, "exact")
    valid = torch.zeros_like(base.stats["log_ratio"], dtype=torch.bool)
    for b, r in enumerate(responses):
        valid[b, :len(r)] = True
    rlp = torch.zeros(valid.shape, dtype=torch.float64)
    for b, f in enumerate(fields):
        rlp[b, :len(responses[b])] = torch.as_tensor(f["pdmask_sampled_logprobs"], dtype=torch.float64)
    old = torch.where(valid, rlp + base.stats["log_ratio"].detach(), torch.zeros_like(rlp))  # pi_old = pi
    dp = DataProto(batch=TensorDict({"old_log_probs": old, "rollout_log_probs": rlp,
                                     "response_mask": valid.long()}, batch_size=len(prompts)))
    dp, _ = compute_rollout_correction_and_add_to_batch(dp, RolloutCorrectionConfig(**corr))
    kept = dp.batch["response_mask"].bool()
    extra = {}
    if "rollout_is_weights" in dp.batch.keys():
        extra["rollout_is_weights"] = dp.batch["rollout_is_weights"]
    assert ("rollout_is_weights" in extra) == (corr["rollout_is"] is not None)

    mb = _micro_batch(prompts, responses, fields, adv, use_remove_padding=True, response_mask=kept, extra=extra)
    loss, out = _engine(monkeypatch, model).forward_step(
        mb, loss_function=partial(ppo_loss, config=actor_config(loss_mode=name)), forward_only=False)
    grads = torch.autograd.grad(loss, [model.E, model.Pe])
    ref = _reference(model, prompts, responses, fields, adv.float().double(), mode, "exact", response_mask=kept,
                     **core)
    ref_grads = torch.autograd.grad(ref.loss, [model.E, model.Pe])
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-9)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-9)
    # the correction bites on this batch (otherwise the test could not tell it was applied)
    if corr.get("rollout_rs"):
        assert 0 < int((~kept & valid).sum()) < int(valid.sum())
    if corr["rollout_is"] is not None:
        w = extra["rollout_is_weights"][valid]
        lr = base.stats["log_ratio"][valid]
        assert not torch.allclose(w.double(), lr.exp().clamp(max=5.0)), "verl's weight must differ from min(r, C)"
