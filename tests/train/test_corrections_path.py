"""The trainer's off-policy corrections and truncated sampling: config fields, the hf engine
sampling with top-k / top-p, and the loss on its rollouts (on-policy ratio 1 only when the
loss knows the engine's truncation)."""

import math

import pytest
import torch

from pdmask.engine.hf import HFEngine
from pdmask.engine.registry import build_engine
from pdmask.ops import sampling_kept_mask
import pdmask_lab.batchmask  # noqa: F401  (registers the pdm-batch-* modes' trainer forward)
from pdmask.ops import Sampling
from pdmask.train.config import load_config
from pdmask.train.update import compute_loss
from pdmask.train.model import build_model

SMALL = ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64", "temperature=0.8",
         "engine_precision=fp32"]


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, SMALL)
    m = build_model(cfg, 97, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # sharp distributions: top-p keeps fewer than K = 20 tokens
    return m


def rollouts(model, **trunc):
    sampling = Sampling(temperature=0.8, **{k[9:]: v for k, v in trunc.items()})  # sampling_top_p -> top_p
    eng = HFEngine(model, eos_id=1, pad_id=0, precision="fp32", temperature=0.8, top_k_logprobs=20, sampling=sampling)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    return eng, eng.generate(prompts, max_new_tokens=10, seed=0)


@pytest.mark.parametrize("trunc", [dict(sampling_top_p=0.7), dict(sampling_top_k=5),
                                   dict(sampling_min_p=0.2, sampling_top_p=0.9)], ids=str)
def test_hf_engine_reports_the_renormalised_distribution(model, trunc):
    eng, b = rollouts(model, **trunc)
    z = eng.score(b.sequences, b.attention_mask, b.prompt_len) / 0.8  # (B, T, V) scaled logits
    B, T, V = z.shape
    S = sampling_kept_mask(z.reshape(-1, V), **{k[9:]: v for k, v in trunc.items()}).view(B, T, V)
    logmu = torch.log_softmax(z.masked_fill(~S, -math.inf), -1)
    m = b.response_mask
    k = b.response_ids
    assert S.gather(-1, k[..., None])[..., 0][m].all()  # every sampled token is in the kept set
    torch.testing.assert_close(b.rollout.sampled_logprob[m], logmu.gather(-1, k[..., None])[..., 0][m], atol=1e-4, rtol=0)
    # top-K of the processed distribution: entries beyond the kept set are -inf
    inside = S.gather(-1, b.rollout.topk_ids)
    assert torch.equal(torch.isfinite(b.rollout.topk_logprobs)[m], inside[m])
    assert (~inside[m]).any()  # K = 20 exceeds the kept set somewhere: truncation is real


def test_the_loss_is_on_policy_only_with_the_engines_truncation(model):
    _, b = rollouts(model, sampling_top_p=0.7)
    adv = torch.linspace(-1, 1, 8)
    naive = compute_loss(model, b, adv, load_config(None, SMALL), validate=True)
    fixed = compute_loss(model, b, adv, load_config(None, SMALL + ["sampling_top_p=0.7"]), validate=True)
    assert float(naive.metrics["ratio_mean"]) < 0.95  # the known bias: E[r] = pi(S)
    assert abs(float(fixed.metrics["ratio_mean"]) - 1) < 1e-4  # fp32 engine, same weights: r = 1
    assert abs(float(fixed.metrics["policy_kept_mass_mean"]) - float(naive.metrics["ratio_mean"])) < 1e-4
    assert float(fixed.metrics["kept_set_sampled_outside_frac"]) == 0.0
    assert float(fixed.metrics["kept_set_topk_mismatch_frac"]) == 0.0


def test_corrections_reach_the_loss(model):
    _, b = rollouts(model)
    adv = torch.linspace(-1, 1, 8)
    cfg = load_config(None, SMALL + ["mode=none", "is_level=sequence", "is_mask=true", "is_floor=0.5",
                                     "rejection=token_k3,seq_mean_k2", "rejection_threshold=0.5,0.1",
                                     "off_policy_mask_threshold=0.2"])
    out = compute_loss(model, b, adv, cfg, validate=True)
    for key in ("masked_frac_is", "masked_frac_rs_token_k3", "masked_frac_rs_seq_mean_k2", "masked_frac_opsm",
                "masked_frac_correction"):
        assert key in out.metrics, key
    assert cfg.loss.corrections.rejection == "token_k3,seq_mean_k2"


def test_config_fields_and_errors():
    c = load_config(None, ["rejection=seq_mean_k1", "rejection_threshold=0.99_1.01", "is_level=null"])
    assert c.loss.corrections.is_level is None and c.loss.corrections.rejection_threshold == "0.99_1.01"
    assert load_config(None, []).loss.corrections.rejection is None
    for over, msg in [
        (["is_level=seq"], r"^is_level: unknown value"),
        (["rejection=token_k9", "rejection_threshold=1"], r"^rejection: unknown value 'token_k9'"),
        (["rejection=token_k2"], r"^rejection_threshold: required"),
        (["sampling_top_p=0"], r"^sampling_top_p: "),
        (["sampling_top_k=5", "full_logits=true"], r"^sampling_top_k: truncated sampling cannot be combined"),
        (["mode=grpo", "is_level=sequence"], r"^is_level: 'sequence' weights are refused with grpo"),
        (["off_policy_mask_threshold=-1"], r"^off_policy_mask_threshold: "),
        (["mode=pdm-batch-topk-kl", "sampling_top_p=0.9"], r"^sampling_top_p: mode 'pdm-batch-topk-kl' computes"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_config(None, over)


def test_truncation_is_refused_by_an_engine_without_it(model):
    cfg = load_config(None, SMALL + ["sampling_top_k=5"])
    cfg.engine = "vllm"  # not validated here: build_engine itself must refuse before building anything
    with pytest.raises(ValueError, match=r"^sampling_top_k: truncated sampling is built into the hf engine only"):
        build_engine(cfg, model, type("Tok", (), {"eos_token_id": 1, "pad_token_id": 0})())
