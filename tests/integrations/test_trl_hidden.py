"""loss_from_hidden=True: the TRL trainer's loss from the final hidden states and lm_head.weight
(pdmask.policy_loss_from_hidden inside the model's forward) equals the logits path's loss and
parameter gradients, never runs the LM head, and refuses heads that are not hidden @ W.T."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import trl_helpers as H  # noqa: E402
from tiny_lm import tiny_model  # noqa: E402


class Twin(H.GRPOTrainer):
    """On every micro-batch: the hidden-path loss (the one trained on) with the LM head's forward
    made to raise, then the logits path's loss on the same inputs; both with their gradients."""

    def __init__(self, *a, **kw):
        self.pairs = []
        super().__init__(*a, **kw)

    def _compute_loss(self, model, inputs):
        head = self.accelerator.unwrap_model(model).lm_head
        params = [p for p in model.parameters() if p.requires_grad]

        def no_logits(*_a, **_k):
            raise AssertionError("the LM head ran (a (B, T, V) logits tensor) on the hidden path")

        head.forward = no_logits
        try:
            loss_h = super()._compute_loss(model, inputs)
        finally:
            del head.forward
        g_h = torch.autograd.grad(loss_h, params, retain_graph=True)
        self.args.loss_from_hidden = False
        try:
            loss_l = super()._compute_loss(model, inputs)
        finally:
            self.args.loss_from_hidden = True
        g_l = torch.autograd.grad(loss_l, params)
        self.pairs.append((loss_h.detach(), loss_l.detach(), g_h, g_l))
        return loss_h


@pytest.mark.parametrize("mode,loss_type", [("dppo-topk-kl", "dapo"), ("pdm-topk-kl", "grpo")])
def test_hidden_equals_logits_loss_and_grads(tmp_path, mode, loss_type):
    # float32 (TRL's GRPOConfig defaults to bf16 autocast, also on CPU: see the bf16 test below);
    # small deltas so the mask fires on the second (off-policy) micro-batch; K = 4 of V = 24
    tr = H.make_trainer(tmp_path, cls=Twin, mask_mode=mode, loss_type=loss_type, loss_from_hidden=True,
                        rollout_top_k=4, mask_delta_low=1e-3, mask_delta_high=1e-3, bf16=False)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert len(tr.pairs) == 2
    for loss_h, loss_l, g_h, g_l in tr.pairs:
        assert torch.isfinite(loss_h) and loss_h.abs() > 0
        torch.testing.assert_close(loss_h, loss_l, atol=1e-6, rtol=1e-5)
        assert any(g.abs().sum() > 0 for g in g_h)
        for a, b in zip(g_h, g_l):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    # the lm_head weight gets its gradient through the hidden path, and the step moves it
    head_i = [i for i, (n, _) in enumerate(tr.model.named_parameters()) if n == "lm_head.weight"][0]
    assert tr.pairs[0][2][head_i].abs().sum() > 0
    assert not torch.equal(before[head_i], tr.model.lm_head.weight)
    logs = [h for h in tr.state.log_history if "pdmask/kept_frac" in h]
    assert logs and any(h["pdmask/kept_frac"] < 1.0 for h in logs), "the mask never fired off-policy"


def test_hidden_under_bf16_autocast(tmp_path):
    # TRL's default bf16=True autocasts both paths' head matmuls to bf16; the two round differently
    # in the backward (chunked recompute vs one matmul), so gradients agree to bf16 precision only
    tr = H.make_trainer(tmp_path, cls=Twin, mask_mode="pdm-topk-kl", loss_type="dapo", loss_from_hidden=True,
                        max_steps=1)
    assert tr.args.bf16
    tr.train()
    for loss_h, loss_l, g_h, g_l in tr.pairs:
        torch.testing.assert_close(loss_h, loss_l, atol=1e-4, rtol=1e-2)
        for a, b in zip(g_h, g_l):
            assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6


def _with_bias():
    m = tiny_model()
    m.lm_head.bias = torch.nn.Parameter(torch.zeros(m.lm_head.out_features))
    return m


def _with_softcap():
    m = tiny_model()
    m.config.final_logit_softcapping = 30.0
    return m


def _with_scale():
    m = tiny_model()
    m.config.logit_scale = 0.5
    return m


@pytest.mark.parametrize("make,what", [(_with_bias, "bias"), (_with_softcap, "final_logit_softcapping"),
                                       (_with_scale, "logit_scale")])
def test_refuses_heads_that_are_not_a_matmul(tmp_path, make, what):
    with pytest.raises(ValueError, match=f"^loss_from_hidden: .*{what}") as e:
        H.make_trainer(tmp_path, model=make(), mask_mode="pdm-topk-kl", loss_from_hidden=True)
    assert "\n" not in str(e.value)
    H.make_trainer(tmp_path, model=make(), mask_mode="pdm-topk-kl")  # the logits path takes them


def test_refuses_replaced_head(tmp_path):
    m = tiny_model()

    class Head(torch.nn.Linear):  # e.g. a PEFT adapter layer wrapping lm_head
        pass

    old = m.lm_head
    m.lm_head = Head(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError, match="^loss_from_hidden: the LM head is a Head"):
        H.make_trainer(tmp_path, model=m, loss_from_hidden=True)


def test_cast_lm_head_to_fp32_matches_logits(tmp_path):
    # TRL casts lm_head to float32 and patches its forward; the hidden path computes in float32 too
    tr = H.make_trainer(tmp_path, cls=Twin, mask_mode="pdm-topk-kl", loss_type="bnpo", loss_from_hidden=True,
                        cast_lm_head_to_fp32=True, max_steps=1, bf16=False)
    tr.train()
    assert tr.pairs
    for loss_h, loss_l, g_h, g_l in tr.pairs:
        torch.testing.assert_close(loss_h, loss_l, atol=1e-6, rtol=1e-5)
        for a, b in zip(g_h, g_l):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_two_processes_gloo_hidden(tmp_path):
    """torchrun --nproc_per_node 2 (gloo, DDP): the hidden path's loss runs through the wrapper's forward,
    every rank's loss equals the logits-path reference, and DDP keeps the (moved) weights in sync."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE)]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(28500 + os.getpid() % 1000),
           str(HERE / "trl_ddp_run.py"), str(tmp_path), "hidden"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2]
    assert res[0]["param_sum"] == pytest.approx(res[1]["param_sum"], abs=0, rel=0)  # DDP-synced weights
    assert res[0]["param_sum"] != pytest.approx(res[0]["param_sum_before"], abs=1e-9)  # and they moved
    assert res[0]["local_completions"] != res[1]["local_completions"]
    for r in res:
        assert r["n_steps_logged"] == 2 and all(r["loss_matches"])
