"""Registration through verl's own plugin loader, and the launch script's config keys
against verl 0.9.1's real config schema."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from verl_helpers import compose_config, needs_verl, script_overrides

pytestmark = needs_verl


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    assert eps.get("pdmask") == "pdmask.integrations.verl.plugin", eps


def test_import_verl_loads_the_plugin():
    """`import verl` runs ep.load() for the group (verl/__init__.py); nothing else imports
    the plugin module, so its presence in sys.modules proves verl's loader did."""
    import verl  # noqa: F401
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

    from pdmask.integrations.verl import check_registered, registered_names

    assert "pdmask.integrations.verl.plugin" in sys.modules
    assert check_registered() == {"losses": True, "rollout": True, "engine": True, "config_check": True}
    for name in registered_names():
        assert get_policy_loss_fn(name) is POLICY_LOSS_REGISTRY[name]
        assert get_policy_loss_fn(name).__name__ == name


def test_plugin_selected_by_name_in_a_fresh_interpreter():
    """VERL_USE_EXTERNAL_PLUGINS=pdmask: verl loads only the entry point named pdmask."""
    code = ("import verl\nfrom pdmask.integrations.verl import check_registered\n"
            "print(sorted(k for k, v in check_registered().items() if v))")
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="pdmask", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['config_check', 'engine', 'losses', 'rollout']"


def test_engine_lookup(monkeypatch):
    from verl.workers.engine.base import EngineRegistry

    from pdmask.integrations.verl.training_engine import PdmaskFSDPEngine

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # the lookup key a GPU worker uses
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("pdmask_language_model", backend) is PdmaskFSDPEngine


@pytest.mark.parametrize("loss_mode", ["pdmask_pdm_topk_kl", "pdmask_pdm_topk_tv_aggregated",
                                       "pdmask_dppo_binary_tv"])
def test_launch_script_config_composes(loss_mode):
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from pdmask.integrations.verl.rollout import topk_from_config

    cfg = compose_config(script_overrides(LOSS_MODE=loss_mode, DELTA="0.15", TOPK="16"))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert actor.policy_loss.loss_mode == loss_mode and loss_mode in POLICY_LOSS_REGISTRY
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.15, 0.15, 5.0)
    assert rollout.name in RolloutReplicaRegistry._registry
    assert topk_from_config(rollout) == 16
    assert rollout.logprobs_mode == "processed_logprobs"
    assert cfg.actor_rollout_ref.model.model_type in EngineRegistry._engines
    assert "model_type" in HFModelConfig.__dataclass_fields__
    assert cfg.actor_rollout_ref.model.use_fused_kernels is False
    assert cfg.trainer.use_v1 is True  # verl's default path, which test_verl_data_path runs on CPU
    assert cfg.algorithm.rollout_correction.bypass_mode is True
