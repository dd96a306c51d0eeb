"""grpo's dual-clip constant apart from the IS cap, and an ``is_cap`` that would do nothing refused.

- ``Thresholds(dual_clip=C)`` is grpo's dual clip (verl's ``clip_ratio_c``); None keeps the one
  setting it used to be, ``Corrections.is_cap`` (default 5): the default loss is unchanged, bit
  for bit. With it, verl's ``clip_ratio_c`` and an IcePop / MIS upper bound are two settings.
- ``Corrections(is_cap=None)`` is the default cap 5 *not given*; a given ``is_cap`` that bounds
  nothing is refused with one line naming it (issue 30, item 3, cause 2: ``is_level=None`` in a
  dppo mode used to ignore it), in the library and in ``pdmask train``. A default cap never is.
"""

from __future__ import annotations

import math

import pytest
import torch

import pdmask
from pdmask.corrections import DEFAULT_IS_CAP

from .helpers import make_case
from tests import flat  # noqa: E402

F64 = torch.float64


def batch(seed=0, B=3, T=6, V=30, K=4):
    c = make_case(B * T, V, K, seed=seed, mismatch=1.5, scale=2.0)
    g = torch.Generator().manual_seed(seed)
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[0, -2:] = False
    return dict(logits=c["logits"].reshape(B, T, V), ids=c["sampled_ids"].reshape(B, T),
                rlp=c["rollout_logprob"].reshape(B, T), tk=c["topk_ids"].reshape(B, T, K),
                tlp=c["topk_logprobs"].reshape(B, T, K), adv=torch.randn(B, generator=g, dtype=F64), resp=resp)


def run(b, mode="grpo", **kw):
    leaf = b["logits"].clone().requires_grad_(True)
    out = flat.policy_loss(leaf, b["ids"], b["rlp"], b["tk"], b["tlp"], b["adv"], b["resp"], mode=mode, **kw)
    (g,) = torch.autograd.grad(out.loss, leaf)
    return out, g


# ------------------------------------------------------------------ the dual clip
def test_default_grpo_is_unchanged_bit_for_bit():
    """No dual_clip: the dual clip is is_cap (5), exactly as before the field existed."""
    b = batch(1)
    ref, g_ref = run(b)
    for kw in (dict(dual_clip=DEFAULT_IS_CAP), dict(is_cap=DEFAULT_IS_CAP)):
        out, g = run(b, **kw)
        assert torch.equal(out.loss, ref.loss) and torch.equal(g, g_ref) and torch.equal(out.mask, ref.mask)
    out7, g7 = run(b, is_cap=7.0)  # the old spelling of a dual clip at 7
    out7b, g7b = run(b, dual_clip=7.0)
    assert torch.equal(out7.loss, out7b.loss) and torch.equal(g7, g7b)


def test_dual_clip_and_the_icepop_bound_are_two_settings():
    """IcePop [0.5, 20] with a dual clip at 3: an A < 0 token with 3 < r < 20 passes IcePop and is
    dual-clipped (gradient 0); with the two coupled (is_cap = 20 is also the dual clip) it is not."""
    b = batch(2)
    b["adv"][1] = -1.0
    lr = run(b)[0].stats["log_ratio"].detach()
    for t, target in ((0, 5.0), (1, 12.0)):  # set r of two A < 0 tokens (the top-K says the same mu_k)
        shift = lr[1, t] - math.log(target)
        b["rlp"][1, t] += shift
        b["tlp"][1, t] = torch.where(b["tk"][1, t] == b["ids"][1, t], b["tlp"][1, t] + shift, b["tlp"][1, t])
    st = run(b)[0].stats
    r, adv, m = st["ratio"], b["adv"][:, None].expand_as(st["ratio"]), b["resp"]
    between = m & (adv < 0) & (r > 3) & (r < 20)
    assert bool(between.any()), "the batch needs an A < 0 token with 3 < r < 20"
    sep, _ = run(b, is_mask=True, is_floor=0.5, is_cap=20.0, dual_clip=3.0)
    coupled, _ = run(b, is_mask=True, is_floor=0.5, is_cap=20.0)
    assert not bool(sep.mask[between].any()) and bool(coupled.mask[between].all())
    # the separate dual clip's value: -A * 3 on those tokens (the PPO dual clip), not -A r
    torch.testing.assert_close(sep.token_loss.detach()[between], (-adv * 3.0)[between])
    torch.testing.assert_close(coupled.token_loss.detach()[between], (-adv * r)[between])
    icepop_out = m & ((r < 0.5) | (r > 20))
    assert bool((sep.token_loss.detach()[icepop_out] == 0).all())


def test_dual_clip_refusals():
    b = batch(0)
    for v in (1.0, 0.5, -2.0, math.nan):
        with pytest.raises(ValueError, match=r"^dual_clip: must be"):
            pdmask.Thresholds(dual_clip=v)
    pdmask.Thresholds(dual_clip=math.inf)  # no dual clip
    with pytest.raises(ValueError, match=r"^dual_clip: applies to the ppo-clip surrogate \(grpo\) only"):
        run(b, "dppo-topk-kl", dual_clip=3.0)
    # grpo with both set and no is_mask: is_cap bounds nothing
    with pytest.raises(ValueError, match=r"^is_cap: bounds nothing with grpo"):
        run(b, is_cap=3.0, dual_clip=10.0)
    run(b, is_cap=3.0, dual_clip=10.0, is_mask=True)  # IcePop bound + dual clip: both act


# ------------------------------------------------------------------ is_cap that bounds nothing
@pytest.mark.parametrize("mode", ["dppo-topk-kl", "pdm-topk-kl", "none", "dppo-binary-tv"])
def test_is_cap_without_is_weight_is_refused(mode):
    """is_level=None applies no weight: is_cap=1.01 and is_cap=100 used to give the same loss."""
    b = batch(3)
    for cap in (1.01, 100.0, DEFAULT_IS_CAP):  # a given 5 is refused too: the spec knows it was given
        with pytest.raises(ValueError, match=r"^is_cap: bounds the IS weight, and is_level=None applies none"):
            run(b, mode, is_level=None, is_cap=cap)
    out, _ = run(b, mode, is_level=None)  # the default cap is not "given"
    ref, _ = run(b, mode, is_level="token", is_cap=math.inf)
    assert torch.isfinite(out.loss) and not torch.equal(out.loss, ref.loss)


def test_is_cap_given_is_known_and_the_default_is_five():
    assert pdmask.Corrections().is_cap == DEFAULT_IS_CAP == 5.0
    assert not pdmask.Corrections().is_cap_given
    assert pdmask.Corrections(is_cap=5.0).is_cap_given
    assert pdmask.Corrections(is_cap=5.0) == pdmask.Corrections()  # same loss, equal specs
    assert "is_cap_given" not in pdmask.corrections.FIELDS


def test_is_cap_kept_where_it_means_something():
    b = batch(4)
    run(b, "grpo", is_level=None, is_cap=3.0)  # grpo's dual clip, without dual_clip
    run(b, "dppo-topk-kl", is_level="sequence", is_cap=3.0)  # the sequence weight's cap
    run(b, "dppo-topk-kl", is_mask=True, is_floor=0.5, is_cap=3.0)  # IcePop
    run(b, "drpo", is_mask=True, is_cap=3.0)  # an IS mask on a smooth mode


# ------------------------------------------------------------------ the trainer config and CLI
def test_trainer_config_refuses_is_cap_without_is_weight():
    pytest.importorskip("yaml")
    from pdmask.train.config import config_diff, load_config

    with pytest.raises(ValueError, match=r"^is_cap: bounds the IS weight, and is_level=None"):
        load_config(None, ["is_level=null", "is_cap=1.01"])
    cfg = load_config(None, ["is_level=null"])
    assert cfg.loss_fields["corrections"]["is_cap"] is None and cfg.loss.corrections.is_cap == 5.0
    grpo = load_config(None, ["mode=grpo", "dual_clip=10", "is_mask=true", "is_floor=0.5", "is_cap=3"])
    assert grpo.loss.thresholds.dual_clip == 10
    with pytest.raises(ValueError, match=r"^dual_clip: applies to the ppo-clip surrogate"):
        load_config(None, ["mode=dppo-topk-kl", "dual_clip=10"])
    # a run stored before the null default wrote is_cap: 5.0 and no dual_clip: the same config
    stored = load_config(None).to_dict()
    stored["loss"]["corrections"]["is_cap"] = 5.0
    stored["loss"]["thresholds"].pop("dual_clip")
    assert config_diff(stored, load_config(None)) == {}
    assert "loss.corrections.is_cap" in config_diff({**stored, "is_cap": 3.0}, load_config(None))


def test_cli_refuses_is_cap_without_is_weight_in_one_line(tmp_path):
    pytest.importorskip("typer")
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from pdmask.cli import app

    r = CliRunner().invoke(app, ["train", "is_level=null", "is_cap=1.01", f"out_dir={tmp_path}/runs",
                                 f"cache_dir={tmp_path}/cache", "progress=false", "tensorboard=false"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: is_cap:"), r.output
    assert not (tmp_path / "runs").exists()
