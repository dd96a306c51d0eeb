"""The trainer's batch loss: one forward + policy_loss, slicing, temperature wiring."""

import pytest
import torch

import pdmask

from pdmask.engine.base import RolloutBatch
from pdmask.engine.hf import HFEngine
from pdmask.train.config import load_config
from pdmask.train.grpo import step_prompts
from pdmask.train.update import compute_loss, select
from pdmask.train.model import build_model


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64",
                             "temperature=0.7", "engine_precision=fp32"])
    model = build_model(cfg, 97, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # tied: sharper distributions than the default init
    eng = HFEngine(model, eos_id=1, pad_id=0, precision="fp32", temperature=0.7, top_k_logprobs=20)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    batch = eng.generate(prompts, max_new_tokens=10, seed=0)
    adv = torch.linspace(-1.5, 1.5, 8)
    return cfg, model, batch, adv


def _plain_rows(b: RolloutBatch, idx):
    ix = torch.tensor(idx)
    r = b.rollout
    return RolloutBatch(b.sequences[ix], b.attention_mask[ix], b.prompt_len,
                        pdmask.Rollout(r.sampled_ids[ix], r.sampled_logprob[ix], r.topk_ids[ix], r.topk_logprobs[ix],
                                       r.response_mask[ix]))


def test_select_trims_padding_without_changing_loss_or_grad(setup):
    cfg, model, b, adv = setup
    idx = [1, 4, 6]
    plens = b.attention_mask[:, :b.prompt_len].sum(1).tolist()
    rlens = b.response_mask.sum(1).tolist()
    sub = select(b, idx, plens, rlens)
    assert sub.sequences.shape[1] <= b.sequences.shape[1]
    assert sub.response_mask.any(0).all()  # no all-padding response column left
    assert sub.attention_mask[:, 0].any()  # no all-padding prompt column left
    outs = []
    for bb in (sub, _plain_rows(b, idx)):
        model.zero_grad()
        out = compute_loss(model, bb, adv[idx], cfg, validate=True)
        out.loss.backward()
        outs.append((out.loss.detach(), model.lm_head.weight.grad.clone(), out.metrics["num_tokens"]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-7)
    assert outs[0][2] == outs[1][2] == sum(rlens[i] for i in idx)
    assert outs[0][1].abs().sum() > 0


def test_temperature_is_passed_to_the_loss(setup):
    """The engine samples at T = 0.7; with cfg.temperature = 0.7 an fp32 engine at lag 0 has
    ratio 1; a loss evaluated at T = 1 would see a large, spurious mismatch."""
    cfg, model, b, adv = setup
    out = compute_loss(model, b, adv, cfg, validate=True)
    assert abs(out.metrics["ratio_mean"] - 1) < 1e-4 and out.metrics["divergence_max"] < 1e-5
    assert out.metrics["masked_frac"] == 0
    wrong = load_config(None, ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64",
                               "temperature=1.0"])
    out1 = compute_loss(model, b, adv, wrong, validate=True)
    assert out1.metrics["divergence_mean"] > 100 * out.metrics["divergence_mean"] + 1e-4


def test_step_prompts_are_a_pure_function_of_seed_and_step():
    cfg = load_config(None, ["prompts_per_step=7", "seed=3"])
    a = [step_prompts(s, cfg, 20) for s in range(6)]
    assert a == [step_prompts(s, cfg, 20) for s in range(6)]
    flat = sum(a, [])
    assert sorted(flat[:14]) == sorted(set(flat[:14]))  # no repeats within an epoch
    assert sorted(flat[:20]) == list(range(20))  # an epoch covers every problem once
    assert step_prompts(0, load_config(None, ["prompts_per_step=7", "seed=4"]), 20) != a[0]
