"""The core API routed through pdmask.ops: every mode and statistic agrees between the op's
reductions and the tests' plain-torch oracle's (``oracle_rows``), values and gradients."""

import contextlib

import pytest
import torch

import pdmask
import pdmask_lab.batchmask  # noqa: F401  (its modes are every mode too)
from tests import flat  # noqa: E402

from _ops_cases import oracle_rows


def _batch(dtype, *, B=3, T=6, V=64, K=5, seed=0, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    zr = z + 0.7 * torch.randn(B, T, V, generator=g, dtype=torch.float64)  # the rollout policy mu
    logmu = torch.log_softmax(zr / temperature, -1)
    k = torch.multinomial(logmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    tk_lp, tk_ids = logmu.topk(K, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -2:] = False  # padding
    adv = torch.randn(B, generator=g, dtype=torch.float64).float()
    adv[1] = -adv[1].abs()
    return dict(
        logits=z.to(dtype), sampled_ids=k, rollout_logprob=logmu.gather(-1, k[..., None])[..., 0].float(),
        rollout_topk_ids=tk_ids, rollout_topk_logprobs=tk_lp.float(), advantages=adv,
        response_mask=mask, rollout_logits=zr.to(dtype),
    )


def _tol(dtype):
    return {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 2e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_token_stats_all_keys_agree(dtype, temperature):
    b = _batch(dtype, temperature=temperature)
    args = {k: b[k] for k in ("logits", "sampled_ids", "rollout_logprob", "rollout_topk_ids",
                               "rollout_topk_logprobs")}
    with oracle_rows():
        ref = flat.token_stats(**args, response_mask=b["response_mask"], rollout_logits=b["rollout_logits"],
                               temperature=temperature)
    got = flat.token_stats(**args, response_mask=b["response_mask"], rollout_logits=b["rollout_logits"],
                             temperature=temperature, impl="torch", chunk_size=4)
    assert set(got) == set(ref)
    v = b["response_mask"]
    for key in ref:
        if ref[key].dtype == torch.bool:
            assert torch.equal(got[key][v], ref[key][v]), key
        else:
            torch.testing.assert_close(got[key][v].double(), ref[key][v].double(), **_tol(dtype),
                                       msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("mode", sorted(pdmask.MODES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_policy_loss_every_mode_value_grad_mask(mode, dtype):
    b = _batch(dtype, seed=3)
    full = "full" in pdmask.get_mode(mode).needs
    # the batch modes' direction comes from the model (pdmask_lab.batchmask); any signed (B, T) will do here
    bd = torch.randn(b["sampled_ids"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    bd = bd if pdmask.get_mode(mode).extras else None
    outs, grads = {}, {}
    for impl in ("reference", "torch", "auto"):
        x = b["logits"].clone().requires_grad_()
        with oracle_rows() if impl == "reference" else contextlib.nullcontext():
            out = flat.policy_loss(
                x, b["sampled_ids"], b["rollout_logprob"], b["rollout_topk_ids"], b["rollout_topk_logprobs"],
                b["advantages"], b["response_mask"], mode=mode, rollout_logits=b["rollout_logits"] if full else None,
                delta_low=0.02, delta_high=0.02, impl="torch" if impl == "reference" else impl, batch_ddot=bd)
        out.loss.backward()
        outs[impl], grads[impl] = out, x.grad
    ref = outs["reference"]
    assert ref.loss.abs() > 0 and grads["reference"].abs().sum() > 0  # the comparison is not vacuous
    for impl in ("torch", "auto"):
        o = outs[impl]
        assert torch.equal(o.mask, ref.mask)
        torch.testing.assert_close(o.loss.double(), ref.loss.double(), **_tol(dtype))
        assert grads[impl].dtype == dtype
        gt = _tol(dtype) if dtype == torch.float64 else {"atol": 1e-4, "rtol": 2e-2}  # bf16 gradient rounding
        torch.testing.assert_close(grads[impl].double(), grads["reference"].double(), **gt)
        for key, val in ref.metrics.items():
            torch.testing.assert_close(o.metrics[key].double(), val.double(), **_tol(dtype),
                                       msg=lambda m, key=key: f"{key}: {m}")


def test_trust_region_mask_impls_agree_and_mask_something():
    b = _batch(torch.float32, seed=5)
    args = (b["logits"], b["sampled_ids"], b["rollout_logprob"], b["rollout_topk_ids"],
            b["rollout_topk_logprobs"], b["advantages"], b["response_mask"])
    with oracle_rows():
        ref = flat.trust_region_mask(*args, delta_low=0.01, delta_high=0.01)
    got = flat.trust_region_mask(*args, delta_low=0.01, delta_high=0.01, impl="torch")
    assert (~ref).any() and torch.equal(got, ref)


def test_full_part_is_there_with_the_rollout_logits_only():
    b = _batch(torch.float64)
    args = (b["logits"], b["sampled_ids"], b["rollout_logprob"])
    st = flat.token_stats(*args, rollout_logits=b["rollout_logits"], impl="torch")
    assert {"full_kl", "full_tv", "ddot_full_kl", "ddot_full_tv"} <= set(st) and st.full is not None
    assert flat.token_stats(*args, impl="torch").full is None


def test_impl_and_chunk_size_are_validated():
    b = _batch(torch.float32)
    args = (b["logits"], b["sampled_ids"], b["rollout_logprob"])
    with pytest.raises(ValueError, match="impl"):
        flat.token_stats(*args, impl="cuda")
    with pytest.raises(ValueError, match="chunk_rows"):
        flat.token_stats(*args, chunk_size=0, impl="torch")
    with pytest.raises(ValueError, match="logits: a response row has no finite logit"):
        x = b["logits"].clone()
        x[1, 2] = float("-inf")
        flat.token_stats(x, *args[1:], impl="torch")
