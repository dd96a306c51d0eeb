"""The step-free parameter-space instruments: exact inner products, their group split,
the preconditioned form, against finite differences and closed forms in float64."""

import copy

import pytest
import torch

import pdmask

pytest.importorskip("transformers")

from audit_toy import audit_config, llama_batch, perturbed, tiny_llama  # noqa: E402
from tests.flat import token_stats  # noqa: E402
from pdmask_lab.audit.instruments import (GROUPS, _dot, inner_products, optimizer_preconditioner,  # noqa: E402
                                          token_objectives)
from pdmask_lab.audit.steps import copy_in, rollout_stats, trainable  # noqa: E402
from pdmask.engine.hf import response_logits  # noqa: E402

F64 = torch.float64


def total_inner_product(model: torch.nn.Module, forward, rb, advantages: torch.Tensor, b: int, t: int,
                        cfg, *, P: list | None = None) -> torch.Tensor:
    """``<grad D_t, P grad L_t>`` over the model's own (tied) parameters, without any split:
    the reference the group split is tested against."""
    params = trainable(model)
    rows = slice(b, b + 1)
    z = forward(model, rb.sequences[rows], rb.attention_mask[rows], rb.prompt_len)[0, t]  # (V,)
    D, logp = token_objectives(z, rb, b, t, cfg.divergence, cfg.temperature)
    gD = torch.autograd.grad(D, params, allow_unused=True, retain_graph=True)
    gL = torch.autograd.grad(advantages[b, t].to(logp.dtype) * logp, params, allow_unused=True)
    tot = torch.zeros((), dtype=F64)
    for i, (a, c) in enumerate(zip(gD, gL)):
        if a is not None and c is not None:
            tot = tot + _dot(a, c, None if P is None else P[i])
    return tot
TOKENS = torch.tensor([[0, 0], [0, 2], [1, 1], [2, 4]])  # two tokens of one sequence: the shared forward


def setup(tied, temperature=1.0, divergence="topk_kl"):
    model = copy_in(tiny_llama(tied=tied), F64)  # float64 throughout (transformers' RMSNorm upcasts to float32)
    engine = perturbed(model, 0.2)
    rb, A = llama_batch(model, engine, temperature=temperature)
    return model, rb, A, audit_config(divergence=divergence, temperature=temperature, lr=1e-3, betas=(0.9, 0.99))


def warm_state(model, rb, steps=3):
    """An AdamW state after a few steps of some loss (non-uniform second moments)."""
    work = copy.deepcopy(model)
    opt = torch.optim.AdamW(work.parameters(), lr=1e-3, betas=(0.9, 0.99))
    for s in range(steps):
        z = response_logits(work, rb.sequences, rb.attention_mask, rb.prompt_len)
        loss = -(z.log_softmax(-1)[..., s].mean()) + (z ** 2).mean() * 0.1
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt.state_dict()


def D_and_grad_L(model, rb, A, cfg, b, t):
    params = trainable(model)
    rows = slice(b, b + 1)
    st = rollout_stats(response_logits(model, rb.sequences[rows], rb.attention_mask[rows], rb.prompt_len), rb, rows,
                       sampling=cfg.loss.sampling)
    g = torch.autograd.grad(A[b, t] * st["logp"][0, t], params)
    return params, g


@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv", "full_kl", "full_tv"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_objectives_equal_token_stats(divergence, temperature):
    model, rb, A, cfg = setup(True, temperature, divergence)
    with torch.no_grad():
        z = response_logits(model, rb.sequences, rb.attention_mask, rb.prompt_len)
    st = rollout_stats(z, rb, sampling=cfg.loss.sampling)
    for b in range(z.shape[0]):
        for t in range(z.shape[1]):
            if not rb.response_mask[b, t]:
                continue  # padding: token_stats sanitises it
            D, logp = token_objectives(z[b, t], rb, b, t, divergence, temperature)
            assert D.item() == pytest.approx(st[divergence][b, t].item(), rel=1e-12, abs=1e-15)
            assert logp.item() == pytest.approx(st["logp"][b, t].item(), rel=1e-12)
    # and a case where the sampled token lies outside the top-K (its own column in S')
    k = rb.response_ids
    assert (rb.rollout.topk_ids != k[..., None]).all(-1).any()


def D_at(model, rb, cfg, b, t):
    rows = slice(b, b + 1)
    with torch.no_grad():
        z = response_logits(model, rb.sequences[rows], rb.attention_mask[rows], rb.prompt_len)
        return rollout_stats(z, rb, rows, sampling=cfg.loss.sampling)[cfg.divergence][0, t]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("divergence", ["topk_kl", "full_tv"])
def test_inner_product_equals_central_difference(tied, divergence):
    model, rb, A, cfg = setup(tied, divergence=divergence)
    ip = inner_products(model, response_logits, rb, A, TOKENS, cfg)
    for i, (b, t) in enumerate(TOKENS.tolist()):
        params, g = D_and_grad_L(model, rb, A, cfg, b, t)
        gnorm = torch.sqrt(sum((x ** 2).sum() for x in g))
        eps = 1e-5 / gnorm  # theta +- eps grad L: a step of length 1e-5
        m2 = copy.deepcopy(model)
        p2 = trainable(m2)
        with torch.no_grad():
            for p, x in zip(p2, g):
                p.add_(eps * x)
        up = D_at(m2, rb, cfg, b, t)
        with torch.no_grad():
            for p, x in zip(p2, g):
                p.sub_(2 * eps * x)
        down = D_at(m2, rb, cfg, b, t)
        fd = (up - down) / (2 * eps)
        assert ip["ip"][i].item() == pytest.approx(fd.item(), rel=1e-6, abs=1e-12), (b, t)
        assert abs(ip["ip"][i].item()) > 1e-8


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("warm", [False, True])
def test_group_split_sums_to_the_total(tied, warm):
    model, rb, A, cfg = setup(tied)
    P = optimizer_preconditioner(trainable(model), cfg, warm_state(model, rb) if warm else None)
    ip = inner_products(model, response_logits, rb, A, TOKENS, cfg, P=P)
    for i, (b, t) in enumerate(TOKENS.tolist()):
        for prefix, PP in (("ip", None), ("pip", P)):
            total = total_inner_product(model, response_logits, rb, A, b, t, cfg, P=PP).item()
            parts = sum(ip[f"{prefix}_{g}"][i].item() for g in GROUPS)
            assert abs(parts - total) <= 1e-10 * max(1.0, abs(total)), (prefix, b, t, parts, total)
            assert ip[prefix][i].item() == pytest.approx(total, rel=1e-12, abs=1e-15)
        # every group carries something; cross exists only when the matrix is shared
        assert all(abs(ip[f"ip_{g}"][i].item()) > 0 for g in ("head", "embed", "body"))
        assert (ip["ip_cross"][i].item() != 0) == tied


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_group_is_the_logit_space_prediction(tied, temperature):
    """Through the output projection alone, grad_W log pi_k = (e_k - pi) h^T / T and
    grad_W D = grad_u D h^T / T (u = z / T), so head = A |h|^2 Ddot / T^2."""
    model, rb, A, cfg = setup(tied, temperature)
    ip = inner_products(model, response_logits, rb, A, TOKENS, cfg)
    hs = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, r: hs.append(a[0].detach()))
    with torch.no_grad():
        z = response_logits(model, rb.sequences, rb.attention_mask, rb.prompt_len)
    hook.remove()
    h = hs[0]  # (B, T, H): the LM head's input at the response positions
    st = pdmask.token_stats(z, rb.rollout, sampling=pdmask.Sampling(temperature))
    for i, (b, t) in enumerate(TOKENS.tolist()):
        expect = A[b, t] * (h[b, t] ** 2).sum() * st["ddot_topk_kl_exact"][b, t] / temperature ** 2
        assert ip["ip_head"][i].item() == pytest.approx(expect.item(), rel=1e-9, abs=1e-14)


def test_preconditioner_is_adamw_linearised():
    """P g equals the first-order response of AdamW's real next step to an added gradient g."""
    model, rb, A, cfg = setup(False)
    state = warm_state(model, rb)
    params = trainable(model)
    P = optimizer_preconditioner(params, cfg, state)
    g = [torch.randn(p.shape, dtype=F64, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]

    def update(scale):
        m = copy.deepcopy(model)
        ps = trainable(m)
        opt = torch.optim.AdamW(ps, lr=cfg.lr, betas=cfg.betas)
        opt.load_state_dict(copy.deepcopy(state))
        for p, x in zip(ps, g):
            p.grad = scale * x
        before = [p.detach().clone() for p in ps]
        opt.step()
        return [p.detach() - q for p, q in zip(ps, before)]

    h = 1e-6
    up, down = update(h), update(-h)
    checked = 0
    for d in range(len(params)):
        lin = (up[d] - down[d]) / (2 * h)  # = -P g (the step descends)
        # where the state's second moment is 0 (e.g. embedding rows never looked up) the
        # real step is sign-like, (1 - b2) h^2 g^2 dominates and there is no linear regime
        v = state["state"][d]["exp_avg_sq"]
        ok = v > 1e-8
        torch.testing.assert_close(lin[ok], (-P[d] * g[d])[ok], rtol=1e-4, atol=1e-12)
        checked += int(ok.sum())
    assert checked > 0.5 * sum(p.numel() for p in params)


def test_fresh_state_is_a_multiple_of_the_identity():
    model, rb, A, cfg = setup(True)
    P = optimizer_preconditioner(trainable(model), cfg, None)
    vals = torch.cat([p.reshape(-1) for p in P])
    assert torch.allclose(vals, torch.full_like(vals, cfg.lr / 1e-8))
