"""Each bad input raises a ValueError whose message names the argument."""

import math

import pytest
import torch

import pdmask
from tests import flat  # noqa: E402


def good(B=2, T=3, V=10, K=3):
    torch.manual_seed(0)
    logits = torch.randn(B, T, V)
    lp = torch.log_softmax(torch.randn(B, T, V), -1)
    top = lp.topk(K, -1)
    ids = top.indices[..., 0]
    return dict(logits=logits, sampled_ids=ids, rollout_logprob=top.values[..., 0],
                rollout_topk_ids=top.indices, rollout_topk_logprobs=top.values,
                advantages=torch.ones(B, T), response_mask=torch.ones(B, T, dtype=torch.bool))


def call(**over):
    args = good()
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return flat.policy_loss(args["logits"], args["sampled_ids"], args["rollout_logprob"],
                              args["rollout_topk_ids"], args["rollout_topk_logprobs"], args["advantages"],
                              args["response_mask"], **kw)


def _dup():
    t = good()["rollout_topk_ids"].clone()
    t[0, 1, 2] = t[0, 1, 0]
    return t


def _big(name, val):
    t = good()[name].clone()
    t[1, 2] = val
    return t


CASES = [
    ("logits 1-D", dict(logits=torch.randn(10)), "logits"),
    ("logits dtype", dict(logits=torch.randint(0, 3, (2, 3, 10))), "logits"),
    ("sampled shape", dict(sampled_ids=torch.zeros(2, 4, dtype=torch.long)), "rollout.sampled_ids"),
    ("sampled dtype", dict(sampled_ids=torch.zeros(2, 3)), "rollout.sampled_ids"),
    ("sampled range", dict(sampled_ids=torch.full((2, 3), 10)), "rollout.sampled_ids"),
    ("sampled negative", dict(sampled_ids=torch.full((2, 3), -1)), "rollout.sampled_ids"),
    ("rollout shape", dict(rollout_logprob=torch.zeros(2)), "rollout.sampled_logprob"),
    ("rollout positive", dict(rollout_logprob=torch.full((2, 3), 0.5)), "rollout.sampled_logprob"),
    ("rollout nan", dict(rollout_logprob=torch.full((2, 3), math.nan)), "rollout.sampled_logprob"),
    ("rollout -inf", dict(rollout_logprob=torch.full((2, 3), -math.inf)), "rollout.sampled_logprob"),
    ("topk shape", dict(rollout_topk_ids=torch.zeros(2, 3, dtype=torch.long)), "rollout.topk_ids"),
    ("topk K > V", dict(rollout_topk_ids=torch.arange(11).expand(2, 3, 11),
                        rollout_topk_logprobs=torch.full((2, 3, 11), -5.0)), "rollout.topk_ids"),
    ("topk range", dict(rollout_topk_ids=_big("rollout_topk_ids", 99).long()), "rollout.topk_ids"),
    ("topk duplicate", dict(rollout_topk_ids=_dup()), "rollout.topk_ids"),
    ("topk lp shape", dict(rollout_topk_logprobs=torch.zeros(2, 3, 2)), "rollout.topk_logprobs"),
    ("topk lp positive", dict(rollout_topk_logprobs=_big("rollout_topk_logprobs", 0.1)), "rollout.topk_logprobs"),
    ("topk lp nan", dict(rollout_topk_logprobs=_big("rollout_topk_logprobs", math.nan)), "rollout.topk_logprobs"),
    ("topk mass > 1", dict(rollout_topk_logprobs=torch.full((2, 3, 3), math.log(0.5))), "rollout.topk_logprobs"),
    ("topk half missing", dict(rollout_topk_logprobs=None), "rollout.topk_logprobs"),
    ("topk needed", dict(rollout_topk_ids=None, rollout_topk_logprobs=None), "rollout.topk_ids"),
    ("full needed", dict(mode="pdm-full-kl"), "rollout.logits"),
    ("advantages shape", dict(advantages=torch.ones(3)), "advantages"),
    ("advantages nan", dict(advantages=torch.full((2, 3), math.nan)), "advantages"),
    ("mask shape", dict(response_mask=torch.ones(2, 2)), "rollout.response_mask"),
    ("unknown mode", dict(mode="ppo-magic"), "mode"),
    ("unknown estimator", dict(estimator="guess"), "estimator"),
    ("unknown agg", dict(loss_agg="sum"), "loss_agg"),
    ("delta zero", dict(delta_low=0.0), "delta_low"),
    ("delta negative", dict(delta_high=-0.1), "delta_high"),
    ("eps zero", dict(eps_low=0.0, mode="grpo"), "eps_low"),
    ("is_cap zero", dict(is_cap=0.0), "is_cap"),
    ("temperature", dict(temperature=0.0), "temperature"),
    ("chunk", dict(chunk_size=0), "chunk_rows"),
    ("all -inf row", dict(logits=torch.full((2, 3, 10), -math.inf)), "logits"),
]


@pytest.mark.parametrize("name,over,arg", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(name, over, arg):
    with pytest.raises(ValueError) as e:
        call(**over)
    assert str(e.value).startswith(arg + ":"), str(e.value)


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError) as e:
        call(mode="nope")
    for m in pdmask.MODES:
        assert m in str(e.value)


def test_good_input_passes_and_bad_values_on_padding_are_ignored():
    assert torch.isfinite(call().loss)
    m = torch.ones(2, 3, dtype=torch.bool)
    m[1, 2] = False
    assert torch.isfinite(call(rollout_logprob=_big("rollout_logprob", 0.5), response_mask=m).loss)


def test_register_mode_is_a_few_lines_and_refuses_duplicates():
    from pdmask import MaskMode, divergence_region, predictive, register_mode

    mode = register_mode(MaskMode("pdm-binary-kl-test", divergence_region("binary_kl"),
                                  predictive("binary_kl"), "binary_kl"), overwrite=True)
    try:
        a = call(mode="pdm-binary-kl-test", delta_low=1e-4, delta_high=1e-4)
        b = call(mode="dppo-binary-kl", delta_low=1e-4, delta_high=1e-4)
        assert torch.equal(a.mask, b.mask)  # binary predictive == ratio direction
        with pytest.raises(ValueError, match="mode: 'pdm-binary-kl-test' is already registered"):
            register_mode(mode)
    finally:
        pdmask.MODES.pop("pdm-binary-kl-test")


def test_validate_false_skips_the_checks_and_their_host_sync():
    """validate=False is the trusted hot path: the finite-row check (a host sync) is not made."""
    with pytest.raises(ValueError, match="^logits:"):
        call(logits=torch.full((2, 3, 10), -math.inf))
    call(logits=torch.full((2, 3, 10), -math.inf), validate=False)  # no raise, no sync
