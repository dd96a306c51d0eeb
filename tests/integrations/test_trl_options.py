"""Every TRL 1.16 GRPOConfig option that changes the objective is honoured or refused
(``pdmask.integrations.trl.options``), TRL's own metric names are kept, and
``rollout_top_k`` is checked where it can be."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import trl_helpers as H  # noqa: E402

import pdmask  # noqa: E402
from pdmask.corrections import DEFAULT_IS_CAP  # noqa: E402
from pdmask.integrations.trl import options  # noqa: E402


def test_every_trl_grpo_field_is_classified():
    """A TRL field is either an objective option with a decision (OPTIONS) or listed as neutral:
    a new TRL release that adds a field fails here until someone decides."""
    import trl
    from transformers import TrainingArguments

    own = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    decided = {o.name for o in options.OPTIONS} | set(options.NEUTRAL)
    assert own - decided == set(), "TRL GRPOConfig fields nobody decided about"
    assert not {o.name for o in options.OPTIONS} & set(options.NEUTRAL)
    names = [o.name for o in options.OPTIONS]
    assert len(names) == len(set(names))


REFUSED = [
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),    # GSPO, pdm mode
    ({"importance_sampling_level": "sequence", "mask_mode": "grpo"}, "importance_sampling_level"),
    ({"importance_sampling_level": "sequence", "mask_mode": "none"}, "importance_sampling_level"),
    ({"importance_sampling_level": "word"}, "importance_sampling_level"),
    ({"delta": 4.0}, "delta"),                                                   # pdm mode
    ({"mask_mode": "grpo", "delta": 4.0, "is_cap": 3.0}, "delta"),               # two dual clips
    ({"mask_mode": "grpo", "delta": 3.0, "is_cap": 5.0}, "delta"),               # 5.0 written out is set
    ({"mask_mode": "grpo", "delta": 1.1}, "delta"),                              # <= 1 + epsilon_high
    ({"epsilon": 0.3}, "epsilon"),                                               # pdm mode
    ({"epsilon_high": 0.28, "mask_mode": "dppo-binary-tv", "rollout_top_k": 0}, "epsilon_high"),
    ({"use_vllm": True, "mask_mode": "grpo"}, "vllm_importance_sampling_correction"),  # ratio is the weight
    ({"use_vllm": True, "mask_mode": "drpo"}, "vllm_importance_sampling_correction"),  # ratio is the weight
    ({"mask_mode": "spo", "is_cap": 3.0}, "is_cap"),                             # bounds nothing
    ({"mask_mode": "dppo-topk-kl", "is_level": None, "is_cap": 3.0}, "is_cap"),  # no IS weight to cap
    ({"use_vllm": True, "is_level": "sequence"}, "vllm_importance_sampling_correction"),  # two IS weights
    ({"use_vllm": True, "is_level": "token"}, "vllm_importance_sampling_correction"),     # set, though the default
    ({"use_vllm": True, "is_cap": 5.0}, "vllm_importance_sampling_correction"),
    ({"use_vllm": True, "is_mask": False}, "vllm_importance_sampling_correction"),
    ({"vllm_importance_sampling_mode": "token_truncate"}, "vllm_importance_sampling_mode"),
    ({"vllm_importance_sampling_clip_max": 2.0}, "vllm_importance_sampling_clip_max"),
    ({"vllm_importance_sampling_clip_min": 0.5}, "vllm_importance_sampling_clip_min"),
    ({"vllm_importance_sampling_cap": 2.0}, "vllm_importance_sampling_cap"),
    ({"vllm_structured_outputs_regex": "a+"}, "vllm_structured_outputs_regex"),
    ({"beta": 0.04, "top_p": 0.9}, "beta"),                                      # KL on a renormalised pi
    ({"beta": 0.04, "generation_kwargs": {"top_k": 5}}, "beta"),
    ({"beta": float("nan")}, "beta"),                                            # every weight NaN at step 1
    ({"beta": float("inf")}, "beta"),
    ({"beta": -0.04}, "beta"),                                                   # rewards leaving the reference
    ({"entropy_coef": 0.01}, "entropy_coef"),
    ({"use_adaptive_entropy": True}, "use_adaptive_entropy"),
    ({"off_policy_mask_threshold": -0.5}, "off_policy_mask_threshold"),
    ({"is_level": "word"}, "is_level"),
    ({"is_floor": 6.0}, "is_floor"),                                             # >= is_cap
    ({"is_mask": True, "is_level": None}, "is_mask"),
    ({"is_mask": "yes"}, "is_mask"),
    ({"mask_mode": "grpo", "is_batch_normalize": True}, "is_batch_normalize"),
    ({"rejection": "seq_k9"}, "rejection"),
    ({"rejection_threshold": "0.5"}, "rejection_threshold"),                    # without rules
    ({"top_k": -3}, "top_k"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
    ({"loss_type": "cispo", "mask_mode": "drpo"}, "loss_type"),               # its ratio is its weight
    ({"loss_type": "cispo", "mask_mode": "cispo"}, "loss_type"),              # verl's CISPO vs TRL's
    ({"loss_type": "cispo", "is_cap": 3.0}, "loss_type"),                      # two caps
    ({"loss_type": "sapo"}, "loss_type"),
    ({"loss_type": "vespo"}, "loss_type"),
    ({"loss_type": "luspo"}, "loss_type"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching"),
    ({"use_transformers_paged": True}, "use_transformers_paged"),
    ({"mask_mode": "grpo", "mask_delta_low": 0.1}, "mask_delta_low"),
    ({"mask_mode": "pdm-batch-topk-kl"}, "mask_mode"),
    ({"mask_mode": "nope"}, "mask_mode"),
    ({"mask_mode": "pdm-full-kl"}, "mask_mode"),
    ({"rollout_top_k": 0}, "rollout_top_k"),                                    # pdm mode needs K >= 1
    ({"rollout_top_k": -1, "mask_mode": "grpo"}, "rollout_top_k"),
]


@pytest.mark.parametrize("kw,name", REFUSED, ids=[n + ":" + ",".join(map(str, k.values())) for k, n in REFUSED])
def test_refused_with_one_line_naming_the_option(tmp_path, kw, name):
    with pytest.raises(ValueError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's deprecation warnings for _cap / _paged
        H.config(tmp_path, **{"rollout_top_k": None, **kw})
    msg = str(e.value)
    assert msg.startswith(f"{name}: ") and "\n" not in msg, msg


def test_every_refusing_option_has_a_refusal_case():
    refusing = {o.name for o in options.OPTIONS if o.refuse is not None}
    assert refusing <= {name for _, name in REFUSED}, refusing - {name for _, name in REFUSED}


@pytest.mark.parametrize("kw", [
    {},                                                           # TRL's defaults (correction=True, no vLLM)
    {"mask_mode": "grpo", "epsilon": 0.1, "epsilon_high": 0.28, "delta": 2.0},
    {"mask_mode": "grpo", "delta": 3.0, "is_cap": 3.0},
    {"mask_mode": "grpo", "delta": 10.0, "is_mask": True, "is_floor": 0.5, "is_cap": 3.0},  # IcePop + dual clip
    {"mask_mode": "drpo", "mask_delta_low": 12.5, "mask_delta_high": 12.5},   # UniRL's drpo_epsilon
    {"mask_mode": "pdm-smooth-topk-kl"},
    {"importance_sampling_level": "token"},
    {"use_vllm": True, "vllm_importance_sampling_correction": False},
    {"use_vllm": True},                                           # TRL's default correction, honoured
    {"use_vllm": True, "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},
    {"off_policy_mask_threshold": 0.5},
    {"is_level": "sequence", "is_mask": True, "is_floor": 0.5, "is_cap": 2.0},
    {"rejection": "seq_mean_k1,token_k3", "rejection_threshold": "0.5_2,0.1"},
    {"top_p": 0.9, "top_k": 10},
    {"num_iterations": 2},
    {"beta": 0.04},
    {"beta": 0.04, "use_bias_correction_kl": True, "sync_ref_model": True},
    {"use_vllm": True, "vllm_importance_sampling_correction": False, "is_cap": 5.0, "is_level": "token",
     "is_mask": False},
])
def test_accepted(tmp_path, kw):
    cfg = H.config(tmp_path, **kw)
    # nothing is quietly rewritten any more (the old config forced the correction off)
    assert cfg.vllm_importance_sampling_correction == kw.get("vllm_importance_sampling_correction", True)


def test_unset_is_fields_take_the_cores_defaults(tmp_path):
    """None / 'auto' mean "not set" (the both-set refusals test that, not the value): unset, the
    IS weight is the core's default min(r, 5), or TRL's delta / vLLM correction where those apply."""
    cfg = H.config(tmp_path)
    assert (cfg.is_cap, cfg.is_level, cfg.is_mask) == (None, "auto", None)
    c = options.corrections(cfg)
    assert (c.is_cap, c.is_level, c.is_mask, c.is_floor) == (DEFAULT_IS_CAP, "token", False, None)
    assert not c.is_cap_given
    # grpo: TRL's delta is the dual clip; an is_cap equal to it says the same and is dropped
    for kw in ({"delta": 3.0}, {"delta": 3.0, "is_cap": 3.0}):
        spec = options.loss_spec(H.config(tmp_path, mask_mode="grpo", **kw))
        assert spec.thresholds.dual_clip == 3.0 and not spec.corrections.is_cap_given
    # grpo with neither delta nor is_cap: no dual clip, as plain TRL (whose delta defaults to None)
    assert options.loss_spec(H.config(tmp_path, mask_mode="grpo")).thresholds.dual_clip == math.inf
    # grpo with is_cap alone: is_cap is the dual clip (dual_clip None falls back to it)
    spec = options.loss_spec(H.config(tmp_path, mask_mode="grpo", is_cap=4.0))
    assert spec.thresholds.dual_clip is None and spec.corrections.is_cap == 4.0
    c5 = options.corrections(H.config(tmp_path, is_cap=5.0))
    assert c5.is_cap == 5.0 and c5.is_cap_given  # written out, it is set


def _listed_modes(tmp_path) -> list[str]:
    with pytest.raises(ValueError) as e:
        H.config(tmp_path, mask_mode="nope")
    msg = str(e.value)
    head = "mask_mode: unknown value 'nope'; valid values are: "
    assert msg.startswith(head) and "\n" not in msg, msg
    return msg[len(head):].split(", ")


def test_unknown_mode_lists_the_modes_the_trainer_accepts(tmp_path, monkeypatch):
    """The list is every registered mode the config accepts, and only those; computed from the
    registry, so a mode registered later appears when the trainer can supply its inputs."""
    listed = _listed_modes(tmp_path)
    assert listed == options.accepted_modes()
    for name in pdmask.MODES:
        try:
            H.config(tmp_path, mask_mode=name, rollout_top_k=None)
            accepted = True
        except ValueError as e:
            assert str(e).startswith(f"mask_mode: {name!r} needs "), e
            accepted = False
        assert accepted == (name in listed), name
    assert "pdm-topk-kl" in listed and "pdm-full-kl" not in listed and "pdm-batch-topk-kl" not in listed
    topk = pdmask.MaskMode("test-topk", pdmask.divergence_region("topk_kl"), None, "topk_kl",
                           needs=frozenset({"topk"}))
    monkeypatch.setitem(pdmask.MODES, "test-topk", topk)
    monkeypatch.setitem(pdmask.MODES, "test-full", dataclasses.replace(topk, name="test-full",
                                                                        needs=frozenset({"full"})))
    monkeypatch.setitem(pdmask.MODES, "test-new-input", dataclasses.replace(topk, name="test-new-input",
                                                                             needs=frozenset({"topk", "other"})))
    assert _listed_modes(tmp_path) == [*listed, "test-topk"]
    assert H.config(tmp_path, mask_mode="test-topk").rollout_top_k == 4
    with pytest.raises(ValueError, match=r"^mask_mode: 'test-new-input' needs 'other' inputs"):
        H.config(tmp_path, mask_mode="test-new-input")


def test_rollout_top_k_defaults_by_mode(tmp_path):
    assert H.config(tmp_path, rollout_top_k=None, mask_mode="pdm-topk-kl").rollout_top_k == 20
    assert H.config(tmp_path, rollout_top_k=None, mask_mode="pdm-smooth-topk-tv").rollout_top_k == 20
    for mode in ("grpo", "none", "dppo-binary-tv", "dppo-binary-kl", "drpo", "spo"):
        assert H.config(tmp_path, rollout_top_k=None, mask_mode=mode).rollout_top_k == 0, mode


def test_rollout_top_k_above_the_vocabulary_is_refused_at_init(tmp_path):
    with pytest.raises(ValueError, match=r"^rollout_top_k: K=30 exceeds the model's vocabulary size 24"):
        H.make_trainer(tmp_path, rollout_top_k=30)


# ------------------------------------------------------------------ honoured options
def _trl_two_sided(logp, old, adv, eps_low, eps_high, delta):
    """TRL 1.16's grpo per-token loss with `delta` (grpo_trainer._compute_loss), written out."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * adv, coef_2 * adv)


def test_trl_delta_is_the_grpo_dual_clip(tmp_path):
    """TRL's two-sided clip and pdmask's grpo dual clip at is_cap = delta are the same
    objective: equal per-token values and gradients (float64, ratios on both sides of
    every boundary)."""
    import pdmask

    g = torch.Generator().manual_seed(0)
    n = 4000
    old = torch.log(torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lr = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.5) * 2.0  # log ratio in [-1, 2]: r up to e^2
    logp = (old + lr).clamp(max=-1e-6).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    eps_low, eps_high, delta = 0.2, 0.28, 2.5
    trl = _trl_two_sided(logp, old, adv, eps_low, eps_high, delta)
    ours, _ = pdmask.token_loss(logp, (logp - old).detach(), adv, torch.ones(n, dtype=torch.bool),
                                surrogate="ppo-clip", is_cap=delta, eps_low=eps_low, eps_high=eps_high)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(trl.sum(), logp)[0]
    g2 = torch.autograd.grad(ours.sum(), logp)[0]
    torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-12)
    r = (logp - old).exp()
    assert bool(((adv < 0) & (r > delta)).any()), "the sample must hit the dual clip"
    mine, _ = pdmask.token_loss(logp, (logp - old).detach(), adv, torch.ones(n, dtype=torch.bool),
                                surrogate="ppo-clip", dual_clip=delta, eps_low=eps_low, eps_high=eps_high)
    assert torch.equal(mine, ours)  # the dual_clip spelling and the is_cap one (dual_clip unset)
    cfg = H.config(tmp_path, mask_mode="grpo", delta=delta, epsilon_high=eps_high)
    kw = H.loss_kwargs(cfg)
    assert {k: kw[k] for k in ("eps_low", "eps_high", "dual_clip", "is_cap")} == {
        "eps_low": eps_low, "eps_high": eps_high, "dual_clip": delta, "is_cap": None}


def test_grpo_with_trl_delta_trains_with_that_cap(tmp_path):
    tr = H.make_trainer(tmp_path, mask_mode="grpo", rollout_top_k=0, delta=1.5, epsilon_high=0.28,
                        learning_rate=0.1, max_steps=2)
    tr.train()
    for rec in tr.records:  # the Probe's reference uses is_cap = delta in grpo mode
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)


def test_num_iterations_makes_the_mask_act_on_cpu(tmp_path):
    """num_iterations=2: the second pass over a generation batch is off-policy (one update
    later), so with a small delta the mask fires -- the CPU recipe docs/trl.md gives."""
    tr = H.make_trainer(tmp_path, mask_mode="pdm-topk-kl", num_iterations=2, mask_delta_low=1e-3,
                        mask_delta_high=1e-3, learning_rate=0.1, max_steps=2, steps_per_generation=1)
    tr.train()
    assert len(tr.records) == 2
    for rec in tr.records:
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    second = tr.records[1]
    assert float(second["metrics"]["kept_frac"]) < 1.0, "the mask never acted"
    logs = [h for h in tr.state.log_history if "pdmask/kept_frac" in h]
    assert logs[-1]["pdmask/kept_frac"] < 1.0


def test_moe_router_loss_is_added_as_trl_adds_it(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=len(H.tiny_tokenizer()), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.05,
                        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = MixtralForCausalLM(cfg)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    tr = H.make_trainer(tmp_path, model=model, max_steps=1)
    assert tr.aux_loss_enabled and tr.router_aux_loss_coef == pytest.approx(0.05)
    tr.train()
    for rec in tr.records:  # the Probe adds coef x aux / GA from its own forward
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
    assert any("aux_loss" in h for h in tr.state.log_history)


def test_repetition_penalty_warns(tmp_path):
    with pytest.warns(UserWarning, match="repetition_penalty"):
        H.config(tmp_path, repetition_penalty=1.1)


# ------------------------------------------------------------------ TRL's metric names
def test_trl_entropy_and_clip_ratio_metrics_are_kept(tmp_path):
    """``entropy`` and ``clip_ratio/*`` appear under TRL's names with honest values: the
    entropy of softmax(logits / T) (token mean) and the tokens the mask zeroes by the sign of A."""
    tr = H.make_trainer(tmp_path, mask_mode="pdm-topk-kl", mask_delta_low=1e-4, mask_delta_high=1e-4,
                        learning_rate=0.1, max_steps=4, steps_per_generation=4)
    tr.train()
    logs = [h for h in tr.state.log_history if "pdmask/kept_frac" in h]
    assert len(logs) == len(tr.records) == 4  # one micro-batch per logged step
    for h, rec in zip(logs, tr.records, strict=True):
        m = rec["mask"]
        cut = ~rec["kept"] & m
        adv = rec["inputs"]["advantages"][:, None].expand_as(m)
        n = m.sum().item()
        assert h["entropy"] == pytest.approx(float(rec["entropy"][m].sum()) / n, rel=1e-5)
        assert h["clip_ratio/region_mean"] == pytest.approx(1 - h["pdmask/kept_frac"], abs=1e-6)
        assert h["clip_ratio/low_mean"] == pytest.approx(float((cut & (adv < 0)).sum()) / n, abs=1e-6)
        assert h["clip_ratio/high_mean"] == pytest.approx(float((cut & (adv > 0)).sum()) / n, abs=1e-6)
        seq_low = (cut & (adv < 0)).sum(-1).float() / m.sum(-1).float()
        seq_high = (cut & (adv > 0)).sum(-1).float() / m.sum(-1).float()
        assert h["clip_ratio/low_min"] == pytest.approx(float(seq_low[~seq_low.isnan()].min()), abs=1e-6)
        assert h["clip_ratio/high_max"] == pytest.approx(float(seq_high[~seq_high.isnan()].max()), abs=1e-6)
    assert any(h["clip_ratio/region_mean"] > 0 for h in logs), "the mask never acted; the check is vacuous"
    assert all(math.isfinite(h["entropy"]) for h in logs)


def test_docs_table_lists_every_option():
    doc = (HERE.parents[1] / "docs" / "trl.md").read_text()
    section = doc[doc.index("### TRL options that change the objective"):doc.index("### Metrics")]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    missing = [o.name for o in options.OPTIONS if not any(f"`{o.name}`" in r.split("|")[1] for r in rows)]
    assert not missing, missing
