"""Padding may hold anything (docs/core.md): NaN/inf logits, hidden states or inputs on
padding rows give a finite loss and a finite gradient, equal to the gradient with clean
padding, for every implementation, dtype and mode; through a Linear head the weight
gradient is finite and equal too."""

import math

import pytest
import torch

import pdmask
from tests.ops._ops_cases import row_stats, hidden_row_stats
from pdmask import ops
from tests import flat  # noqa: E402

B, T, V, K = 3, 5, 16, 4


def inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g).to(dtype)
    rl = torch.randn(B, T, V, generator=g)
    lp = torch.log_softmax(rl, -1)
    top = lp.topk(K, -1)
    k = torch.multinomial(lp.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False  # right padding
    mask[2, :2] = False  # left padding
    return dict(logits=logits, sampled_ids=k, rollout_logprob=lp.gather(-1, k[..., None])[..., 0],
                topk_ids=top.indices, topk_lp=top.values, adv=torch.randn(B, T, generator=g), mask=mask,
                rollout_logits=rl.to(dtype))


def poison(t, mask, value):
    """``t`` with every padding row (mask False) set to ``value`` ('mixed': NaN, +inf, -inf)."""
    t = t.clone()
    pad = ~mask
    if value == "mixed":
        row = torch.tensor([math.nan, math.inf, -math.inf, 3.0] * (t.shape[-1] // 4), dtype=t.dtype)
        t[pad] = row
    else:
        t[pad] = value
    return t


def loss_and_grad(x, logits, **kw):
    logits = logits.detach().requires_grad_(True)
    out = flat.policy_loss(logits, x["sampled_ids"], x["rollout_logprob"], x["topk_ids"], x["topk_lp"], x["adv"],
                             x["mask"], **kw)
    out.loss.backward()
    return out, logits.grad


VALUES = [math.nan, math.inf, -math.inf, "mixed"]


@pytest.mark.parametrize("value", VALUES, ids=["nan", "+inf", "-inf", "mixed"])
@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("mode", ["pdm-topk-kl", "dppo-topk-tv", "grpo", "none"])
def test_padding_logits_give_the_clean_gradient(value, impl, mode):
    x = inputs()
    clean_out, clean = loss_and_grad(x, x["logits"], impl=impl, mode=mode)
    out, g = loss_and_grad(x, poison(x["logits"], x["mask"], value), impl=impl, mode=mode)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    torch.testing.assert_close(out.loss, clean_out.loss)
    torch.testing.assert_close(g, clean)
    assert (g[~x["mask"]] == 0).all()
    for k, v in out.stats.items():  # the statistics of padding are placeholders, never NaN
        if v.is_floating_point():
            assert torch.isfinite(v).all() or k in ("logp",) and torch.isfinite(v[x["mask"]]).all(), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_padding_logits_in_low_and_high_precision(dtype):
    x = inputs(dtype=dtype)
    _, clean = loss_and_grad(x, x["logits"])
    out, g = loss_and_grad(x, poison(x["logits"], x["mask"], "mixed"))
    assert g.dtype == dtype and torch.isfinite(g).all()
    torch.testing.assert_close(g, clean)


@pytest.mark.parametrize("validate", [True, False])
def test_padding_full_logits_mode_with_nan_rollout_logits_on_padding(validate):
    x = inputs()
    _, clean = loss_and_grad(x, x["logits"], mode="pdm-full-kl", rollout_logits=x["rollout_logits"])
    out, g = loss_and_grad(x, poison(x["logits"], x["mask"], math.nan), mode="pdm-full-kl",
                           rollout_logits=poison(x["rollout_logits"], x["mask"], math.nan), validate=validate)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    torch.testing.assert_close(g, clean)
    assert torch.isfinite(out.stats["full_kl"]).all()


@pytest.mark.parametrize("how", ["overflow", "additive-mask"])
def test_padding_through_a_linear_head_gives_a_finite_weight_gradient(how):
    """logits = h W^T + b (+ an additive mask) with non-finite logits on padding rows: the
    head's weight and bias gradients are finite and equal the clean ones.

    ``overflow``: finite but huge hidden states whose logits overflow to inf in float32;
    ``additive-mask``: a (B, T, V) bias of NaN / -inf added on padding rows."""
    x = inputs()
    g = torch.Generator().manual_seed(1)
    H = 8
    h = torch.randn(B, T, H, generator=g)
    head = torch.nn.Linear(H, V)
    with torch.no_grad():
        head.weight.abs_().add_(0.5)  # all positive: a row of huge positive h overflows
    junk = torch.zeros(B, T, V)

    def grads(hidden, add):
        head.zero_grad()
        out = flat.policy_loss(head(hidden) + add, x["sampled_ids"], x["rollout_logprob"], x["topk_ids"],
                                 x["topk_lp"], x["adv"], x["mask"])
        out.loss.backward()
        return out.loss.detach(), head.weight.grad.clone(), head.bias.grad.clone()

    clean = grads(h, junk)
    hp, add = h.clone(), junk.clone()
    if how == "overflow":
        hp[~x["mask"]] = 3e38
    else:
        add[~x["mask"]] = torch.tensor([math.nan, -math.inf] * (V // 2))
    with torch.no_grad():
        assert not torch.isfinite((head(hp) + add)[~x["mask"]]).any()  # the padding logits are non-finite
    dirty = grads(hp, add)
    for c, d in zip(clean, dirty):
        assert torch.isfinite(d).all()
        torch.testing.assert_close(d, c)


def test_hidden_row_stats_with_nan_hidden_on_dead_rows():
    """ops.hidden_row_stats: rows whose log-prob gets no gradient (padding) contribute 0 to
    the gradients of the hidden states and the head weight, even when they are NaN."""
    g = torch.Generator().manual_seed(2)
    N, H = 6, 5
    h = torch.randn(N, H, generator=g)
    W = torch.randn(V, H, generator=g)
    ids = torch.randint(V, (N,), generator=g)
    live = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])

    def grads(hidden):
        hh, WW = hidden.clone().requires_grad_(True), W.clone().requires_grad_(True)
        lp = hidden_row_stats(hh, WW, ids, chunk_rows=5)["logp"]
        (torch.where(live > 0, lp, torch.zeros_like(lp)) * live).sum().backward()
        return hh.grad, WW.grad

    ch, cW = grads(h)
    hp = h.clone()
    hp[1] = math.nan
    hp[4] = math.inf
    dh, dW = grads(hp)
    assert torch.isfinite(dh).all() and torch.isfinite(dW).all()
    torch.testing.assert_close(dW, cW)
    torch.testing.assert_close(dh[live > 0], ch[live > 0])


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_row_stats_backward_rows_without_gradient_are_zero(impl):
    """The op itself: a zero upstream gradient on a NaN/inf row gives a zero gradient row."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, V, generator=g)
    z[1] = math.nan
    z[2, 3] = math.inf
    z = z.requires_grad_(True)
    ids = torch.tensor([0, 1, 2, 3])
    lp = row_stats(z, ids, impl=impl, validate=False)["logp"]
    w = torch.tensor([1.0, 0.0, 0.0, -2.0])
    (torch.where(w != 0, lp, torch.zeros_like(lp)) * w).sum().backward()
    assert torch.isfinite(z.grad).all()
    assert (z.grad[1:3] == 0).all()
    ref = torch.log_softmax(z.detach()[[0, 3]], -1)
    exp = torch.zeros(2, V)
    exp[0] = -ref[0].exp()
    exp[0, 0] += 1
    exp[1] = 2 * ref[1].exp()
    exp[1, 3] -= 2
    torch.testing.assert_close(z.grad[[0, 3]], exp)


def test_padding_junk_in_every_input_at_once():
    """NaN/inf logits, inputs and rollout logits on padding, all modes' loss finite and the
    gradient equal to the clean one."""
    x = inputs()
    m = x["mask"]
    _, clean = loss_and_grad(x, x["logits"], mode="pdm-full-tv", rollout_logits=x["rollout_logits"])
    y = dict(x, sampled_ids=torch.where(m, x["sampled_ids"], torch.full_like(x["sampled_ids"], -7)),
             rollout_logprob=poison(x["rollout_logprob"], m, math.inf), adv=poison(x["adv"], m, math.nan),
             topk_lp=poison(x["topk_lp"], m, math.nan),
             topk_ids=torch.where(m[..., None], x["topk_ids"], torch.full_like(x["topk_ids"], 10**6)))
    out, g = loss_and_grad(y, poison(x["logits"], m, "mixed"), mode="pdm-full-tv",
                           rollout_logits=poison(x["rollout_logits"], m, math.inf))
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    torch.testing.assert_close(g, clean)
    assert torch.isfinite(out.metrics["divergence_mean"]) and torch.isfinite(out.metrics["entropy_mean"])
