"""The preconditioner P is the optimizer's own first-order response: checked against real steps."""

import copy

import pytest
import torch

import pdmask
from pdmask_lab.batchmask import batch_mask, preconditioner

from .helpers import TinyLM, logits_of, make_batch, region_and_weights
from tests import flat  # noqa: E402


def _random_steps(model, opt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    opt.zero_grad(set_to_none=True)


def _token_loss_grad(model, batch, b, t):
    """Gradient of the minimised single-token loss ``-w A log pi_t`` (w, A detached)."""
    _, w, A, _ = region_and_weights(model, batch)
    z = logits_of(model, batch)
    T = z.shape[1]
    logp = torch.log_softmax(z, -1)[b, t, batch["input_ids"][b, -T + t]]
    return torch.autograd.grad(-w[b, t] * A[b, t] * logp, list(model.parameters()))


def _step_with(model, opt, grads):
    """Copies of (model, optimizer), one step with ``grads``; returns the new parameters."""
    m2, o2 = copy.deepcopy((model, opt))
    for p, g in zip(m2.parameters(), grads):
        p.grad = g.clone()
    o2.step()
    return [p.detach() for p in m2.parameters()]


def _central_response(model, opt, g, eps):
    plus = _step_with(model, opt, [eps * x for x in g])
    minus = _step_with(model, opt, [-eps * x for x in g])
    return [(a - b) / (2 * eps) for a, b in zip(plus, minus)]


def _P(opt, model):
    names, params = zip(*model.named_parameters())
    return preconditioner(opt, list(params), list(names))


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=True),
    "adam-decoupled": lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.05, decoupled_weight_decay=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
}


# Adam before its first step has its own test (P = lr / eps)
CASES = [(n, s) for n in sorted(OPTIMIZERS) for s in (0, 3) if not (n.startswith("adam") and s == 0)]


@pytest.mark.parametrize("name,steps_before", CASES)
def test_P_is_the_optimizers_next_update_response_to_a_single_tokens_gradient(name, steps_before):
    """(step(+eps g) - step(-eps g)) / 2 eps = -P g: momentum and weight decay cancel."""
    m = TinyLM(seed=1)
    opt = OPTIMIZERS[name](m.parameters())
    _random_steps(m, opt, steps_before)
    batch = make_batch(m, seed=1)
    g = _token_loss_grad(m, batch, 0, 2)
    got = _central_response(m, opt, g, 1e-4)
    want = [-(d * x) for d, x in zip(_P(opt, m), g)]
    scale = max(w.abs().max().item() for w in want)  # rounding of theta +- a small step: relative to the largest
    for (n, _), r, w in zip(m.named_parameters(), got, want):
        assert w.abs().max() > 0
        torch.testing.assert_close(r, w, atol=1e-9 * scale, rtol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


def test_adamw_before_its_first_step_gives_P_equal_lr_over_eps():
    m = TinyLM(seed=2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)
    P = _P(opt, m)
    for d in P:
        torch.testing.assert_close(d, torch.full_like(d, 1e-2 / 1e-3))
    # the real first step for a gradient far below eps: -lr g / (|g| + eps) ~ -(lr / eps) g
    g = _token_loss_grad(m, make_batch(m, seed=2), 1, 1)
    got = _central_response(m, opt, g, 1e-9)  # eps |g| / adam_eps <= 3e-6: linear regime
    scale = max((d * x).abs().max().item() for d, x in zip(P, g))
    for r, x, d in zip(got, g, P):
        torch.testing.assert_close(r, -(d * x), atol=1e-7 * scale, rtol=1e-5)


def test_c_of_a_single_token_batch_predicts_phi_after_the_real_adamw_step():
    """The whole chain: c_t (P from AdamW's state) = d/de Phi(AdamW step with gradient e grad(-l_t))."""
    m = TinyLM(seed=3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, betas=(0.9, 0.99), weight_decay=0.01)
    _random_steps(m, opt, 4, seed=3)
    batch = make_batch(m, seed=3)
    b, t = 2, 1
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    batch["response_mask"][b, t] = True  # a single-token batch
    out = flat.batch_mask(m, **batch, optimizer=opt, delta_low=1e-6, delta_high=1e-6, all_tokens=True)
    assert out.out_of_region.sum() == 1 and out.out_of_region[b, t]
    g = _token_loss_grad(m, batch, b, t)
    T = batch["response_mask"].shape[1]

    def phi_after(eps):
        new = _step_with(m, opt, [eps * x for x in g])
        named = {n: p for (n, _), p in zip(m.named_parameters(), new)}
        z = logits_of(m, batch, named).detach()
        st = flat.token_stats(z, batch["input_ids"][:, -T:], batch["rollout_logprob"], batch["rollout_topk_ids"],
                                batch["rollout_topk_logprobs"], response_mask=batch["response_mask"])
        return st["topk_kl"][b, t].item()

    eps = 1e-3
    fd = (phi_after(eps) - phi_after(-eps)) / (2 * eps)
    assert abs(fd) > 1e-6
    # exact up to the O(lr) shift of the evaluation point by momentum and weight decay
    assert out.c[b, t].item() == pytest.approx(fd, rel=1e-4)


@pytest.mark.parametrize("make,msg", [
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "L2 weight_decay"),
    (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize=True"),
    (lambda ps: torch.optim.RMSprop(ps), "RMSprop is not supported"),
    (lambda ps: torch.optim.SGD(list(ps)[:1], lr=0.1), "is not in any of its param groups"),
])
def test_unsupported_optimizers_are_refused_in_one_line(make, msg):
    m = TinyLM(seed=4)
    with pytest.raises(ValueError, match=f"^optimizer: .*{msg}") as e:
        flat.batch_mask(m, **make_batch(m, seed=4), optimizer=make(m.parameters()))
    assert "\n" not in str(e.value)
