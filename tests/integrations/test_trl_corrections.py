"""TRL's off-policy corrections and truncated sampling through pdmask's core corrections.

- TRL 1.16's ``vllm_importance_sampling_*`` map one-to-one to ``is_level`` / ``is_mask`` /
  ``is_floor`` / ``is_cap`` (hand-written table), and the mapped core weights equal TRL's own
  computation (``GRPOTrainer._generate_and_score_completions``, transcribed) on the same tensors;
- the trainer's loss with them, with ``off_policy_mask_threshold`` and with pdmask's own
  ``is_*`` / ``rejection*`` fields equals :func:`pdmask.policy_loss` with those keywords (the
  Probe trainer) and the corrections bite;
- ``top_p`` / ``top_k``: on-policy the uncorrected ratio would be pi(S) < 1, the trainer's
  (pi renormalised over the rebuilt kept set) is 1 and nothing is masked.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import trl_helpers as H  # noqa: E402

import pdmask  # noqa: E402
from pdmask.integrations.trl import options  # noqa: E402
from tests import flat  # noqa: E402

VLLM = dict(use_vllm=True)
#: TRL config -> the core's IS keywords, written out by hand
MAPPING = [
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
     dict(is_level="token", is_mask=False, is_cap=2.0, is_floor=None)),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
          vllm_importance_sampling_clip_min=0.5),
     dict(is_level="token", is_mask=False, is_cap=2.0, is_floor=0.5)),
    (dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=4.0),
     dict(is_level="sequence", is_mask=False, is_cap=4.0, is_floor=None)),
    (dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.5,
          vllm_importance_sampling_clip_min=0.7),
     dict(is_level="token", is_mask=True, is_cap=1.5, is_floor=0.7)),
    (dict(), dict(is_level="sequence", is_mask=True, is_cap=3.0, is_floor=None)),   # TRL's default: sequence_mask, 3
    (dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=None,
          vllm_importance_sampling_clip_min=0.5),
     dict(is_level="sequence", is_mask=True, is_cap=math.inf, is_floor=0.5)),
]


@pytest.mark.parametrize("trl_kw,core_kw", MAPPING, ids=[str(i) for i in range(len(MAPPING))])
def test_vllm_is_options_map_to_the_core(tmp_path, trl_kw, core_kw):
    kw = H.loss_kwargs(H.config(tmp_path, **VLLM, **trl_kw))
    assert {k: kw[k] for k in core_kw} == core_kw
    # without vLLM TRL applies no correction: pdmask's own (default) weight min(r, is_cap), the cap
    # not given (None: 5)
    off = H.loss_kwargs(H.config(tmp_path))
    assert (off["is_level"], off["is_mask"], off["is_cap"], off["is_floor"]) == ("token", False, None, None)
    assert options.loss_spec(H.config(tmp_path)).corrections.is_cap == 5.0


def _trl_is_ratio(old, sampling, mask, mode, lo, hi):
    """TRL 1.16's vLLM IS ratio (grpo_trainer._generate_and_score_completions), written out."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=lo, max=hi)
    lo_ = lo if lo is not None else -math.inf
    hi_ = hi if hi is not None else math.inf
    return r.masked_fill((r < lo_) | (r > hi_), 0.0)


@pytest.mark.parametrize("trl_kw", [kw for kw, _ in MAPPING], ids=[str(i) for i in range(len(MAPPING))])
def test_core_weights_equal_trls(tmp_path, trl_kw):
    cfg = H.config(tmp_path, **VLLM, **trl_kw)
    g = torch.Generator().manual_seed(0)
    B, T = 16, 9
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    mu = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[2, 5:] = 0
    mask[7, 1:] = 0
    w_trl = _trl_is_ratio(logp, mu, mask, cfg.vllm_importance_sampling_mode,
                          cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    w_trl = w_trl.expand(B, T)
    kw = {k: v for k, v in H.loss_kwargs(cfg).items() if k in ("is_level", "is_mask", "is_cap", "is_floor")}
    w, keep, _ = pdmask.importance_weights(logp - mu, mask.bool(), pdmask.Corrections(**kw))
    v = mask.bool()
    if kw["is_mask"]:
        # TRL zeroes the weight outside the bounds, pdmask masks the token; inside both keep r
        assert torch.equal(keep[v], (w_trl > 0)[v])
        assert 0 < int((~keep & v).sum()) < int(v.sum()), "the mask should bite, and not everywhere"
        torch.testing.assert_close(w[keep & v], w_trl[keep & v])
    else:
        torch.testing.assert_close(w[v], w_trl[v])
        assert bool((w_trl[v] == kw["is_cap"]).any()), "the truncation should bite"


def _vllm_trainer(tmp_path, **kw):
    tr = H.make_trainer(tmp_path, **kw)
    tr.use_vllm = True  # route generation through the (fake) vLLM backend
    tr.vllm_generation = H.FakeVLLMGeneration(tr, logprobs=tr.args.rollout_top_k)
    tr._last_loaded_step = -1
    return tr


@pytest.mark.parametrize("mode_kw", [
    dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.9,
         vllm_importance_sampling_clip_max=1.1),
    dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1.05,
         vllm_importance_sampling_clip_min=0.5),
], ids=["token_mask", "sequence_truncate"])
def test_trainer_applies_trls_vllm_correction(tmp_path, mode_kw):
    """Off-policy steps (4 updates per generation, a large learning rate): the trainer's loss is
    policy_loss with the mapped keywords, and the correction bites."""
    args = dict(mask_mode="dppo-topk-kl", rollout_top_k=3, learning_rate=0.2, max_steps=4, steps_per_generation=4)
    H.config(tmp_path, **args, **VLLM, **mode_kw)  # accepted with use_vllm=True
    # a real use_vllm=True would start vLLM: build without it, then switch the fake vLLM in, set
    # the options on the trainer's args and rebuild its loss spec from them (built once, at init)
    tr = _vllm_trainer(tmp_path, **args)
    tr.args.use_vllm = True
    for k, v in mode_kw.items():
        setattr(tr.args, k, v)
    tr._pdmask_loss = options.loss_spec(tr.args)
    assert options.vllm_is_on(tr.args)
    tr.train()
    assert len(tr.records) == 4
    for rec in tr.records:
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    m = [r["metrics"] for r in tr.records if not r["on_policy"]]
    if mode_kw["vllm_importance_sampling_mode"] == "token_mask":
        assert any(float(x["masked_frac_is"]) > 0 for x in m)
    else:
        assert any(float(x["is_truncated_frac"]) > 0 for x in m)
        assert all(0.5 - 1e-6 <= float(x["is_weight_min"]) <= float(x["is_weight_max"]) <= 1.05 + 1e-6 for x in m)


def test_trainer_applies_pdmask_corrections_and_trls_off_policy_mask(tmp_path):
    tr = H.make_trainer(tmp_path, mask_mode="pdm-topk-kl", learning_rate=0.2, max_steps=4, steps_per_generation=4,
                        is_level="sequence", is_cap=2.0, rejection="token_k3", rejection_threshold="0.01",
                        off_policy_mask_threshold=0.02)
    kw = H.loss_kwargs(tr.args)
    assert (kw["is_level"], kw["is_cap"], kw["rejection"], kw["rejection_threshold"],
            kw["off_policy_mask_threshold"]) == ("sequence", 2.0, "token_k3", "0.01", 0.02)
    tr.train()
    for rec in tr.records:
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    m = [r["metrics"] for r in tr.records if not r["on_policy"]]
    assert any(float(x["masked_frac_rs_token_k3"]) > 0 for x in m)
    assert any(float(x["masked_frac_opsm"]) > 0 for x in m)
    logs = [h for h in tr.state.log_history if "pdmask/masked_frac_rs_token_k3" in h]
    assert logs, "the corrections' metrics reach TRL's logs"


# top_p=0.8, not 0.7: the tiny model has tied probabilities, and at 0.7 a tie sits on one row's
# top-p boundary, where generate() keeps one of the tied tokens and pdmask keeps both (the
# documented tie rule, docs/corrections.md): ratio 0.879 on that row's tokens.
@pytest.mark.parametrize("samp", [dict(top_p=0.8), dict(top_k=5)], ids=["top_p", "top_k"])
def test_truncated_sampling_on_policy_ratio_is_one(tmp_path, samp):
    """generate() samples from the truncated, renormalised mu; pi is renormalised over the same set,
    so on-policy the ratio is 1 on every token and nothing is masked. Uncorrected, it would be
    pi(S) < 1 (the bias the correction removes)."""
    tr = H.make_trainer(tmp_path, mask_mode="dppo-topk-tv", max_steps=1, steps_per_generation=1, **samp)
    assert getattr(options.sampling(tr.args), "top_p" if "top_p" in samp else "top_k") is not None
    tr.train()
    rec = tr.records[0]
    assert rec["on_policy"]
    torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    m, valid = rec["metrics"], rec["mask"]
    assert float(m["policy_kept_mass_mean"]) < 0.99          # the uncorrected ratio's mean, on-policy
    assert float(m["kept_set_sampled_outside_frac"]) == 0.0
    assert abs(float(m["ratio_mean"]) - 1.0) < 1e-4
    assert bool(rec["kept"][valid].all())
    # the same tensors without the truncation keywords: biased ratio, the TV mask fires on-policy
    inp = rec["inputs"]
    biased = flat.policy_loss(rec["logits"], inp["completion_ids"], inp["sampled_logprob"],
                                inp["topk_ids"], inp["topk_logprobs"], inp["advantages"], valid,
                                mode="dppo-topk-tv", temperature=tr.args.temperature)
    assert float(biased.metrics["ratio_mean"]) < 0.99


def test_refused_when_the_mapping_is_not_exact(tmp_path):
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_correction: mask_mode='grpo'"):
        H.config(tmp_path, mask_mode="grpo", rollout_top_k=0, **VLLM)
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_correction: and is_cap both set"):
        H.config(tmp_path, is_cap=2.0, **VLLM)
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_mode: has no effect unless use_vllm"):
        H.config(tmp_path, vllm_importance_sampling_mode="token_mask")
    with pytest.raises(ValueError, match=r"^is_level: 'sequence' weights are refused with grpo"):
        H.config(tmp_path, mask_mode="grpo", rollout_top_k=0, is_level="sequence")
    with pytest.raises(ValueError, match=r"^rejection: "):
        H.config(tmp_path, rejection="seq_k9")


@pytest.mark.parametrize("mode,k", [("grpo", 0), ("dppo-binary-kl", 0), ("pdm-topk-kl", 4)])
def test_truncated_sampling_in_other_modes(tmp_path, mode, k):
    """The truncation keywords reach the loss in the ppo-clip, binary and predictive modes too:
    the loss equals policy_loss with them, and on-policy nothing is masked."""
    tr = H.make_trainer(tmp_path, mask_mode=mode, rollout_top_k=k, max_steps=1, steps_per_generation=1, top_k=5)
    tr.train()
    rec = tr.records[0]
    torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    assert float(rec["metrics"]["policy_kept_mass_mean"]) < 0.99
    assert abs(float(rec["metrics"]["ratio_mean"]) - 1.0) < 1e-4
    assert bool(rec["kept"][rec["mask"]].all())


def test_min_p_with_top_p_warns_on_the_generate_path(tmp_path):
    with pytest.warns(UserWarning, match=r"^min_p: generate\(\) applies min-p after"):
        H.config(tmp_path, min_p=0.05, top_p=0.9)
