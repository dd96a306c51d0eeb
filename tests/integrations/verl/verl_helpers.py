"""Shared fixtures for the verl plugin tests: the skip rule and small inputs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

VERL_REASON = ("needs the 'verl' extra (pip install -e '.[verl]' from a checkout; verl 0.9.1 needs "
               "transformers<5.11, so it lives in its own environment: bash .ci/verl.sh)")


def _have_verl() -> bool:
    # With tests/integrations on sys.path (pytest's prepend mode puts it there for its own
    # tests) this very directory would pass for a namespace package called "verl": require
    # a real package with an __init__.py.
    spec = importlib.util.find_spec("verl")
    return spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")


HAVE_VERL = _have_verl()
needs_verl = pytest.mark.skipif(not HAVE_VERL, reason=VERL_REASON)


def load_engine_fakes():
    """tests/formats/engine_fakes.py (vLLM-shaped stand-ins), loaded by path under a
    private name so no directory is added to sys.path."""
    name = "_pdmask_verl_engine_fakes"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[2] / "formats" / "engine_fakes.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(mod)
    return mod


def actor_config(*, delta_low=0.05, delta_high=0.07, is_cap=5.0, loss_mode="vanilla", agg="token-mean",
                 global_batch_info=None):
    """A real verl FSDPActorConfig with pdmask's thresholds in verl's DPPO fields."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                          clip_ratio_low=delta_low, clip_ratio_high=delta_high, clip_ratio_c=is_cap,
                          loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    cfg.global_batch_info.update(global_batch_info or {})
    return cfg


def binary_batch(seed=0, B=4, T=8, V=11, dtype=torch.float64):
    """Logits, sampled ids, rollout log-probs near the logits (so some tokens are out of
    region), advantages of both signs and zeros, a ragged response mask."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype) * 2.0
    ids = torch.randint(0, V, (B, T), generator=g)
    mu_logits = logits + torch.randn(B, T, V, generator=g, dtype=dtype) * 1.5
    rlp = torch.log_softmax(mu_logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    adv[0, 1] = 0.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    return logits, ids, rlp, adv, mask, mu_logits


ROOT = Path(__file__).resolve().parents[3]
LAUNCH_SCRIPT = ROOT / "examples" / "verl" / "run_pdm_topk_kl.sh"


def script_overrides(**env) -> list[str]:
    """The Hydra overrides examples/verl/run_pdm_topk_kl.sh would pass to main_ppo."""
    import os
    import subprocess

    out = subprocess.run(["bash", str(LAUNCH_SCRIPT)], env=dict(os.environ, PDMASK_PRINT_OVERRIDES="1", **env),
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def compose_config(overrides: list[str]):
    """verl 0.9.1's ppo_trainer config with the given overrides, as main_ppo composes it
    (plus the actor's rollout_n, which main_ppo fills in before building the actor config)."""
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    cfgdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    with open_dict(cfg):
        cfg.actor_rollout_ref.actor.rollout_n = cfg.actor_rollout_ref.rollout.n
    return cfg
