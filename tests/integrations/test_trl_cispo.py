"""The TRL plugin's ``loss_type="cispo"`` against TRL 1.16's own ``GRPOTrainer._compute_loss`` with
``loss_type="cispo"`` (the installed package, on the same trainer, model and batch;
``trl/trainer/grpo_trainer.py:3109-3111``, ``:3168-3173``): with ``mask_mode="none"`` the loss and
its gradients are TRL's; the mapping is ``none`` with ``Corrections(is_cap=epsilon_high)`` and the
``dapo`` aggregation (the restatement without TRL: tests/core/test_cispo.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
sys.path.insert(0, str(Path(__file__).parent))
import trl_helpers as H  # noqa: E402
from test_trl_peer import _batch, _loss_and_grads  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

from pdmask.integrations.trl import GRPOTrainer, options  # noqa: E402


@pytest.mark.parametrize("eps_high", [1.3, 2.0])  # below the batch's largest ratio (3.0): the cap binds
def test_cispo_with_no_mask_equals_trls_own_loss(tmp_path, eps_high):
    tr = H.make_trainer(tmp_path, cls=GRPOTrainer, mask_mode="none", rollout_top_k=0, loss_type="cispo",
                        epsilon_high=eps_high, bf16=False)
    spec = options.loss_spec(tr.args)
    assert (spec.mask_mode.name, spec.corrections.is_cap, spec.corrections.is_floor) == ("none", eps_high, None)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    inputs, r = _batch(tr)
    theirs, g_theirs, _ = _loss_and_grads(lambda m, x: TRLGRPOTrainer._compute_loss(tr, m, x), tr, inputs)
    ours, g_ours, _ = _loss_and_grads(tr._compute_loss, tr, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert len(g_ours) == len(g_theirs) > 0
    for a, b in zip(g_ours, g_theirs):  # two float32 graphs: see test_trl_peer.py
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    m = inputs["completion_mask"].bool()
    assert bool((r[m] > eps_high).any()), "the batch must reach the cap or the cap is not tested"


def test_cispo_under_a_mask_and_the_refusals(tmp_path):
    cfg = H.config(tmp_path, mask_mode="pdm-topk-kl", loss_type="cispo", epsilon_high=4.0)
    assert options.loss_spec(cfg).corrections.is_cap == 4.0
    for kw, msg in [(dict(mask_mode="grpo"), "differentiates its ratio"), (dict(mask_mode="cispo"), "verl|own IS"),
                    (dict(is_cap=2.0), "would set another")]:
        with pytest.raises(ValueError, match=f"^loss_type: .*({msg})"):
            H.config(tmp_path, loss_type="cispo", **kw)
