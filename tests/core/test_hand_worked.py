"""Hand-worked examples for every mode and aggregation, arithmetic in the comments.

V = 3 and K = 3, so the top-K view is the whole distribution (no tail). Logits are
log-probabilities, so pi is exactly the listed vector. Tokens:

  A: pi = [0.3, 0.6, 0.1], mu = [0.25, 0.05, 0.7], k = 0, adv = +1
     r = 0.3 / 0.25 = 1.2                      -> ratio direction: A (r - 1) = +0.2, outward
     KL(mu||pi) = .25 ln(.25/.3) + .05 ln(.05/.6) + .7 ln(.7/.1)
                = -.045580 - .124245 + 1.362137 = 1.192311
     Ddot_KL = (pi_k - mu_k) + sum pi mu - sum pi^2
             = 0.05 + (.075 + .03 + .07) - (.09 + .36 + .01) = 0.05 + .175 - .46 = -0.235
       -> predictive: A * Ddot < 0, inward. Raising token 0 drains token 1, where pi has
          mass mu does not want, so the KL *falls*: the ratio and predictive tests disagree.
     TV = 1/2 (.05 + .55 + .6) = 0.6; s = 1/2 sign(pi - mu) = [+.5, +.5, -.5],
     sbar = .5 (.3 + .6 - .1) = .4, Ddot_TV = .3 (.5 - .4) - (.09 (.1) + .36 (.1) + .01 (-.9))
             = .03 - .036 = -0.006 (inward)
     binary TV = |.3 - .25| = 0.05; binary KL = .25 ln(.25/.3) + .75 ln(.75/.7) = 0.006165
  B: pi = [0.5, 0.3, 0.2], mu = [0.2, 0.3, 0.5], k = 2, adv = -1
     r = 0.2 / 0.5 = 0.4                      -> A (r - 1) = +0.6, outward
     KL = .2 ln(.2/.5) + .5 ln(.5/.2) = .3 ln 2.5 = 0.274887
     Ddot_KL = (.2 - .5) + (.1 + .09 + .1) - (.25 + .09 + .04) = -.3 + .29 - .38 = -0.39
       -> A * Ddot = +0.39, outward (both tests agree)
  G, E: pi = mu = [0.25, 0.25, 0.5], k = 2, adv = +1 -> r = 1, every divergence 0
  D:    pi = mu = [1/3, 1/3, 1/3], k = 0, adv = +1

Batch (B=2, T=3): sequence 0 = [A, B, G], sequence 1 = [D, E, padding].
"""

import math

import pytest
import torch

import pdmask
from tests import flat  # noqa: E402

F64 = torch.float64
PI = {"A": [.3, .6, .1], "B": [.5, .3, .2], "G": [.25, .25, .5], "D": [1 / 3] * 3, "E": [.25, .25, .5]}
MU = {"A": [.25, .05, .7], "B": [.2, .3, .5], "G": [.25, .25, .5], "D": [1 / 3] * 3, "E": [.25, .25, .5]}
K_ID = {"A": 0, "B": 2, "G": 2, "D": 0, "E": 2}
ADV = {"A": 1.0, "B": -1.0, "G": 1.0, "D": 1.0, "E": 1.0}
LAYOUT = [["A", "B", "G"], ["D", "E", None]]


def batch():
    pad = "D"  # any valid content; the response mask excludes it
    names = [[n or pad for n in row] for row in LAYOUT]
    logits = torch.tensor([[[math.log(p) for p in PI[n]] for n in row] for row in names], dtype=F64)
    mu = torch.tensor([[MU[n] for n in row] for row in names], dtype=F64)
    top = mu.log().sort(-1, descending=True)
    ids = torch.tensor([[K_ID[n] for n in row] for row in names])
    return dict(
        logits=logits.requires_grad_(True), sampled_ids=ids,
        rollout_logprob=mu.log().gather(-1, ids[..., None]).squeeze(-1),
        rollout_topk_ids=top.indices, rollout_topk_logprobs=top.values,
        advantages=torch.tensor([[ADV[n] for n in row] for row in names], dtype=F64),
        response_mask=torch.tensor([[n is not None for n in row] for row in LAYOUT]),
    )


def run(mode, **kw):
    b = batch()
    return flat.policy_loss(b["logits"], b["sampled_ids"], b["rollout_logprob"], b["rollout_topk_ids"],
                              b["rollout_topk_logprobs"], b["advantages"], b["response_mask"], mode=mode, **kw)


def test_hand_worked_statistics():
    st = run("none").stats
    a, b_ = (0, 0), (0, 1)
    assert st["ratio"][a].item() == pytest.approx(1.2)
    assert st["topk_kl"][a].item() == pytest.approx(1.192311, abs=1e-6)
    assert st["ddot_topk_kl_exact"][a].item() == pytest.approx(-0.235)
    assert st["topk_tv"][a].item() == pytest.approx(0.6)
    assert st["ddot_topk_tv_exact"][a].item() == pytest.approx(-0.006)
    assert st["binary_tv"][a].item() == pytest.approx(0.05)
    assert st["binary_kl"][a].item() == pytest.approx(0.006165, abs=1e-6)
    assert st["ratio"][b_].item() == pytest.approx(0.4)
    assert st["topk_kl"][b_].item() == pytest.approx(0.3 * math.log(2.5))
    assert st["ddot_topk_kl_exact"][b_].item() == pytest.approx(-0.39)


# keep mask on the 5 response tokens [A, B, G, D, E] for each mode (thresholds in kwargs)
MASKS = [
    # A: out (1.19 > .05), ratio outward -> masked; B: out, outward -> masked
    ("dppo-topk-kl", {}, [0, 0, 1, 1, 1]),
    # A: out but predictive inward (Ddot = -.235) -> kept; B: outward -> masked
    ("pdm-topk-kl", {}, [1, 0, 1, 1, 1]),
    ("pdm-full-kl", {}, [1, 0, 1, 1, 1]),
    # TV: A out (.6 > .15); ratio outward -> masked, predictive (-.006) inward -> kept.
    # B: TV = .5 (.3 + 0 + .3) = .3 > .15, Ddot_TV: s = [+.5, 0, -.5], sbar = .5 (.5 - .2) = .15,
    #    Ddot = .2 (-.5 - .15) - (.25 (.35) + .09 (-.15) + .04 (-.65)) = -.13 - .048 = -.178,
    #    A * Ddot = +.178 outward -> masked in both.
    ("dppo-topk-tv", {}, [0, 0, 1, 1, 1]),
    ("pdm-topk-tv", {}, [1, 0, 1, 1, 1]),
    ("pdm-full-tv", {}, [1, 0, 1, 1, 1]),
    # binary TV: A .05 < .15 in region -> kept; B |.2 - .5| = .3 > .15, outward -> masked
    ("dppo-binary-tv", {}, [1, 0, 1, 1, 1]),
    # ... and with delta .01 A is out and ratio-outward -> masked
    ("dppo-binary-tv", {"delta_low": .01, "delta_high": .01}, [0, 0, 1, 1, 1]),
    # binary KL: A .006165 < .05 kept; B .2 ln .4 + .8 ln(.8/.5) = -.183258 + .376003 = .192745 -> masked
    ("dppo-binary-kl", {}, [1, 0, 1, 1, 1]),
    # grpo eps .2/.28: A r = 1.2 <= 1.28 kept; B r = .4 < .8 with A < 0 -> clipped
    ("grpo", {"eps_high": .28}, [1, 0, 1, 1, 1]),
    # grpo eps .1: A r = 1.2 > 1.1 with A > 0 -> clipped
    ("grpo", {"eps_low": .1, "eps_high": .1}, [0, 0, 1, 1, 1]),
    ("none", {}, [1, 1, 1, 1, 1]),
]


@pytest.mark.parametrize("mode,kw,want", MASKS, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(MASKS)])
def test_mask_of_every_mode(mode, kw, want):
    b = batch()
    if mode.endswith("full-kl") or mode.endswith("full-tv"):
        kw = {**kw, "rollout_logits": b["rollout_topk_logprobs"].new_tensor([[MU[n or "D"] for n in row]
                                                                             for row in LAYOUT]).log()}
    out = run(mode, **kw)
    got = out.mask[out.mask.new_tensor([[1, 1, 1], [1, 1, 0]]).bool()].long().tolist()
    assert got == want
    assert out.mask[1, 2].item()  # padding reports kept
    mask2 = flat.trust_region_mask(
        b["logits"], b["sampled_ids"], b["rollout_logprob"], b["rollout_topk_ids"],
        b["rollout_topk_logprobs"], b["advantages"], b["response_mask"], mode=mode,
        **{k: v for k, v in kw.items()})
    if mode != "grpo":  # grpo's dual clip is part of its surrogate, not its region
        assert torch.equal(mask2, out.mask)


L3, L2, L5, L4 = -math.log(1 / 3), -math.log(.5), -math.log(.2), -math.log(.3)


@pytest.mark.parametrize("agg,want", [
    # dppo-topk-kl token losses: A 0, B 0, G -1*1*ln(.5) = .693147 | D -ln(1/3) = 1.098612, E .693147
    ("token-mean", (L2 + L3 + L2) / 5),  # 2.484906 / 5 = .496981
    ("seq-mean-token-mean", (L2 / 3 + (L3 + L2) / 2) / 2),  # (.231049 + .895880) / 2 = .563464
    ("seq-mean-token-sum", (L2 + (L3 + L2)) / 2),  # 1.242453
    ("seq-mean-token-sum-norm", (L2 + (L3 + L2)) / 2 / 3),  # / T = 3 -> .414151
    ("token-sum", L2 + L3 + L2),  # 2.484906
])
def test_aggregations(agg, want):
    assert run("dppo-topk-kl", loss_agg=agg).loss.item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("agg,counts,want", [
    # two data-parallel ranks, global counts 8 tokens / 3 sequences: D * S / N_global
    ("token-mean", dict(num_tokens=8), 2 * (L2 + L3 + L2) / 8),  # .621227
    ("token-sum", {}, 2 * (L2 + L3 + L2)),  # 4.969813
    ("seq-mean-token-mean", dict(num_seqs=3), 2 * (L2 / 3 + (L3 + L2) / 2) / 3),  # .751286
    ("seq-mean-token-sum", dict(num_seqs=3), 2 * (L2 + (L3 + L2)) / 3),  # 1.656604
    ("seq-mean-token-sum-norm", dict(num_seqs=3, loss_scale_factor=4), 2 * (L2 + (L3 + L2)) / 3 / 4),  # .414151
])
def test_aggregations_over_two_ranks(agg, counts, want):
    assert run("dppo-topk-kl", loss_agg=agg, dp_size=2, **counts).loss.item() == pytest.approx(want, rel=1e-12)


def test_loss_values_per_mode():
    # pdm-topk-kl keeps A with w = min(1.2, 5): -1.2 * 1 * ln(.3) = 1.444767
    assert run("pdm-topk-kl").loss.item() == pytest.approx((1.2 * L4 + 2 * L2 + L3) / 5)
    # is_cap 1.1 caps A's weight: w = 1.1
    assert run("pdm-topk-kl", is_cap=1.1).loss.item() == pytest.approx((1.1 * L4 + 2 * L2 + L3) / 5)
    # none also keeps B: -0.4 * (-1) * ln(.2) = -.643775
    assert run("none").loss.item() == pytest.approx((1.2 * L4 - 0.4 * L5 + 2 * L2 + L3) / 5)
    # grpo (eps .2/.28): PPO values max(-A r, -A clip(r)): A -1.2, B max(.4, .8) = .8, G D E -1 each
    assert run("grpo", eps_high=.28).loss.item() == pytest.approx((-1.2 + .8 - 3) / 5)
    # dual clip: is_cap 0.3 < r_B? no (A < 0 and r = .4 > .3) -> B's value is -A C = .3
    assert run("grpo", eps_high=.28, is_cap=0.3).loss.item() == pytest.approx((-1.2 + .3 - 3) / 5)


def test_metrics_dppo_topk_kl():
    m = run("dppo-topk-kl").metrics
    assert m["out_of_region_frac"].item() == pytest.approx(2 / 5)  # A, B
    assert m["masked_frac"].item() == pytest.approx(2 / 5)
    assert m["masked_frac_pos_adv"].item() == pytest.approx(1 / 5)  # A
    assert m["masked_frac_neg_adv"].item() == pytest.approx(1 / 5)  # B
    assert m["kept_frac"].item() == pytest.approx(3 / 5)
    assert m["disagreement_frac"].item() == pytest.approx(1 / 2)  # A disagrees, B agrees
    assert m["num_disagreement"].item() == 1 and m["num_out_of_region"].item() == 2
    assert m["divergence_max"].item() == pytest.approx(1.192311, abs=1e-6)
    assert m["divergence_mean"].item() == pytest.approx((1.192311 + 0.3 * math.log(2.5)) / 5, abs=1e-6)
    assert all(not t.requires_grad for t in m.values())
