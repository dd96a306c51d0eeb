"""The pdmask trainer's ``grpo`` mode against TRL 1.16's own ``GRPOTrainer._compute_loss`` (the
installed package, called on the same trainer, model and batch), for TRL's four loss types with
and without TRL's two-sided clip ``delta``; and the one documented difference in the metrics:
pdmask's ``clip_ratio/low_mean`` also counts the tokens the dual clip zeroes, TRL's does not."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
sys.path.insert(0, str(Path(__file__).parent))
import trl_helpers as H  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

from pdmask.integrations.trl import GRPOTrainer  # noqa: E402

#: ratios pi/mu the batch is built with: each on one side of every clip boundary (1 - 0.2,
#: 1 + 0.28, delta = 2), far from it, so rounding (TRL's fused head vs the logits) cannot cross one
RATIOS = (0.5, 0.9, 1.1, 1.5, 3.0, 0.7, 2.5, 1.0)


def _batch(tr, seed=0, B=4, P=3, T=5):
    g = torch.Generator().manual_seed(seed)
    V = tr.model.config.vocab_size
    prompt_ids = torch.randint(2, V, (B, P), generator=g)
    completion_ids = torch.randint(2, V, (B, T), generator=g)
    lengths = torch.tensor([5, 3, 1, 4])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": completion_mask,
              "advantages": torch.tensor([1.3, -0.7, 0.4, -1.9])}
    with torch.no_grad():  # log pi_k at the generator's temperature, then mu_k = pi_k / r
        logits, _ = tr._completion_logits(tr.model, inputs)
        logp = torch.log_softmax(logits.float() / tr.temperature, -1).gather(-1, completion_ids[..., None])[..., 0]
    r = torch.tensor(RATIOS * (B * T // len(RATIOS) + 1))[: B * T].reshape(B, T)
    mu = logp - r.log()
    inputs.update(sampled_logprob=mu, old_per_token_logps=mu, num_items_in_batch=completion_mask.sum())
    return inputs, r


def _loss_and_grads(fn, tr, inputs):
    tr.model.zero_grad()
    tr._metrics["train"].clear()
    loss = fn(tr.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in tr.model.parameters() if p.grad is not None]
    return loss.detach(), grads, {k: v[-1] for k, v in tr._metrics["train"].items() if v}


@pytest.mark.parametrize("delta", [None, 2.0])
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_grpo_mode_equals_trls_own_loss(tmp_path, loss_type, delta):
    tr = H.make_trainer(tmp_path, cls=GRPOTrainer, mask_mode="grpo", rollout_top_k=0, loss_type=loss_type,
                        delta=delta, epsilon_high=0.28, bf16=False)  # float32: no bf16 autocast rounding
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    inputs, r = _batch(tr)
    theirs, g_theirs, m_theirs = _loss_and_grads(lambda m, x: TRLGRPOTrainer._compute_loss(tr, m, x), tr, inputs)
    ours, g_ours, m_ours = _loss_and_grads(tr._compute_loss, tr, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert len(g_ours) == len(g_theirs) > 0
    for a, b in zip(g_ours, g_theirs):
        # two float32 graphs (TRL's fused log-prob head, pdmask's logits): each entry is a sum of
        # O(100) float32 products, so they agree to ~1e2 * 2^-24 of the largest entry, not per entry
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    # TRL's clip metrics: equal, except that pdmask's low_mean (A < 0) also counts the dual clip
    m = inputs["completion_mask"].bool()
    adv = inputs["advantages"][:, None].expand_as(m)
    dual = (adv < 0) & (r > (delta if delta is not None else math.inf)) & m
    n = int(m.sum())
    assert m_ours["clip_ratio/high_mean"] == pytest.approx(m_theirs["clip_ratio/high_mean"], abs=1e-6)
    assert m_ours["clip_ratio/low_mean"] == pytest.approx(m_theirs["clip_ratio/low_mean"] + int(dual.sum()) / n,
                                                          abs=1e-6)
    if delta is not None:
        assert bool(dual.any()), "the batch must hit the dual clip or the difference is not shown"
        assert m_ours["clip_ratio/low_mean"] > m_theirs["clip_ratio/low_mean"]
