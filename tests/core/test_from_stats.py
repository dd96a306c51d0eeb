"""``PolicyLoss.from_stats``: the loss from statistics computed elsewhere (what the verl
plugin calls) is the core's own pipeline, and the aggregation modes verl's ``agg_loss``
has (``token-sum``, ``dp_size``, global counts) are ``Aggregation``'s, in float64."""

import math

import pytest
import torch

import pdmask
from pdmask.loss import aggregate
from tests.numerics import sum_atol

F64 = torch.float64


def case(B=3, T=5, V=13, K=4, seed=0):
    """float64 logits, a rollout near them (some tokens out of region) with a ragged mask,
    advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=F64) * 2
    mu = torch.log_softmax(logits + torch.randn(B, T, V, generator=g, dtype=F64), -1)
    ids = torch.multinomial(mu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    top = mu.topk(K, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1:] = False
    r = pdmask.Rollout(ids, mu.gather(-1, ids[..., None])[..., 0], top.indices, top.values, mask)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return logits, r, adv


def _grad(loss, leaf):
    (g,) = torch.autograd.grad(loss, leaf)
    return g


SPECS = [
    dict(mode="pdm-topk-kl"),
    dict(mode="dppo-topk-tv", aggregation=pdmask.Aggregation("seq-mean-token-mean")),
    dict(mode="pdm-topk-kl", estimator="aggregated", aggregation=pdmask.Aggregation("token-sum")),
    dict(mode="dppo-binary-kl", corrections=pdmask.Corrections(is_level="sequence", is_cap=2.0),
         aggregation=pdmask.Aggregation("seq-mean-token-sum-norm", num_seqs=6, loss_scale_factor=8, dp_size=2)),
    dict(mode="grpo", corrections=pdmask.Corrections(rejection="token_k3", rejection_threshold=0.05),
         aggregation=pdmask.Aggregation("token-mean", num_tokens=20, dp_size=2)),
]


@pytest.mark.usefixtures("one_thread")  # bitwise: the same operations in the same order, on one thread
@pytest.mark.parametrize("spec", SPECS, ids=[s["mode"] for s in SPECS])
def test_from_stats_is_the_call_on_the_same_statistics(spec):
    """Statistics from pdmask.token_stats through from_stats give exactly the loss, the
    gradient, the mask and the metrics of the call on the logits: one pipeline."""
    logits, r, adv = case()
    pl = pdmask.PolicyLoss(**spec)
    a_leaf, b_leaf = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    a = pl(a_leaf, r, adv)
    b = pl.from_stats(pdmask.token_stats(b_leaf, r), adv, r.response_mask)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.mask, b.mask) and torch.equal(a.token_loss, b.token_loss)
    assert torch.equal(_grad(a.loss, a_leaf), _grad(b.loss, b_leaf))
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        assert torch.equal(a.metrics[k], b.metrics[k]), k
    assert 0 < float(a.metrics["masked_frac"]) < 1, "the batch must mask some tokens, not all"


def test_is_weights_replace_the_weight_and_zero_masks():
    """is_weights replace min(r, C): weights equal to the corrections' own TIS / MIS weights
    give the corrections' loss; a weight of 0 masks the token (MIS)."""
    logits, r, adv = case(seed=1)
    st = pdmask.token_stats(logits, r)
    lr, valid = st["log_ratio"], r.response_mask
    ratio = lr.exp()
    pl = pdmask.PolicyLoss(mode="pdm-topk-kl", corrections=pdmask.Corrections(is_cap=5.0))
    for corr, w in [
        (pdmask.Corrections(is_cap=1.1), ratio.clamp(max=1.1)),  # TIS at another cap
        (pdmask.Corrections(is_floor=0.8, is_cap=1.25, is_mask=True),  # MIS: 0 outside the bounds
         torch.where((ratio >= 0.8) & (ratio <= 1.25), ratio, torch.zeros_like(ratio))),
    ]:
        ref = pdmask.PolicyLoss(mode="pdm-topk-kl", corrections=corr).from_stats(st, adv, valid)
        out = pl.from_stats(st, adv, valid, is_weights=w)
        # two code paths of one token-mean over the valid tokens: 2 n eps sum|terms| (tests/numerics.py)
        terms = torch.where(out.mask & valid, w * adv * st["logp"], 0.0).abs().sum() / valid.sum()
        torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=sum_atol(int(valid.sum()), terms))
        assert torch.equal(out.mask, ref.mask)
    zero = ((w <= 0) & valid).sum().item()
    assert 0 < zero < valid.sum().item(), "the MIS weights must mask some tokens, not all"
    assert out.metrics["masked_frac_is"].item() == pytest.approx(zero / valid.sum().item(), rel=1e-15)
    # a mean of n nonnegative weights summed in two orders: 2 n eps mean(w) (tests/numerics.py)
    assert out.metrics["is_weight_mean"].item() == pytest.approx(
        w[valid].mean().item(), rel=0, abs=sum_atol(int(valid.sum()), w[valid].mean()))
    # the naive formula (module docstring of from_stats)
    M = pdmask.mask_from_stats(st, adv, "pdm-topk-kl").keep & valid & (w > 0)
    naive = torch.where(M, -w * adv * st["logp"], torch.zeros_like(w)).sum() / valid.sum()
    abs_naive = torch.where(M, w * adv * st["logp"], torch.zeros_like(w)).abs().sum() / valid.sum()
    torch.testing.assert_close(out.loss, naive, rtol=0, atol=sum_atol(adv.numel(), abs_naive))  # one sum, two orders


def test_loss_weights_multiply_each_tokens_loss():
    logits, r, adv = case(seed=2)
    st = pdmask.token_stats(logits, r)
    w = torch.rand(adv.shape, generator=torch.Generator().manual_seed(3), dtype=F64) + 0.5
    w_pad = torch.where(r.response_mask, w, torch.full_like(w, math.nan))  # padding may hold anything
    agg = pdmask.Aggregation("seq-mean-token-sum")
    pl = pdmask.PolicyLoss(mode="dppo-binary-tv", aggregation=agg)
    plain = pl.from_stats(st, adv, r.response_mask)
    out = pl.from_stats(st, adv, r.response_mask, loss_weights=w_pad)
    # one aggregation (a positive linear map) in two orders: its sum|terms| is the map of |terms| (tests/numerics.py)
    abs_terms = aggregate((plain.token_loss * w).abs(), r.response_mask, agg)
    torch.testing.assert_close(out.loss, aggregate(plain.token_loss * w, r.response_mask, agg),
                               rtol=0, atol=sum_atol(adv.numel(), abs_terms))
    assert not math.isclose(out.loss.item(), plain.loss.item())
    assert torch.isfinite(out.token_loss).all()


def _refusal(**over):
    logits, r, adv = case()
    st = pdmask.token_stats(logits, r)
    kw = dict(stats=st, advantages=adv, response_mask=r.response_mask)
    spec = over.pop("spec", {})
    for k, v in over.items():
        kw[k] = v(kw) if callable(v) else v
    with pytest.raises(ValueError) as e:
        pdmask.PolicyLoss(**spec).from_stats(kw.pop("stats"), kw.pop("advantages"), kw.pop("response_mask"), **kw)
    return str(e.value)


REFUSALS = [
    ("stats", dict(stats=lambda kw: {k: v for k, v in kw["stats"].items() if k != "logp"})),
    ("stats", dict(stats=lambda kw: {k: v for k, v in kw["stats"].items() if k != "topk_kl"})),
    ("stats", dict(stats=lambda kw: {**kw["stats"], "ratio": kw["stats"]["ratio"][:, :-1]})),
    ("stats", dict(stats=[1.0])),
    ("response_mask", dict(response_mask=lambda kw: kw["response_mask"][0])),
    ("response_mask", dict(response_mask=lambda kw: kw["response_mask"].double() * 0.5)),
    ("advantages", dict(advantages=lambda kw: torch.where(kw["response_mask"], kw["advantages"], 0.0)
                        .index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(math.nan, dtype=F64)))),
    ("advantages", dict(advantages=lambda kw: kw["advantages"][:, :2])),
    ("is_weights", dict(is_weights=lambda kw: -torch.ones_like(kw["advantages"]))),
    ("is_weights", dict(is_weights=lambda kw: torch.ones_like(kw["advantages"])[:, :-1])),
    ("is_weights", dict(spec=dict(mode="grpo"), is_weights=lambda kw: torch.ones_like(kw["advantages"]))),
    ("is_weights", dict(spec=dict(corrections=pdmask.Corrections(is_level="sequence")),
                        is_weights=lambda kw: torch.ones_like(kw["advantages"]))),
    ("loss_weights", dict(loss_weights=lambda kw: torch.full_like(kw["advantages"], math.inf))),
    ("loss_weights", dict(loss_weights=lambda kw: torch.ones(kw["advantages"].shape, dtype=torch.long))),
    ("sampling", dict(spec=dict(sampling=pdmask.Sampling(temperature=0.7)))),
    ("compute", dict(spec=dict(compute=pdmask.Compute(impl="torch")))),
    ("num_tokens", dict(aggregation=pdmask.Aggregation(num_tokens=torch.tensor(0.0)))),
]


@pytest.mark.parametrize("name,over", REFUSALS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(REFUSALS)])
def test_from_stats_refuses_in_one_line_naming_the_argument(name, over):
    msg = _refusal(**over)
    assert msg.startswith(name + ":") and "\n" not in msg, msg


# ---------------------------------------------------------------- Aggregation: verl's modes
def _values(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=F64)
    m = torch.rand(B, T, generator=g) > 0.3
    m[0] = False  # an empty sequence: not counted by the seq-mean modes
    m[1, 0] = True
    x = torch.where(m, x, torch.full_like(x, math.nan))  # padding junk must not leak
    return x, m


@pytest.mark.parametrize("dp", [1, 3])
def test_aggregation_modes_against_their_formulas(dp):
    x, m = _values()
    xs = torch.where(m, x, torch.zeros_like(x))
    S, n = xs.sum(-1), m.sum(-1).to(F64)
    ok = n > 0
    N, G, L = 17.0, 5.0, 9.0  # global counts (with dp > 1 the rank's own are not enough)
    want = [
        ("token-mean", dict(num_tokens=N), dp * S.sum() / N),
        ("token-sum", {}, dp * S.sum()),
        ("seq-mean-token-mean", dict(num_seqs=G), dp * (S[ok] / n[ok]).sum() / G),
        ("seq-mean-token-sum", dict(num_seqs=G), dp * S[ok].sum() / G),
        ("seq-mean-token-sum-norm", dict(num_seqs=G, loss_scale_factor=L), dp * S[ok].sum() / G / L),
    ]
    for mode, counts, w in want:
        agg = pdmask.Aggregation(mode, dp_size=dp, **counts)
        got = aggregate(x, m, agg)
        # the library's order vs the formula's: a positive linear map of x, so its sum|terms|
        # is the map applied to |x|; 2 n eps of that (tests/numerics.py), n = all B*T terms
        torch.testing.assert_close(got, w, rtol=0, atol=sum_atol(x.numel(), aggregate(x.abs(), m, agg)), msg=mode)
    # token-sum with dp_size 1 is the plain masked sum
    assert aggregate(x, m, pdmask.Aggregation("token-sum")).item() == pytest.approx(
        S.sum().item(), rel=0, abs=sum_atol(x.numel(), xs.abs().sum()))


@pytest.mark.parametrize("kw,name", [
    (dict(loss_agg="token-sum", num_tokens=4), "num_tokens"),
    (dict(loss_agg="token-mean", num_seqs=4), "num_seqs"),
    (dict(loss_agg="seq-mean-token-mean", loss_scale_factor=4), "loss_scale_factor"),
    (dict(loss_agg="token-mean", dp_size=2), "num_tokens"),
    (dict(loss_agg="seq-mean-token-sum", dp_size=4, num_tokens=None), "num_seqs"),
    (dict(dp_size=0), "dp_size"),
    (dict(dp_size=-2), "dp_size"),
    (dict(dp_size=1.0), "dp_size"),
    (dict(dp_size=False), "dp_size"),
    (dict(dp_size="2"), "dp_size"),
])
def test_aggregation_refuses_in_one_line(kw, name):
    with pytest.raises(ValueError) as e:
        pdmask.Aggregation(**kw)
    msg = str(e.value)
    assert msg.startswith(name + ":") and "\n" not in msg, msg


def test_token_sum_with_dp_needs_no_count():
    x, m = _values()
    got = aggregate(x, m, pdmask.Aggregation("token-sum", dp_size=8))
    abs_sum = 8 * torch.where(m, x, 0.0).abs().sum()  # one masked sum in two orders (tests/numerics.py)
    assert got.item() == pytest.approx(8 * torch.where(m, x, 0.0).sum().item(), rel=0, abs=sum_atol(x.numel(), abs_sum))
