"""The verl plugin's once-per-run region warning and start-of-step quantiles (issue 44 item 4),
runnable without verl (``pdmask.integrations.verl.losses`` imports it only to register): the
losses are called as verl calls them, inside the pdmask engine's update index
(:func:`pdmask.integrations.verl.losses.update_index`). The check is made once per process, on
the first micro-batch at update index 1 (docs/verl.md); the expected numbers are restated
here from the binary TV ``|pi_k - pi_old_k|`` and ``torch.quantile``."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from pdmask.anchor import SUGGESTED_OUT_SHARE, WARN_OUT_BEFORE_UPDATE
from pdmask.integrations.verl import binding
from pdmask.integrations.verl.losses import make_policy_loss, update_index

F64 = torch.float64
QS = torch.tensor([0.5, 0.9, 1 - SUGGESTED_OUT_SHARE], dtype=F64)


def _cfg(delta):  # the fields a pdmask verl loss reads of verl's actor config
    return types.SimpleNamespace(clip_ratio_low=delta, clip_ratio_high=delta, clip_ratio=delta, clip_ratio_c=3.0,
                                 global_batch_info={}, loss_agg_mode="token-mean")


def _batch(noise):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 6, generator=g, dtype=F64) * 2 - 0.05
    old = (lp + noise * torch.randn(3, 6, generator=g, dtype=F64)).clamp(max=0.0)
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, 6).clone()
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[2, 4:] = False
    return lp, old, adv, mask


def _calls(fn, batches, us, delta):
    """The loss on each batch at its update index; the region warnings it raised."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for (lp, old, adv, mask), u in zip(batches, us, strict=True):
            with update_index(u):
                fn(old_log_prob=old, log_prob=lp.clone().requires_grad_(True), advantages=adv, response_mask=mask,
                   loss_agg_mode="token-mean", config=_cfg(delta))
    return [str(w.message) for w in got if "out of region before any update" in str(w.message)]


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not made its region check yet."""
    monkeypatch.setitem(binding._REGION_CHECKED, "done", False)


def test_the_first_update_index_1_warns_once_with_its_numbers(fresh):
    lp, old, adv, mask = b = _batch(0.3)
    delta = 1e-4
    msgs = _calls(make_policy_loss("dppo-binary-tv"), [b, b, b, b], [2, 1, 2, 1], delta)
    assert len(msgs) == 1, msgs
    tv = (lp.exp() - old.exp()).abs()[mask]
    q50, q90, sug = torch.quantile(tv, QS).tolist()
    out = float(((tv > delta) & (adv[mask] != 0)).double().mean())
    assert out > WARN_OUT_BEFORE_UPDATE
    for part in (f"{out:.1%}", "delta = 0.0001/0.0001", f"q50 {q50:.3g}", f"q90 {q90:.3g}", f"delta ~ {sug:.3g}",
                 "log_prob_micro_batch_size_per_gpu"):
        assert part in msgs[0], (part, msgs[0])


def test_a_quiet_first_check_is_the_only_one(fresh):
    """Checked once per process: a first micro-batch at u = 1 inside its region silences the run
    (one host sync per run), even if a later start would warn."""
    quiet, loud = _batch(0.0), _batch(0.3)
    fn = make_policy_loss("dppo-binary-tv")
    assert _calls(fn, [quiet, loud, loud], [1, 1, 1], 1e-4) == []
    assert binding._REGION_CHECKED["done"]


def test_no_update_index_no_check(fresh):
    """Bypass mode (no old-log-prob pass: no update index) and later updates are never checked."""
    loud = _batch(0.3)
    assert _calls(make_policy_loss("dppo-binary-kl"), [loud, loud], [None, 3], 1e-4) == []
    assert not binding._REGION_CHECKED["done"]


def test_start_quantiles_of_the_anchor_distance_at_update_index_1():
    g = torch.Generator().manual_seed(1)
    dist = torch.rand(4, 5, generator=g, dtype=F64) ** 2
    valid = torch.rand(4, 5, generator=g) > 0.25
    adv = torch.randn(4, 5, generator=g, dtype=F64)
    out = types.SimpleNamespace(mask=torch.ones(4, 5, dtype=torch.bool),
                                metrics={"out_of_region_frac": torch.tensor(0.0), "masked_frac": torch.tensor(0.0)})
    spec = types.SimpleNamespace(thresholds=types.SimpleNamespace(delta_low=0.1, delta_high=0.1))
    m = binding.binding_metrics(out, spec, adv, valid, dist.requires_grad_(True), 1)
    q50, _, sug = torch.quantile(dist.detach()[valid], QS)
    torch.testing.assert_close(m["start_divergence_q50"], q50, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(m["start_divergence_suggested_delta"], sug, rtol=1e-9, atol=1e-15)
    assert all(not v.requires_grad for v in m.values())
    later = binding.binding_metrics(out, spec, adv, valid, dist, 2)
    assert not any(k.startswith("start_") for k in later)
