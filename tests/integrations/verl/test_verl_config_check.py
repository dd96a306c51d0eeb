"""The driver-side check of a verl config with a pdmask loss (``config_check``), on configs
composed from verl 0.9.1's own YAML the way ``main_ppo`` composes them, and through the
``validate_config`` that ``main_ppo`` calls."""

from __future__ import annotations

import pytest

from verl_helpers import compose_config, needs_verl, script_overrides

pytestmark = needs_verl

TOPK, BINARY = "pdmask_pdm_topk_kl", "pdmask_dppo_binary_tv"
RC = "algorithm.rollout_correction"


def _check(overrides):
    from pdmask.integrations.verl.config_check import check_config

    check_config(compose_config(overrides))


@pytest.mark.parametrize("loss_mode", [TOPK, "pdmask_dppo_topk_tv", BINARY, "pdmask_drpo", "pdmask_spo",
                                       "pdmask_pdm_smooth_topk_kl"])
def test_launch_script_passes(loss_mode):
    _check(script_overrides(LOSS_MODE=loss_mode))


@pytest.mark.parametrize("overrides", [
    [f"{RC}.bypass_mode=false", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0"],
    [f"{RC}.bypass_mode=false", f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.9_1.1"],
], ids=["decoupled-is", "decoupled-rs"])
def test_decoupled_corrections_pass(overrides):
    script = [o for o in script_overrides(LOSS_MODE=TOPK) if not o.startswith(f"{RC}.bypass_mode")]
    _check(script + overrides)


REFUSED = [
    (TOPK, [f"{RC}.rollout_is=token"], f"{RC}.rollout_is"),                 # the script sets bypass_mode=true
    (TOPK, [f"{RC}.rollout_rs=token_k3", f"{RC}.rollout_rs_threshold=0.1"], f"{RC}.rollout_rs"),
    (BINARY, [f"{RC}.rollout_is=sequence"], f"{RC}.rollout_is"),
    (TOPK, ["+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token"],
     "actor_rollout_ref.actor.policy_loss.rollout_correction"),
    (TOPK, ["actor_rollout_ref.model.use_fused_kernels=true"], "actor_rollout_ref.model.use_fused_kernels"),
    (TOPK, ["actor_rollout_ref.rollout.top_p=0.9"], "actor_rollout_ref.rollout.top_p"),
    ("pdmask_dppo_topk_tv", ["actor_rollout_ref.rollout.top_k=50"], "actor_rollout_ref.rollout.top_k"),
    (BINARY, [f"{RC}.bypass_mode=true", "actor_rollout_ref.rollout.top_p=0.9"], "actor_rollout_ref.rollout.top_p"),
]


@pytest.mark.parametrize("loss_mode,extra,key", REFUSED, ids=[k.split(".")[-1] + ":" + m for m, _, k in REFUSED])
def test_refused_with_one_line_naming_the_key(loss_mode, extra, key):
    with pytest.raises(ValueError) as e:
        _check(script_overrides(LOSS_MODE=loss_mode) + extra)
    msg = str(e.value)
    assert msg.startswith(f"{key}: ") and "\n" not in msg, msg


def test_smooth_topk_loss_takes_rollout_is_in_decoupled_mode():
    """Decoupled mode (v1 trainer) centres the top-K losses on pi_old: pdm-smooth-topk-*
    differentiate pi/pi_old, and verl's IS weight pi_old/mu is the behaviour weight, counted once
    (with the rollout anchor, bypass mode, rollout_is is refused for every loss: verl computes none)."""
    name = "pdmask_pdm_smooth_topk_kl"
    script = [o for o in script_overrides(LOSS_MODE=name) if not o.startswith(f"{RC}.bypass_mode")]
    decoupled = [f"{RC}.bypass_mode=false", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0"]
    _check(script + decoupled)
    _check(script + [f"{RC}.bypass_mode=false", f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.9_1.1"])
    binary = [o for o in script_overrides(LOSS_MODE="pdmask_drpo") if not o.startswith(f"{RC}.bypass_mode")]
    _check(binary + decoupled)


@pytest.mark.parametrize("loss_mode", [TOPK, "pdmask_pdm_smooth_topk_tv", "pdmask_dppo_topk_kl"])
def test_legacy_trainer_in_decoupled_mode_names_the_missing_hook(loss_mode):
    """The legacy trainer drops every output of the old-log-prob pass but old_log_probs,
    entropys, routed_experts and sum_pi_squared: pi_old's top-K cannot reach the update."""
    script = [o for o in script_overrides(LOSS_MODE=loss_mode)
              if not o.startswith((f"{RC}.bypass_mode", "trainer.use_v1"))]
    with pytest.raises(ValueError) as e:
        _check(script + [f"{RC}.bypass_mode=false", "trainer.use_v1=false"])
    msg = str(e.value)
    assert msg.startswith("trainer.use_v1: ") and "RayPPOTrainer._compute_old_log_prob" in msg and "\n" not in msg
    _check(script + [f"{RC}.bypass_mode=true", "trainer.use_v1=false"])  # mu's region: nothing to carry
    _check(script + [f"{RC}.bypass_mode=false", "trainer.use_v1=true"])
    binary = [o for o in script_overrides(LOSS_MODE=BINARY) if not o.startswith((f"{RC}.bypass_mode",
                                                                                  "trainer.use_v1"))]
    _check(binary + [f"{RC}.bypass_mode=false", "trainer.use_v1=false"])  # old_log_prob is all they read


def test_fused_kernels_pass_with_a_binary_loss():
    _check(script_overrides(LOSS_MODE=BINARY) + ["actor_rollout_ref.model.use_fused_kernels=true"])


def test_truncation_passes_with_a_binary_loss_in_decoupled_mode():
    """Decoupled mode: the binary losses anchor on the recomputed full-vocabulary pi_old."""
    script = [o for o in script_overrides(LOSS_MODE=BINARY) if not o.startswith(f"{RC}.bypass_mode")]
    _check(script + [f"{RC}.bypass_mode=false", "actor_rollout_ref.rollout.top_p=0.9"])


def test_other_losses_are_not_checked():
    _check(["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", f"{RC}.bypass_mode=true",
            f"{RC}.rollout_is=token"])


def test_main_ppo_runs_the_check():
    """main_ppo imports ``validate_config`` after ``import verl`` loaded the plugin: it gets
    the wrapped function, which runs verl's checks and then pdmask's."""
    import verl.trainer.main_ppo as main_ppo
    import verl.utils.config as vcfg

    assert getattr(main_ppo.validate_config, "__pdmask_wrapped__", False)
    assert main_ppo.validate_config is vcfg.validate_config
    from pdmask.integrations.verl import config_check

    cfg = compose_config(script_overrides(LOSS_MODE=TOPK) + [f"{RC}.rollout_is=token"])
    saved, calls = vcfg.validate_config, []
    vcfg.validate_config = lambda config, *a, **kw: calls.append(config)  # verl's own checks need GPUs
    try:
        assert config_check.install()  # wraps the stand-in as it wrapped verl's
        with pytest.raises(ValueError, match=rf"^{RC}\.rollout_is: "):
            vcfg.validate_config(config=cfg, use_reference_policy=False, use_critic=False)
        assert calls == [cfg]  # verl's checks ran first
    finally:
        vcfg.validate_config = saved
