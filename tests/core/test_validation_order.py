"""Every argument is checked before any O(N V) work touches the logits.

The vocabulary reductions are replaced by functions that fail loudly; a bad argument
must raise its own ValueError (naming the argument) without ever reaching them.
"""

import math

import pytest
import torch

import pdmask
from pdmask import ops
from tests import flat  # noqa: E402


class TouchedLogits(AssertionError):
    pass


@pytest.fixture
def no_logits(monkeypatch):
    """Every entry to the (N, V) reductions raises ``TouchedLogits``."""

    def boom(*a, **k):
        raise TouchedLogits("the logits were reduced before the arguments were checked")

    monkeypatch.setattr(ops, "row_stats", boom)
    monkeypatch.setattr(ops, "_torch_forward", boom)


def _args(B=2, T=3, V=11, K=3):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    lp = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    top = lp.topk(K, -1)
    return (logits, top.indices[..., 0], top.values[..., 0], top.indices, top.values,
            torch.randn(B, T, generator=g), torch.ones(B, T, dtype=torch.bool))


BAD_LOSS_ARGS = [
    ("estimator", dict(estimator="exactish")),
    ("mode", dict(mode="pdm-topk-kld")),
    ("impl", dict(impl="cuda")),
    ("chunk_rows", dict(chunk_size=0)),
    ("chunk_rows", dict(chunk_size=2.5)),
    ("temperature", dict(temperature=0.0)),
    ("temperature", dict(temperature=math.nan)),
    ("delta_low", dict(delta_low=-0.1)),
    ("delta_high", dict(delta_high=math.nan)),
    ("eps_low", dict(eps_low=0.0)),
    ("eps_high", dict(eps_high=-1.0)),
    ("is_cap", dict(is_cap=0.0)),
    ("loss_agg", dict(loss_agg="token-summ")),
    ("num_tokens", dict(dp_size=2)),  # token-mean over 2 ranks needs the global token count
    ("dp_size", dict(dp_size=0)),
    ("rollout.logits", dict(mode="pdm-full-kl")),  # the mode needs mu's full logits
    ("surrogate", dict(mode=pdmask.MaskMode("x", pdmask.ratio_region(), pdmask.ratio_sign(), "binary_kl",
                                            surrogate="ppo"))),
    ("divergence", dict(mode=pdmask.MaskMode("x", pdmask.ratio_region(), pdmask.ratio_sign(), "binary_kld"))),
]


def test_the_patched_reductions_are_reached_with_good_arguments(no_logits):
    # without this the tests below could pass vacuously
    with pytest.raises(TouchedLogits):
        flat.policy_loss(*_args())
    with pytest.raises(TouchedLogits):
        flat.token_stats(*_args()[:5])


@pytest.mark.parametrize("name,kw", BAD_LOSS_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_LOSS_ARGS)])
def test_policy_loss_checks_before_reducing(no_logits, name, kw):
    with pytest.raises(ValueError, match=f"^{name}:"):
        flat.policy_loss(*_args(), **kw)


@pytest.mark.parametrize("name,kw", [x for x in BAD_LOSS_ARGS
                                     if x[0] not in ("is_cap", "loss_agg", "num_tokens", "dp_size")],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_trust_region_mask_checks_before_reducing(no_logits, name, kw):
    with pytest.raises(ValueError, match=f"^{name}:"):
        flat.trust_region_mask(*_args(), **kw)


@pytest.mark.parametrize("name,kw", [("impl", dict(impl="gpu")), ("chunk_rows", dict(chunk_size=-3)),
                                     ("temperature", dict(temperature=-1.0))])
def test_token_stats_checks_before_reducing(no_logits, name, kw):
    with pytest.raises(ValueError, match=f"^{name}:"):
        flat.token_stats(*_args()[:5], **kw)


def test_predictive_refuses_an_unknown_divergence_when_built():
    with pytest.raises(ValueError, match="^divergence: unknown value 'topk_kld'"):
        pdmask.predictive("topk_kld")


def test_register_mode_refuses_a_mode_without_a_region():
    with pytest.raises(ValueError, match="^region:"):
        pdmask.register_mode(pdmask.MaskMode("no-region", None, pdmask.ratio_sign(), "binary_kl"))
    assert "no-region" not in pdmask.MODES
