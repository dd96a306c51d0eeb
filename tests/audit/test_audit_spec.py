"""The audit's batch step uses the trainer's whole loss spec (or refuses, in one line, what
it cannot honour); its optimizer defaults are the trainer's; seeds audited with the flat
settings of older versions keep resuming."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import yaml

import pdmask
from audit_toy import BigramLM, bigram_forward, perturbed, sample_batch
from pdmask_lab.audit import AuditConfig
from pdmask_lab.audit.cli import audit_command
from pdmask_lab.audit.command import _configs, _fingerprint, _with_new_defaults
from pdmask_lab.audit.steps import step_loss
from pdmask.train.update import ADAMW_BETAS

ROOT = Path(__file__).resolve().parents[2]


def _args(**kw) -> dict:
    """The audit command's arguments at their defaults (typer's), then ``kw``."""
    a = {name: p.default.default for name, p in inspect.signature(audit_command).parameters.items()}
    a.update(kw)
    return a


def test_the_optimizer_defaults_are_the_trainers():
    assert AuditConfig().betas == ADAMW_BETAS == (0.9, 0.99)


def test_the_batch_step_takes_the_trainers_whole_loss_spec():
    set_ = ["is_level=sequence", "is_mask=true", "is_floor=0.2", "rejection=token_k3", "rejection_threshold=2",
            "off_policy_mask_threshold=0.5", "loss_agg=seq-mean-token-mean", "eps_high=0.3", "temperature=0.9"]
    tcfg, cfg = _configs(_args(set_=set_, delta=0.01, step_mode="dppo-topk-kl"))
    c = cfg.loss.corrections
    assert (c.is_level, c.is_mask, c.is_floor, c.rejection, c.off_policy_mask_threshold) == (
        "sequence", True, 0.2, "token_k3", 0.5)
    assert cfg.loss.aggregation.loss_agg == "seq-mean-token-mean" and cfg.loss.thresholds.eps_high == 0.3
    assert cfg.loss.sampling.temperature == 0.9 == cfg.temperature
    assert cfg.loss.mode == "dppo-topk-kl" and cfg.loss.thresholds.delta_low == 0.01
    # and the step computes with it: the rules' and the off-policy mask's metrics are there
    pol = BigramLM(vocab=12, dim=8)
    rb, adv = sample_batch(perturbed(pol, 0.3), seed=0)
    A = adv[:, None].expand_as(rb.response_mask).float()
    out = step_loss(bigram_forward(pol, rb.sequences, rb.attention_mask, rb.prompt_len), rb, A, cfg)
    for key in ("masked_frac_is", "masked_frac_rs_token_k3", "masked_frac_opsm"):
        assert key in out.metrics, key


def test_the_region_deltas_come_from_the_audit_then_the_trainer_then_the_divergence():
    assert _configs(_args())[1].loss.thresholds.delta_low == 0.05  # topk_kl's default
    assert _configs(_args(divergence="topk_tv"))[1].loss.thresholds.delta_high == 0.15
    _, cfg = _configs(_args(set_=["delta_low=0.02"]))
    assert (cfg.loss.thresholds.delta_low, cfg.loss.thresholds.delta_high) == (0.02, 0.05)
    _, cfg = _configs(_args(set_=["delta_low=0.02"], delta=0.3, delta_high=0.4))
    assert (cfg.loss.thresholds.delta_low, cfg.loss.thresholds.delta_high) == (0.3, 0.4)


@pytest.mark.parametrize("kw, msg", [
    (dict(set_=["sampling_top_k=5"]), r"^loss\.sampling: truncated sampling cannot be audited"),
    (dict(set_=["loss_from=hidden"]), r"^loss_from: the audit's steps and oracle read the logits"),
    (dict(step_mode="pdm-batch-topk-kl"), r"^step_mode: 'pdm-batch-topk-kl' needs an external batch direction"),
    (dict(step_mode="nope"), r"^step_mode: unknown value 'nope'"),
    (dict(set_=["mode=grpo", "dual_clip=3"]), r"^dual_clip: applies to the ppo-clip surrogate"),
])
def test_what_the_audit_cannot_honour_is_refused_in_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _configs(_args(**kw))


def test_the_leave_one_out_step_refuses_a_batch_normalised_weight():
    from pdmask_lab.audit.loo import BatchStep

    pol = BigramLM(vocab=12, dim=8)
    rb, adv = sample_batch(perturbed(pol, 0.3), seed=0)
    cfg = AuditConfig(loss=pdmask.PolicyLoss(mode="none", corrections=pdmask.Corrections(is_batch_normalize=True)))
    with pytest.raises(ValueError, match=r"^loss\.corrections\.is_batch_normalize: the leave-one-out step"):
        BatchStep(pol, bigram_forward, rb, adv[:, None].expand_as(rb.response_mask).double(), cfg)


def test_seeds_of_the_flat_settings_resume(tmp_path):
    """A committed audit's seeds/settings.json, written with the flat audit and trainer
    settings (step_mode, delta_low, is_cap: 5.0, ...), is the same fingerprint as its
    command's today."""
    d = ROOT / "docs/results/real-lm/audit-fp8-lag2/seeds"
    old = json.loads((d / "settings.json").read_text())
    assert "delta_low" in old["audit"] and "loss" not in old["audit"]  # the flat version
    config = tmp_path / "trainer.yaml"  # the trainer settings the seeds were audited with (flat keys)
    config.write_text(yaml.safe_dump(old["trainer"]))
    a = _args(config=config, precision="fp8", lag=2, seeds=46, delta=5e-3, delta_sweep="1e-2,2e-2",
              sample_tokens=2, disagreement_tokens=4, instruments="param,precond,own", progress=False)
    fp = _fingerprint(a, *_configs(a))
    assert _with_new_defaults(old, fp) == fp
    # another setting is a difference
    for change in (dict(delta=1e-2), dict(set_=["is_level=sequence"]), dict(step_mode="dppo-topk-kl")):
        b = dict(a, **change)
        assert _with_new_defaults(old, _fingerprint(b, *_configs(b))) != _fingerprint(b, *_configs(b)), change
