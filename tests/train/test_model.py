"""The built-in model: both architectures build, sample and train through the same path."""

from pathlib import Path

import pytest
import torch

from pdmask.engine.hf import HFEngine
from pdmask.train.config import load_config
from pdmask.train.update import compute_loss
from pdmask.train.model import build_model, num_params


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_arch_builds_samples_and_trains(arch):
    cfg = load_config(None, [f"arch={arch}", "hidden_size=32", "num_layers=1", "num_heads=4",
                             "intermediate_size=64", "engine_precision=fp32"])
    m = build_model(cfg, 64, pad_id=0, eos_id=1, seed=0)
    m2 = build_model(cfg, 64, pad_id=0, eos_id=1, seed=0)
    assert type(m).__name__.lower().startswith(arch)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))  # seeded init
    assert 0 < num_params(m) < 50_000
    eng = HFEngine(m, eos_id=1, pad_id=0, top_k_logprobs=8)
    b = eng.generate([[5, 6, 7], [8, 9]], max_new_tokens=5, seed=0)
    out = compute_loss(m, b, torch.tensor([1.0, -1.0]), cfg, validate=True)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_default_and_main_model_size_is_about_one_million():
    main = Path(__file__).resolve().parents[2] / "configs" / "main.yaml"
    for cfg in (load_config(None, []), load_config(main)):
        m = build_model(cfg, cfg.vocab_size, pad_id=0, eos_id=1, seed=0)
        assert 0.9e6 < num_params(m) < 1.1e6
