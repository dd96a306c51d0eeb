"""Bad input to the batch mask: one line naming the argument, before any work is done."""

import pytest
import torch

from tests import flat  # noqa: E402

from pdmask_lab.batchmask import batch_mask

from .helpers import TinyLM, make_batch

M = TinyLM(seed=0)
B = make_batch(M, seed=0)


def _with(**over):
    """A call of batch_mask with some data or settings replaced."""
    over = dict(over)
    model = over.pop("model", M)
    return lambda: flat.batch_mask(model, **{**B, **over})


def _bad_attention():
    am = B["attention_mask"].clone()
    am[2, -1] = False  # a response token the model cannot see
    return am


CASES = [
    (dict(model="not a model"), "model", "must be a torch.nn.Module"),
    (dict(divergence="binary_kl"), "divergence", "unknown value 'binary_kl'; valid values are: topk_kl, topk_tv"),
    (dict(estimator="best"), "estimator", "unknown value 'best'"),
    (dict(scope="everything"), "scope", "unknown value 'everything'; valid values are: region, all"),
    (dict(method="fd"), "method", "unknown value 'fd'; valid values are: auto, jvp, double-backward"),
    (dict(temperature=0.0), "temperature", "must be a positive finite number"),
    (dict(thresholds=0.05), "thresholds", "must be a pdmask.Thresholds (or None), got float"),
    (dict(sampling=1.0), "sampling", "must be a pdmask.Sampling (or None), got float"),
    (dict(sampling_top_p=0.9), "sampling", "top_k / top_p / min_p are not available"),
    (dict(is_cap=-1.0), "is_cap", "must be a positive number"),
    (dict(delta_low=-0.1), "delta_low", "must be a positive number"),
    (dict(params="last"), "params", "unknown value 'last'"),
    (dict(optimizer="adamw"), "optimizer", "expected None or a torch.optim.Optimizer"),
    (dict(input_ids=B["input_ids"].double()), "input_ids", "must be an integer tensor"),
    (dict(input_ids=B["input_ids"][0]), "input_ids", "expected a 2-D torch.Tensor"),
    (dict(attention_mask=B["attention_mask"][:, 1:]), "attention_mask", "expected shape"),
    (dict(response_mask=torch.ones(3, 10, dtype=torch.bool)), "rollout.response_mask", "1 <= T < 10"),
    (dict(attention_mask=_bad_attention()), "rollout.response_mask", "marks a response token that attention_mask masks"),
    (dict(rollout_topk_ids=None, rollout_topk_logprobs=None), "rollout.topk_ids", "needs the rollout top-K"),
    (dict(rollout_logprob=B["rollout_logprob"][:, 1:]), "rollout.sampled_logprob", "expected shape"),
    (dict(rollout_logprob=B["rollout_logprob"].abs() + 1), "rollout.sampled_logprob", "must be <= 0"),
    (dict(rollout_topk_logprobs=B["rollout_topk_logprobs"] * float("nan")), "rollout.topk_logprobs", "NaN"),
    (dict(advantages=torch.ones(2, dtype=torch.float64)), "advantages", "expected shape"),
    (dict(advantages=torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64)), "advantages", "contains NaN"),
]


@pytest.mark.parametrize("over,arg,msg", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_naming_the_argument(over, arg, msg):
    with pytest.raises(ValueError) as e:
        _with(**over)()
    text = str(e.value)
    assert text.startswith(f"{arg}: ") and msg in text and "\n" not in text, text


def test_a_model_that_returns_no_logits_is_named():
    class NoLogits(TinyLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return super().forward(input_ids, attention_mask, position_ids)[..., 0]  # (B, L): no vocabulary

    with pytest.raises(ValueError, match=r"^model: expected logits \(B, L - 1, V\) from the forward, got \(3, 9\)"):
        flat.batch_mask(NoLogits(), **B)
