"""Off-policy corrections (pdmask.corrections): hand-worked, one test per correction, and
their composition with every mask mode.

The hand-worked batch: three sequences (B = 3, T = 3), ratios r = pi_k / mu_k

    seq 0: r = [2, 0.5, 1.5]   A = -1     prod r = 1.5     geometric mean 1.5^(1/3) = 1.1447
    seq 1: r = [4, 1, pad]     A = +1     prod r = 4       geometric mean 2
    seq 2: r = [0.25, 0.5, pad] A = -1    prod r = 0.125   geometric mean 0.3536

7 response tokens. With l = log r (verl's k-statistics):

    k1 = -l:            seq0 [-.6931, .6931, -.4055]  sum -.4055  mean -.1352
                        seq1 [-1.3863, 0]             sum -1.3863 mean -.6931
                        seq2 [1.3863, .6931]          sum 2.0794  mean 1.0397
    k2 = l^2/2:         seq0 [.2402, .2402, .0822]    sum .5627   mean .1876  max .2402
                        seq1 [.9609, 0]               sum .9609   mean .4805  max .9609
                        seq2 [.9609, .2402]           sum 1.2011  mean .6006  max .9609
    k3 = r - 1 - l:     seq0 [.3069, .1931, .0945]    sum .5945   mean .1982  max .3069
                        seq1 [1.6137, 0]              sum 1.6137  mean .8069  max 1.6137
                        seq2 [.6363, .1931]           sum .8294   mean .4147  max .6363
"""

import math

import pytest
import torch

import pdmask
from pdmask import corrections as C
from pdmask.masks import SMOOTH_SURROGATES

from .helpers import make_case
from tests import flat  # noqa: E402

F64 = torch.float64
R = [[2.0, 0.5, 1.5], [4.0, 1.0, 1.0], [0.25, 0.5, 1.0]]
VALID = torch.tensor([[True, True, True], [True, True, False], [True, True, False]])
ADV = torch.tensor([-1.0, 1.0, -1.0], dtype=F64)
T_, F_ = True, False


def log_ratio():
    lr = torch.tensor(R, dtype=F64).log()
    return torch.where(VALID, lr, torch.full_like(lr, float("nan")))  # padding may hold junk


def close(a, b, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=tol, atol=tol)


def weights(**kw):
    return C.importance_weights(log_ratio(), VALID, C.Corrections(**kw))


# ------------------------------------------------------------------ IS weights
def test_token_tis():
    # cap 3: [2, .5, 1.5 | 4 -> 3, 1 | .25, .5]; one of 7 truncated; mean 8.75 / 7 = 1.25
    w, keep, m = weights(is_level="token", is_cap=3.0)
    close(w, [[2, .5, 1.5], [3, 1, 0], [.25, .5, 0]])
    assert keep.all()
    close(m["is_truncated_frac"], 1 / 7)
    close(m["is_weight_mean"], 1.25)
    close(m["is_weight_min"], .25)
    close(m["is_weight_max"], 3.0)


def test_token_tis_with_floor():
    # TRL token_truncate with clip_min .6: [2, .6, 1.5 | 3, 1 | .6, .6]; .5, 4, .25, .5 truncated: 4/7
    w, keep, m = weights(is_level="token", is_cap=3.0, is_floor=0.6)
    close(w, [[2, .6, 1.5], [3, 1, 0], [.6, .6, 0]])
    close(m["is_truncated_frac"], 4 / 7)


def test_token_mis_is_icepop():
    # IcePop [.6, 3]: out are .5 (seq0), 4 (seq1), .25 and .5 (seq2): 4/7 tokens, every sequence touched
    w, keep, m = weights(is_level="token", is_cap=3.0, is_floor=0.6, is_mask=True)
    assert keep.tolist() == [[T_, F_, T_], [F_, T_, T_], [F_, F_, T_]]  # padding stays True
    close(w, [[2, 0, 1.5], [0, 1, 0], [0, 0, 0]])  # inside: r itself, untruncated
    close(m["masked_frac_is"], 4 / 7)
    close(m["seq_masked_frac_is"], 1.0)


def test_sequence_tis():
    # prod r = [1.5, 4, .125], cap 2 -> [1.5, 2, .125] on every token of the sequence;
    # the 2 tokens of seq 1 truncated; mean (3 * 1.5 + 2 * 2 + 2 * .125) / 7 = 8.75 / 7
    w, keep, m = weights(is_level="sequence", is_cap=2.0)
    close(w, [[1.5] * 3, [2, 2, 0], [.125, .125, 0]])
    close(m["is_truncated_frac"], 2 / 7)
    close(m["is_weight_mean"], 1.25)


def test_sequence_mis():
    # bounds [.2, 2]: seq 1 (4 > 2) and seq 2 (.125 < .2) masked: 4/7 tokens, 2/3 sequences
    w, keep, m = weights(is_level="sequence", is_cap=2.0, is_floor=0.2, is_mask=True)
    assert keep.tolist() == [[T_, T_, T_], [F_, F_, T_], [F_, F_, T_]]
    close(w, [[1.5] * 3, [0, 0, 0], [0, 0, 0]])
    close(m["masked_frac_is"], 4 / 7)
    close(m["seq_masked_frac_is"], 2 / 3)


def test_batch_normalize_token():
    # cap 3 weights [2, .5, 1.5, 3, 1, .25, .5] have mean 1.25: each divided by 1.25
    w, _, m = weights(is_level="token", is_cap=3.0, is_batch_normalize=True)
    close(w, [[1.6, .4, 1.2], [2.4, .8, 0], [.2, .4, 0]])
    close(m["is_batch_norm_factor"], 1.25)


def test_batch_normalize_sequence():
    # sequence weights [1.5, 4, .125] (cap 5); their mean over the 3 sequences 5.625 / 3 = 1.875
    w, _, m = weights(is_level="sequence", is_cap=5.0, is_batch_normalize=True)
    close(w, [[.8] * 3, [4 / 1.875] * 2 + [0], [.125 / 1.875] * 2 + [0]])
    close(m["is_batch_norm_factor"], 1.875)


def test_no_is_weight():
    w, keep, _ = weights(is_level=None)
    close(w, VALID.to(F64))
    assert keep.all()


# ------------------------------------------------------------------ rejection rules (verl rollout_rs)
RULE_CASES = [
    # token_k1, hi 3 -> lo 1/3: keep -1.0986 <= k1 <= 1.0986; out: -1.3863 (seq1 t0), 1.3863 (seq2 t0)
    ("token_k1", 3.0, [[T_, T_, T_], [F_, T_, T_], [F_, T_, T_]], 2 / 7, 2 / 3),
    # token_k2 <= .2: out .2402 (seq0 t0, t1), .9609 (seq1 t0), .9609 and .2402 (seq2)
    ("token_k2", 0.2, [[F_, F_, T_], [F_, T_, T_], [F_, F_, T_]], 5 / 7, 1.0),
    # token_k3 <= .5: out 1.6137 (seq1 t0), .6363 (seq2 t0)
    ("token_k3", 0.5, [[T_, T_, T_], [F_, T_, T_], [F_, T_, T_]], 2 / 7, 2 / 3),
    # seq_sum_k1 in [log .5, log 2] = [-.6931, .6931]: -.4055 keep, -1.3863 and 2.0794 out
    ("seq_sum_k1", "0.5_2.0", [[T_, T_, T_], [F_, F_, T_], [F_, F_, T_]], 4 / 7, 2 / 3),
    # seq_mean_k1 (Geo-RS) in [log .8, log 1.25] = [-.2231, .2231]: -.1352 keep, -.6931 and 1.0397 out
    ("seq_mean_k1", "0.8_1.25", [[T_, T_, T_], [F_, F_, T_], [F_, F_, T_]], 4 / 7, 2 / 3),
    # seq_sum_k2 <= .6: .5627 keep, .9609 and 1.2011 out
    ("seq_sum_k2", 0.6, [[T_, T_, T_], [F_, F_, T_], [F_, F_, T_]], 4 / 7, 2 / 3),
    # seq_mean_k2 <= .5: .1876 and .4805 keep, .6006 out
    ("seq_mean_k2", 0.5, [[T_, T_, T_], [T_, T_, T_], [F_, F_, T_]], 2 / 7, 1 / 3),
    # seq_max_k2 <= .5: .2402 keep, .9609 and .9609 out
    ("seq_max_k2", 0.5, [[T_, T_, T_], [F_, F_, T_], [F_, F_, T_]], 4 / 7, 2 / 3),
    # seq_sum_k3 <= .6: .5945 keep, 1.6137 and .8294 out
    ("seq_sum_k3", 0.6, [[T_, T_, T_], [F_, F_, T_], [F_, F_, T_]], 4 / 7, 2 / 3),
    # seq_mean_k3 <= .5: .1982 and .4147 keep, .8069 out
    ("seq_mean_k3", 0.5, [[T_, T_, T_], [F_, F_, T_], [T_, T_, T_]], 2 / 7, 1 / 3),
    # seq_max_k3 <= 1: .3069 and .6363 keep, 1.6137 out
    ("seq_max_k3", 1.0, [[T_, T_, T_], [F_, F_, T_], [T_, T_, T_]], 2 / 7, 1 / 3),
]


@pytest.mark.parametrize("rule, thr, keep, frac, seq_frac", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rejection_rule(rule, thr, keep, frac, seq_frac):
    k, m = C.rejection_mask(log_ratio(), VALID, rule, thr)
    assert k.tolist() == keep
    close(m[f"masked_frac_rs_{rule}"], frac)
    close(m[f"seq_masked_frac_rs_{rule}"], seq_frac)


def test_every_rule_is_hand_worked():
    assert sorted(c[0] for c in RULE_CASES) == sorted(C.RULES)


def test_rule_statistics_hand_worked():
    close(C.rule_statistic("seq_mean_k1", log_ratio(), VALID), [-math.log(1.5) / 3, -math.log(4) / 2,
                                                                  -math.log(.125) / 2])
    # k3 of r = 4: 4 - 1 - log 4 = 1.6137
    close(C.rule_statistic("token_k3", log_ratio(), VALID)[1, 0], 3 - math.log(4))
    close(C.rule_statistic("seq_max_k2", log_ratio(), VALID), [math.log(2) ** 2 / 2, math.log(4) ** 2 / 2,
                                                                 math.log(4) ** 2 / 2])


def test_rules_chain_and_thresholds_per_rule():
    # token_k3 <= .5 rejects seq1 t0 and seq2 t0; seq_mean_k2 <= .5 rejects seq 2: 3 tokens in all
    k, m = C.rejection_mask(log_ratio(), VALID, "token_k3,seq_mean_k2", "0.5,0.5")
    assert k.tolist() == [[T_, T_, T_], [F_, T_, T_], [F_, F_, T_]]
    k2, _ = C.rejection_mask(log_ratio(), VALID, ["token_k3", "seq_mean_k2", "token_k3"], [0.5, 0.5])
    assert k2.tolist() == k.tolist()  # list form, duplicate dropped
    # one shared threshold for two rules
    k3, _ = C.rejection_mask(log_ratio(), VALID, "token_k3,seq_mean_k2", 0.5)
    assert k3.tolist() == k.tolist()


def test_k1_single_value_means_reciprocal_bounds():
    # "hi" alone is lo = 1/hi (verl): 3 == "0.3333333333333333_3" == (1/3, 3)
    a, _ = C.rejection_mask(log_ratio(), VALID, "token_k1", 3.0)
    b, _ = C.rejection_mask(log_ratio(), VALID, "token_k1", [(1 / 3, 3.0)])
    assert a.tolist() == b.tolist()


def test_k1_bounds_apply_to_mu_over_pi_as_in_verl():
    # asymmetric bounds [0.5, 3] on k1 = log(mu/pi): seq 2 has mu/pi = 1/r = 4 and 2 -> token 0 out;
    # seq 1 has mu/pi = .25 -> out. The same bounds on r would have kept seq2 t1 and cut r = 4.
    k, _ = C.rejection_mask(log_ratio(), VALID, "token_k1", "0.5_3")
    assert k.tolist() == [[T_, T_, T_], [F_, T_, T_], [F_, T_, T_]]


# ------------------------------------------------------------------ DeepSeek-V3.2 / TRL off-policy mask
def test_off_policy_sequence_mask():
    # mean log(mu/pi): seq0 -.1352 (A<0, below .5: keep), seq1 A>0 (keep), seq2 1.0397 > .5 with A<0: masked
    k, m = C.off_policy_mask(log_ratio(), ADV, VALID, 0.5)
    assert k.tolist() == [[T_, T_, T_], [T_, T_, T_], [F_, F_, T_]]
    close(m["masked_frac_opsm"], 2 / 7)
    close(m["seq_masked_frac_opsm"], 1 / 3)
    k, _ = C.off_policy_mask(log_ratio(), ADV, VALID, 1.1)  # 1.0397 <= 1.1
    assert k.all()
    k, _ = C.off_policy_mask(log_ratio(), -ADV, VALID, 0.5)  # seq 2 now A > 0: kept; seq 0/1 below delta
    assert k.all()


# ------------------------------------------------------------------ through policy_loss (hand-worked)
def hand_batch():
    """pi = [0.2, 0.3, 0.5] on every token, k = 0, mu_k = 0.2 / r; V = 3, no top-K."""
    logits = torch.tensor([.2, .3, .5], dtype=F64).log().expand(3, 3, 3).clone().requires_grad_(True)
    mu_k = 0.2 / torch.tensor(R, dtype=F64)
    return dict(logits=logits, sampled_ids=torch.zeros(3, 3, dtype=torch.long), rollout_logprob=mu_k.log(),
                rollout_topk_ids=None, rollout_topk_logprobs=None, advantages=ADV, response_mask=VALID)


def test_policy_loss_sequence_tis_and_opsm_by_hand():
    # weights: seq TIS cap 2 -> [1.5, 2, .125]; OPSM .5 masks seq 2. log pi_k = log .2 = -1.6094
    # seq 0: -1.5 * (-1) * (-1.6094) = -2.4142 per token (3 tokens); seq 1: -2 * (+1) * (-1.6094) = 3.2189 (2)
    # token-mean over the 7 response tokens: (3 * -2.4142 + 2 * 3.2189) / 7 = -0.11499
    b = hand_batch()
    out = flat.policy_loss(**b, mode="none", is_level="sequence", is_cap=2.0, off_policy_mask_threshold=0.5)
    lp = math.log(0.2)
    expect = (3 * (-1.5 * -1 * lp) + 2 * (-2 * 1 * lp)) / 7
    close(out.loss, expect)
    assert out.mask.tolist() == [[T_, T_, T_], [T_, T_, T_], [F_, F_, T_]]
    close(out.metrics["masked_frac_opsm"], 2 / 7)
    close(out.metrics["masked_frac_correction"], 2 / 7)
    close(out.metrics["masked_frac"], 2 / 7)
    close(out.metrics["masked_frac_mode"], 0.0)
    assert all(not v.requires_grad for v in out.metrics.values())
    # gradient: d loss / d z = -w A (e_k - pi) / 7 on kept tokens, 0 elsewhere
    out.loss.backward()
    pi = torch.tensor([.2, .3, .5], dtype=F64)
    ek = torch.tensor([1.0, 0, 0], dtype=F64)
    w = torch.tensor([[1.5] * 3, [2, 2, 0], [0, 0, 0]], dtype=F64)
    a = ADV[:, None].expand(3, 3)
    close(b["logits"].grad, (-w * a)[..., None] * (ek - pi) / 7)


@pytest.mark.usefixtures("one_thread")  # bitwise: the same operations in the same order, on one thread
def test_default_arguments_change_nothing():
    c = make_case(N=12, V=30, K=4, seed=3)
    args = (c["logits"].view(3, 4, 30), c["sampled_ids"].view(3, 4), c["rollout_logprob"].view(3, 4),
            c["topk_ids"].view(3, 4, 4), c["topk_logprobs"].view(3, 4, 4), torch.randn(3, dtype=F64),
            torch.ones(3, 4, dtype=torch.bool))
    a = flat.policy_loss(*args)
    b = flat.policy_loss(*args, is_level="token", is_floor=None, is_mask=False, rejection=None,
                           off_policy_mask_threshold=None)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.token_loss, b.token_loss)
    assert "masked_frac_correction" not in a.metrics


# ------------------------------------------------------------------ composition with every mode
def composed_case(seed=0):
    B, T, V, K = 3, 5, 24, 4
    c = make_case(N=B * T, V=V, K=K, seed=seed, mismatch=1.5)
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    return dict(
        logits=c["logits"].view(B, T, V), sampled_ids=c["sampled_ids"].view(B, T),
        rollout_logprob=c["rollout_logprob"].view(B, T), rollout_topk_ids=c["topk_ids"].view(B, T, K),
        rollout_topk_logprobs=c["topk_logprobs"].view(B, T, K),
        advantages=torch.tensor([1.0, -0.5, -2.0], dtype=F64), response_mask=mask,
        rollout_logits=c["rollout_logits"].view(B, T, V),
        batch_ddot=torch.randn(B, T, generator=g, dtype=F64),
    )


#: the modes whose IS weight is their own (a corrections preset: cispo); they refuse another
OWN_WEIGHT = [m for m in pdmask.MODES if pdmask.MODES[m].corrections is not None]


@pytest.mark.parametrize("mode", [m for m in pdmask.MODES if m not in OWN_WEIGHT])
def test_masks_compose_with_every_mode(mode):
    """IcePop + a sequence rule + OPSM on top of each mode: the final mask is the mode's mask
    AND the corrections' keep, and the kept tokens' loss is unchanged (IcePop keeps r <= C
    untouched, so min(r, C) = r on every kept token). The smooth surrogates have no cap
    to set (their ratio is the weight: a given is_cap without is_mask is refused)."""
    b = composed_case()
    logits = b.pop("logits")
    corr = dict(is_mask=True, is_floor=0.3, is_cap=3.0, rejection="seq_max_k3", rejection_threshold=2.0,
                off_policy_mask_threshold=0.3)
    z0 = logits.clone().requires_grad_(True)
    z1 = logits.clone().requires_grad_(True)
    cap = {} if pdmask.MODES[mode].surrogate in SMOOTH_SURROGATES else {"is_cap": 3.0}
    out0 = flat.policy_loss(z0, **b, mode=mode, **cap)
    out1 = flat.policy_loss(z1, **b, mode=mode, **corr)
    lr = out0.stats["log_ratio"].detach()
    valid = b["response_mask"]
    _, k_is, _ = C.importance_weights(lr, valid, C.Corrections(is_level="token", is_cap=3.0, is_floor=0.3, is_mask=True))
    k_rs, _ = C.rejection_mask(lr, valid, "seq_max_k3", 2.0)
    k_op, _ = C.off_policy_mask(lr, b["advantages"], valid, 0.3)
    ck = k_is & k_rs & k_op
    assert 0 < int((~ck & valid).sum()) < int(valid.sum())  # the corrections do bite, and not everywhere
    assert torch.equal(out1.mask, out0.mask & ck)
    torch.testing.assert_close(out1.token_loss, torch.where(ck, out0.token_loss, torch.zeros_like(out0.token_loss)))
    out0.token_loss.where(ck, torch.zeros_like(out0.token_loss)).sum().backward()
    out1.token_loss.sum().backward()
    torch.testing.assert_close(z1.grad, z0.grad)
    n = int(valid.sum())
    close(out1.metrics["masked_frac_correction"], int((~ck & valid).sum()) / n)
    close(out1.metrics["masked_frac"], int((~out1.mask & valid).sum()) / n)


@pytest.mark.parametrize("mode", [m for m in pdmask.MODES if pdmask.MODES[m].surrogate == "dppo" and m not in OWN_WEIGHT])
def test_sequence_weight_composes_with_every_dppo_mode(mode):
    """Seq-TIS replaces min(r, C): kept tokens' loss is -w_seq A log pi_k."""
    b = composed_case(seed=1)
    out = flat.policy_loss(b.pop("logits"), **b, mode=mode, is_level="sequence", is_cap=2.0)
    lr = out.stats["log_ratio"].detach()
    valid = b["response_mask"]
    w_seq = torch.where(valid, lr, torch.zeros_like(lr)).sum(-1).exp().clamp(max=2.0)  # (B,)
    adv = b["advantages"][:, None].expand_as(lr)
    expect = torch.where(out.mask & valid, -w_seq[:, None] * adv * out.stats["logp"].detach(),
                         torch.zeros_like(lr))
    torch.testing.assert_close(out.token_loss.detach(), expect)


def test_grpo_refuses_weights_that_double_count():
    b = composed_case()
    b.pop("batch_ddot"), b.pop("rollout_logits")
    with pytest.raises(ValueError, match=r"^is_level: 'sequence' weights are refused with grpo"):
        flat.policy_loss(**b, mode="grpo", is_level="sequence")
    with pytest.raises(ValueError, match=r"^is_floor: "):
        flat.policy_loss(**b, mode="grpo", is_floor=0.5)
    with pytest.raises(ValueError, match=r"^is_batch_normalize: "):
        flat.policy_loss(**b, mode="grpo", is_batch_normalize=True)
    flat.policy_loss(**b, mode="grpo", is_level="sequence", is_mask=True, is_floor=0.5)  # a mask is fine


# ------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("kw, msg", [
    (dict(is_level="seq"), r"^is_level: unknown value 'seq'; valid values are: None, token, sequence$"),
    (dict(is_floor=-1.0), r"^is_floor: must be a positive number"),
    (dict(is_floor=6.0), r"^is_floor: must be below is_cap = 5.0"),
    (dict(is_mask=1), r"^is_mask: expected True or False"),
    (dict(is_level=None, is_mask=True), r"^is_mask: needs is_level"),
    (dict(rejection="seq_geo"), r"^rejection: unknown value 'seq_geo'; valid values are: token_k1, "),
    (dict(rejection="token_k2"), r"^rejection_threshold: required with rejection=token_k2$"),
    (dict(rejection_threshold=2.0), r"^rejection_threshold: given without rejection rules"),
    (dict(rejection="token_k2", rejection_threshold="0.5_2"), r"^rejection_threshold: token_k2 takes one upper"),
    (dict(rejection="token_k1", rejection_threshold="2_0.5"), r"^rejection_threshold: bounds of token_k1"),
    (dict(rejection="token_k1,token_k2", rejection_threshold="1,2,3"), r"^rejection_threshold: expected 1 or 2"),
    (dict(rejection="token_k2", rejection_threshold="abc"), r"^rejection_threshold: expected a number"),
    (dict(off_policy_mask_threshold=0.0), r"^off_policy_mask_threshold: must be a positive number"),
])
def test_bad_arguments_are_one_line_errors_before_the_logits(kw, msg):
    b = hand_batch()
    b["logits"] = torch.full((3, 3, 3), float("nan"), dtype=F64)  # never read: the check comes first
    with pytest.raises(ValueError, match=msg):
        flat.policy_loss(**b, mode="none", **kw)
