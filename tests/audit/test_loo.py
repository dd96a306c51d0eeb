"""The leave-one-out batch step equals two explicit optimizer steps (float64)."""

import copy

import pytest
import torch

import pdmask

from audit_toy import BigramLM, audit_config, bigram_forward, perturbed, sample_batch
from pdmask_lab.audit.loo import BatchStep, aggregation_weights
from pdmask_lab.audit.steps import batch_step, rollout_stats

F64 = torch.float64


@pytest.fixture(scope="module")
def toy():
    pol = BigramLM(vocab=12, dim=8).to(F64)
    eng = perturbed(pol, 0.3)
    rb, adv = sample_batch(eng, seed=0, B=6, T=5)
    A = torch.where(rb.response_mask, adv[:, None].expand(rb.response_mask.shape), 0.0).to(F64)
    # a warm AdamW state: three steps on other batches
    work = copy.deepcopy(pol)
    opt = torch.optim.AdamW(work.parameters(), lr=1e-2, betas=(0.9, 0.99))
    for s in range(3):
        rb2, _ = sample_batch(eng, seed=10 + s)
        loss = -bigram_forward(work, rb2.sequences, None, rb2.prompt_len).log_softmax(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return pol, rb, A, opt.state_dict()


def _cfg(**kw):
    base = dict(divergence="topk_kl", optimizer="adamw", lr=1e-2, betas=(0.9, 0.99), grad_clip=0.5)
    base.update(kw)
    return audit_config(**base)


def _explicit_D(pol, rb, A, cfg, state):
    """D after one explicit float64 batch step (the audit's batch_step) with advantages A."""
    _, _, after = batch_step(pol, bigram_forward, rb, A, cfg, optimizer_state=state)
    return rollout_stats(after, rb, sampling=cfg.loss.sampling)[cfg.divergence]


@pytest.mark.parametrize("loss_agg,step_mode", [("token-mean", "none"), ("seq-mean-token-mean", "pdm-topk-kl"),
                                                ("seq-mean-token-sum-norm", "none")])
def test_own_effect_equals_two_explicit_steps(toy, loss_agg, step_mode):
    pol, rb, A, state = toy
    cfg = _cfg(loss_agg=loss_agg, step_mode=step_mode, delta_low=0.02, delta_high=0.02)
    bs = BatchStep(pol, bigram_forward, rb, A, cfg, optimizer_state=state)
    full = _explicit_D(pol, rb, A, cfg, state)
    torch.testing.assert_close(bs.divergence_after(), full, rtol=1e-12, atol=1e-14)
    tokens = torch.tensor([[0, 0], [0, 3], [2, 1], [5, 1]])  # two in one row: the shared-forward path
    own = bs.own_effect(tokens)
    nonzero = 0
    for i, (b, t) in enumerate(tokens.tolist()):
        A_wo = A.clone()
        A_wo[b, t] = 0.0  # the explicit "batch step without token t"
        d_wo = _explicit_D(pol, rb, A_wo, cfg, state)
        expect = full[b, t] - d_wo[b, t]
        assert own[i].item() == pytest.approx(expect.item(), rel=1e-8, abs=1e-15)
        nonzero += abs(expect.item()) > 1e-9
    # real, measurable effects (a token the step's own mask drops has exactly none)
    assert nonzero >= 2
    # a set E of several tokens, D read at chosen rows
    E = torch.zeros_like(rb.response_mask)
    E[1, :3] = True
    E[4, 2] = True
    A_wo = torch.where(E, 0.0, A)
    rows = torch.tensor([1, 3, 4])
    torch.testing.assert_close(bs.divergence_after(E, rows), _explicit_D(pol, rb, A_wo, cfg, state)[rows],
                               rtol=1e-12, atol=1e-14)
    # the policy itself is untouched
    assert all(torch.equal(a, b) for a, b in zip(pol.state_dict().values(), BigramLM(12, 8).to(F64).state_dict().values()))


def test_aggregation_weights_hand_values():
    m = torch.tensor([[True, True, True, False], [True, False, False, False]])
    # token-mean: 1/4 on each of the 4 response tokens
    assert aggregation_weights(m, pdmask.Aggregation("token-mean")).tolist() == [[0.25, 0.25, 0.25, 0.0], [0.25, 0.0, 0.0, 0.0]]
    # seq-mean-token-mean: 1/(n_b * 2): 1/6 in row 0, 1/2 in row 1
    w = aggregation_weights(m, pdmask.Aggregation("seq-mean-token-mean"))
    torch.testing.assert_close(w, torch.tensor([[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0]], dtype=F64))


def test_bad_inputs(toy):
    pol, rb, A, state = toy
    with pytest.raises(ValueError, match="optimizer_state"):
        BatchStep(pol, bigram_forward, rb, A, _cfg(optimizer="sgd"), optimizer_state=state)
    bs = BatchStep(pol, bigram_forward, rb, A, _cfg())
    with pytest.raises(ValueError, match="exclude"):
        bs.divergence_after(torch.zeros(2, 2, dtype=torch.bool))
    assert bs.own_effect(torch.zeros(0, 2, dtype=torch.long)).shape == (0,)
