"""``beta != 0``: TRL's KL term to the reference model, added as TRL 1.16 adds it.

- against plain TRL: on every micro-batch of two steps (the second off-policy), TRL's own
  ``GRPOTrainer._compute_loss`` on the same weights and inputs gives the pdmask trainer's
  loss with the mask off (``mask_mode="grpo"``: TRL's clipped objective, equal values and
  gradients; ``"none"``: the IS-weighted policy gradient, equal gradients while TRL clips
  no ratio) and the same logged ``kl``;
- against an independent computation (the Probe trainer: its own forwards of the policy and
  of the reference model) on left-padded prompts, with and without
  ``use_bias_correction_kl``, in the loss types whose normalisers differ, and on the
  hidden-state path (``loss_from_hidden``);
- the reference log-probs are counted with the loss's positions: at the first step, where
  the reference equals the policy, the KL is 0 on left-padded rows too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import trl_helpers as H  # noqa: E402
from datasets import Dataset  # noqa: E402

#: prompts of one length (4 tokens): no left padding, so TRL's forwards (which pass no position
#: ids) and pdmask's (which count positions from the first real token) see the same positions
SAME_LENGTH = [f"say {x} {y} :" for x, y in zip("abcdefgh", "hgfedcba")]
COMMON = dict(use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=2,
              num_iterations=2, logging_steps=1, save_strategy="no", report_to="none", temperature=0.8,
              disable_tqdm=True, seed=0, beta=0.1, loss_type="dapo", bf16=False)  # float32: exact comparisons


def saved_model(tmp_path):
    """The tiny model loaded from a directory: TRL builds the reference model from the policy's
    ``_name_or_path``, which a model built in memory does not have."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "model"
    if not d.exists():
        H.tiny_model().save_pretrained(d)
    return AutoModelForCausalLM.from_pretrained(d)


class AgainstTRL(H.GRPOTrainer):
    """On every micro-batch, also runs plain TRL's own ``_compute_loss`` (``trl.GRPOTrainer``'s
    code, unbound) on the same weights and inputs, and records both losses, their gradients
    and TRL's logged metrics (which are then taken back out of the logs).

    TRL's old-log-prob forward is kept (``_pdmask_skip_old_logps = False``) so that TRL's
    objective gets exactly its own inputs; its ratio's anchor is its recomputed
    ``old_per_token_logps``, the pdmask trainer's the generator's mu: on the same weights on
    a CPU they agree to float rounding."""

    _pdmask_skip_old_logps = False

    def __init__(self, *a, **kw):
        self.records = []
        super().__init__(*a, **kw)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        before = {k: list(v) for k, v in self._metrics[mode].items()}
        trl_loss = trl.GRPOTrainer._compute_loss(self, model, inputs)
        trl_metrics = {k: v[-1] for k, v in self._metrics[mode].items() if len(v) > len(before.get(k, []))}
        self._metrics[mode].clear()
        self._metrics[mode].update(before)
        params = [p for p in model.parameters() if p.requires_grad]
        g_ours = torch.autograd.grad(loss, params, retain_graph=True)  # the graph is used again by backward
        g_trl = torch.autograd.grad(trl_loss, params)
        self.records.append({"loss": loss.detach().clone(), "trl_loss": trl_loss.detach(), "g": g_ours,
                             "g_trl": g_trl, "trl_metrics": trl_metrics,
                             "old_logps": "old_per_token_logps" in inputs})
        return loss


#: grpo: a large step (most second-pass tokens clipped, ratios above 5), with the plugin's
#: defaults: no dual clip unless delta or is_cap is set, as TRL's delta=None (docs/trl.md "What
#: differs from plain TRL"): the same values and gradients. none: the IS-weighted policy gradient, whose value is not TRL's
#: but whose gradient is while TRL clips no ratio: a small step.
CASES = {"grpo": dict(learning_rate=1e-2), "none": dict(learning_rate=1e-5)}


@pytest.mark.parametrize("mode", CASES)
def test_beta_equals_plain_trl_with_the_mask_off(tmp_path, mode):
    args = H.GRPOConfig(output_dir=str(tmp_path / "pdm"), mask_mode=mode, rollout_top_k=0, **{**COMMON, **CASES[mode]})
    tr = AgainstTRL(model=saved_model(tmp_path), reward_funcs=H.reward_letter_a, args=args,
                    train_dataset=Dataset.from_dict({"prompt": SAME_LENGTH}), processing_class=H.tiny_tokenizer())
    assert tr.ref_model is not None
    tr.train()
    assert len(tr.records) == 2 and tr.records[1]["old_logps"]  # the second pass is off-policy (TRL's own anchor)
    logs = [h for h in tr.state.log_history if "kl" in h]
    assert len(logs) == 2
    for rec, h in zip(tr.records, logs, strict=True):
        if mode == "grpo":  # TRL's objective itself: the values agree, not only the gradients
            torch.testing.assert_close(rec["loss"], rec["trl_loss"], atol=1e-6, rtol=1e-5)
        for a, b in zip(rec["g"], rec["g_trl"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert h["kl"] == pytest.approx(rec["trl_metrics"]["kl"], rel=1e-5, abs=1e-7)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy
    assert logs[1]["kl"] > 1e-5, "the policy never left the reference: the KL term is untested"
    clipped = tr.records[1]["trl_metrics"]["clip_ratio/region_mean"]
    if mode == "none":  # the same gradient as TRL's only while TRL clips no ratio ("none" has no clip)
        assert clipped == 0.0
    else:  # the clip and the KL term both acted on the off-policy step
        assert clipped > 0.1


@pytest.mark.parametrize("loss_type,bias,hidden", [("dapo", False, False), ("grpo", True, False),
                                                  ("dr_grpo", False, True), ("bnpo", True, False)])
def test_beta_matches_an_independent_computation(tmp_path, loss_type, bias, hidden):
    args = H.config(tmp_path, mask_mode="pdm-topk-kl", beta=0.2, use_bias_correction_kl=bias, loss_type=loss_type,
                    loss_from_hidden=hidden,
                    num_iterations=2, steps_per_generation=1, mask_delta_low=1e-3, mask_delta_high=1e-3,
                    learning_rate=3e-2, per_device_train_batch_size=8)  # two prompts per batch: left padding
    tr = H.Probe(model=saved_model(tmp_path), reward_funcs=H.reward_letter_a, args=args,
                 train_dataset=Dataset.from_dict({"prompt": H.prompts(8)}), processing_class=H.tiny_tokenizer())
    tr.train()
    assert len(tr.records) == 2 and tr.records[0]["on_policy"] and not tr.records[1]["on_policy"]
    for rec in tr.records:  # the Probe adds beta x k3 from its own forwards of the policy and ref_model
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    first, second = tr.records
    m = first["mask"]
    assert bool((first["inputs"]["prompt_mask"] == 0).any()), "no left padding: the position check is vacuous"
    # step 1: the reference is the policy, so its log-probs (TRL's forward, with the loss's positions)
    # equal the policy's and the KL is 0 -- on the left-padded rows too
    lq = torch.log_softmax(first["logits"] / args.temperature, -1)
    lp = lq.gather(-1, first["inputs"]["completion_ids"][..., None]).squeeze(-1)
    torch.testing.assert_close(first["inputs"]["ref_per_token_logps"][m], lp[m], atol=2e-5, rtol=0)
    assert float(first["kl"][m].abs().max()) < 1e-8
    assert float(second["kl"][second["mask"]].max()) > 1e-6  # one update later it is not
    logs = [h for h in tr.state.log_history if "kl" in h]
    assert len(logs) == 2 and logs[0]["kl"] < 1e-8 < logs[1]["kl"]
    assert logs[1]["pdmask/kept_frac"] < 1.0, "the mask never acted next to the KL term"
