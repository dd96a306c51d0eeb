"""The built-in trainer carries the smooth modes (drpo, spo, pdm-smooth-*) and grpo's dual clip:
its batch loss equals ``pdmask.policy_loss`` with the config's settings on the same logits."""

import pytest
import torch

import pdmask
from pdmask.engine.hf import HFEngine, response_logits
from pdmask.train.config import load_config
from pdmask.train.update import compute_loss
from pdmask.train.model import build_model


BASE = ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64", "temperature=0.7",
        "engine_precision=fp32"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, BASE)
    model = build_model(cfg, 97, pad_id=0, eos_id=1, seed=0)
    eng = HFEngine(model, eos_id=1, pad_id=0, precision="fp32", temperature=0.7, top_k_logprobs=20)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (6,), generator=g)]
    batch = eng.generate(prompts, max_new_tokens=8, seed=0)
    with torch.no_grad():  # the trainer moves away from the engine: an off-policy batch
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return cfg, model, batch, torch.linspace(-1.5, 1.5, 6)


@pytest.mark.parametrize("over", [["mode=drpo", "delta_low=0.02", "delta_high=0.02"], ["mode=spo"],
                                  ["mode=pdm-smooth-topk-kl", "delta_low=1e-3", "delta_high=1e-3"],
                                  ["mode=grpo", "dual_clip=1.5", "is_mask=true", "is_floor=0.5", "is_cap=3"]])
def test_trainer_loss_is_the_core_loss(setup, over):
    _, model, batch, adv = setup
    cfg = load_config(None, BASE + over)
    model.zero_grad()
    out = compute_loss(model, batch, adv, cfg, validate=True)
    out.loss.backward()
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = response_logits(model, batch.sequences, batch.attention_mask, batch.prompt_len)
    f = cfg.loss_fields  # the config's values, built into specs here independently of the trainer
    th = pdmask.Thresholds(**f["thresholds"])
    corr = pdmask.Corrections(**f["corrections"])
    ref = pdmask.policy_loss(logits, batch.rollout, adv, mode=f["mode"], thresholds=th, corrections=corr,
                             sampling=pdmask.Sampling(f["sampling"]["temperature"]))
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-8)
    for a, p in zip(g, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)
    if cfg.loss.mode != "grpo":
        assert float(out.metrics["masked_frac"]) == 0.0 and float(out.metrics["corrective_frac"]) > 0
