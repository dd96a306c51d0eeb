"""Loss gradient, mask invariances, edge cases."""

import math

import pytest
import torch

import pdmask

from .helpers import make_case
from tests import flat  # noqa: E402

MODES_TOPK = ["none", "dppo-binary-tv", "dppo-binary-kl", "dppo-topk-kl", "dppo-topk-tv",
              "pdm-topk-kl", "pdm-topk-tv"]


def shaped(B=3, T=5, V=30, K=4, seed=0, dtype=torch.float64, temperature=1.0, mismatch=0.6):
    c = make_case(B * T, V, K, seed=seed, mismatch=mismatch, temperature=temperature, scale=2.0)
    g = torch.Generator().manual_seed(seed + 100)
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[0, -2:] = False  # ragged lengths
    resp[1, -1:] = False
    return dict(
        logits=c["logits"].reshape(B, T, V).to(dtype).clone().requires_grad_(True),
        sampled_ids=c["sampled_ids"].reshape(B, T),
        rollout_logprob=c["rollout_logprob"].reshape(B, T).float(),
        rollout_topk_ids=c["topk_ids"].reshape(B, T, K),
        rollout_topk_logprobs=c["topk_logprobs"].reshape(B, T, K).float(),
        advantages=torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).contiguous(),
        response_mask=resp,
        rollout_logits=c["rollout_logits"].reshape(B, T, V),
    )


def call(b, mode, **kw):
    extra = {"rollout_logits": b["rollout_logits"]} if "full" in mode else {}
    return flat.policy_loss(b["logits"], b["sampled_ids"], b["rollout_logprob"], b["rollout_topk_ids"],
                              b["rollout_topk_logprobs"], b["advantages"], b["response_mask"],
                              mode=mode, **extra, **kw)


@pytest.mark.parametrize("mode", MODES_TOPK + ["pdm-full-kl", "pdm-full-tv", "grpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_gradient_is_minus_w_a_m_times_ek_minus_pi_over_normaliser(mode, agg, temperature):
    b = shaped(seed=3, temperature=temperature)
    out = call(b, mode, loss_agg=agg, temperature=temperature, is_cap=1.5, delta_low=0.02, delta_high=0.02)
    out.loss.backward()
    st, m = out.stats, out.mask & b["response_mask"]
    B, T, V = b["logits"].shape
    pi = torch.softmax(b["logits"].detach() / temperature, -1)
    e_k = torch.nn.functional.one_hot(b["sampled_ids"], V).to(pi.dtype)
    r = st["ratio"]
    w = r if mode == "grpo" else r.clamp(max=1.5)
    n_b = b["response_mask"].sum(-1, keepdim=True).double()
    norm = {
        "token-mean": b["response_mask"].sum().double().expand(B, T),
        "seq-mean-token-mean": (n_b * B).expand(B, T),
        "seq-mean-token-sum": torch.full((B, T), float(B), dtype=torch.float64),
        "seq-mean-token-sum-norm": torch.full((B, T), float(B * T), dtype=torch.float64),
    }[agg]
    coef = -w * b["advantages"] * m / norm / temperature  # (B, T)
    want = coef[..., None] * (e_k - pi)
    torch.testing.assert_close(b["logits"].grad, want, rtol=1e-9, atol=1e-12)
    assert (~m & b["response_mask"]).any() or mode == "none"  # the case exercises masking


@pytest.mark.parametrize("mode", MODES_TOPK + ["grpo"])
def test_mask_is_invariant_to_positive_scaling_of_the_update(mode):
    """The direction test is a sign: scaling the IS weight (or A) by c > 0 changes nothing."""
    b = shaped(seed=4, mismatch=1.0)
    base = call(b, mode).mask
    for c in (1e-3, 0.5, 7.0, 1e3):
        b2 = dict(b, advantages=b["advantages"] * c)
        assert torch.equal(call(b2, mode).mask, base)
    if mode != "grpo":  # the cap only changes w in the DPPO surrogate
        for cap in (1.01, 2.0, math.inf):
            assert torch.equal(call(b, mode, is_cap=cap).mask, base)


def test_trust_region_mask_matches_policy_loss_mask():
    b = shaped(seed=5, mismatch=1.0)
    for mode in MODES_TOPK:
        m = flat.trust_region_mask(b["logits"], b["sampled_ids"], b["rollout_logprob"], b["rollout_topk_ids"],
                                     b["rollout_topk_logprobs"], b["advantages"], b["response_mask"], mode=mode)
        assert torch.equal(m, call(b, mode).mask)


def test_advantages_per_sequence_broadcast():
    b = shaped(seed=6)
    full = call(b, "pdm-topk-kl").loss
    per_seq = call(dict(b, advantages=b["advantages"][:, 0].contiguous()), "pdm-topk-kl").loss
    assert full.item() == per_seq.item()


def test_all_masked_batch_gives_zero_loss_and_zero_gradient():
    b = shaped(seed=7)
    b["response_mask"] = torch.zeros_like(b["response_mask"])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        b["logits"].grad = None
        out = call(b, "pdm-topk-kl", loss_agg=agg)
        out.loss.backward()
        assert out.loss.item() == 0.0
        assert torch.equal(b["logits"].grad, torch.zeros_like(b["logits"]))
        assert all(torch.isfinite(v).all() for v in out.metrics.values())


def test_every_token_masked_gives_zero_loss():
    # A huge mismatch and tiny delta: every out-of-region outward token is masked.
    b = shaped(seed=8, mismatch=3.0)
    out = call(b, "dppo-binary-tv", delta_low=1e-9, delta_high=1e-9)
    out.loss.backward()
    masked = ~out.mask & b["response_mask"]
    assert masked.any()
    assert torch.isfinite(b["logits"].grad).all()


def test_padding_junk_never_leaks():
    b = shaped(seed=9)
    ref = call(b, "pdm-topk-kl")
    junk = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
    pad = ~b["response_mask"]
    junk["sampled_ids"][pad] = -100
    junk["rollout_logprob"][pad] = float("nan")
    junk["rollout_topk_ids"][pad] = 10**6
    junk["rollout_topk_logprobs"][pad] = float("inf")
    junk["advantages"][pad] = float("nan")
    junk["logits"] = b["logits"].detach().clone()
    junk["logits"][pad] = 1e30
    junk["logits"].requires_grad_(True)
    out = call(junk, "pdm-topk-kl")
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-12)
    assert torch.isfinite(junk["logits"].grad).all()
    for k, v in out.metrics.items():
        assert v.item() == pytest.approx(ref.metrics[k].item(), rel=1e-9, abs=1e-12), k


def test_k_equal_v_and_negative_inf_topk_entries():
    """K = V with engine-truncated entries (-inf, as vLLM's processed mode reports top-p cuts)."""
    V = 6
    logits = torch.randn(1, 2, V, dtype=torch.float64)
    lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, -1e9, -1e9, -1e9]] * 2, dtype=torch.float64), -1)
    lp = torch.where(lp < -1e6, torch.tensor(float("-inf"), dtype=torch.float64), lp)[None]
    ids = torch.arange(V).expand(1, 2, V)
    k = torch.tensor([[0, 2]])
    st = flat.token_stats(logits, k, lp[0].gather(-1, k[0][:, None]).T, ids, lp)
    for key, v in st.items():
        if v.dtype.is_floating_point:
            assert torch.isfinite(v).all(), key
    # tokens 3..5 have mu = 0, so the top-K KL is exactly the full KL against that mu
    pi = torch.softmax(logits, -1)
    mu = lp.exp()
    want = (mu * (lp - pi.log())).nan_to_num(0.0).sum(-1)
    torch.testing.assert_close(st["topk_kl"], want)


def test_tail_mass_rounding_is_clamped_and_counted():
    """sum of top-K mu slightly above 1 (within tolerance): mu_T clamps to 0, and is counted."""
    logits = torch.zeros(1, 1, 5)
    topk = torch.tensor([[[0, 1]]])
    lp = torch.log(torch.tensor([[[0.6, 0.4 + 5e-4]]]))
    out = flat.policy_loss(logits, torch.tensor([[0]]), lp[..., 0], topk, lp, torch.ones(1, 1),
                             torch.ones(1, 1, dtype=torch.bool), mode="pdm-topk-kl")
    assert out.stats["rollout_tail_mass"].item() == 0.0
    assert out.metrics["tail_clamped_frac"].item() == 1.0
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_logits_agree_with_float64(dtype):
    b = shaped(seed=10, dtype=torch.float64)
    ref = call(b, "pdm-topk-kl").stats
    low = dict(b, logits=b["logits"].detach().to(dtype).requires_grad_(True))
    out = call(low, "pdm-topk-kl")
    out.loss.backward()
    assert low["logits"].grad.dtype == dtype
    # the only error is the rounding of the logits themselves: bf16 has 8 bits of mantissa
    tol = {torch.bfloat16: 5e-2, torch.float16: 5e-3, torch.float32: 1e-5}[dtype]
    for key in ("logp", "topk_kl", "ddot_topk_kl_exact", "entropy"):
        torch.testing.assert_close(out.stats[key].double(), ref[key].double(), atol=tol, rtol=tol)


def test_pi_k_underflow_in_bf16_stays_finite():
    V = 50
    logits = torch.zeros(1, 2, V, dtype=torch.bfloat16)
    logits[..., 0] = 200.0  # pi_k of any other token is exp(-200): 0 in float32
    logits.requires_grad_(True)
    ids = torch.tensor([[3, 4]])
    lp = torch.full((1, 2), math.log(0.1))
    topk = torch.tensor([[[3, 4], [4, 3]]])
    tlp = torch.log(torch.tensor([[[0.1, 0.05], [0.1, 0.05]]]))
    for mode in MODES_TOPK:
        out = flat.policy_loss(logits, ids, lp, topk, tlp, torch.tensor([[1.0, -1.0]]),
                                 torch.ones(1, 2, dtype=torch.bool), mode=mode, is_cap=math.inf)
        out.loss.backward()
        assert torch.isfinite(out.loss), mode
        assert torch.isfinite(logits.grad).all(), mode
        assert all(torch.isfinite(v).all() for v in out.metrics.values()), mode
        logits.grad = None


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_empty_batch_gives_empty_statistics_and_zero_loss(impl):
    z = torch.randn(0, 5, 10, requires_grad=True)
    ids = torch.zeros(0, 5, dtype=torch.long)
    lp = torch.full((0, 5), -1.0)
    st = flat.token_stats(z, ids, lp, ids[..., None], lp[..., None], impl=impl)
    assert st["topk_kl"].shape == (0, 5) and st["ddot_topk_kl_exact"].shape == (0, 5)
    out = flat.policy_loss(z, ids, lp, ids[..., None], lp[..., None], torch.zeros(0), torch.zeros(0, 5),
                             impl=impl)
    out.loss.backward()
    assert out.loss.item() == 0.0 and z.grad.shape == z.shape
