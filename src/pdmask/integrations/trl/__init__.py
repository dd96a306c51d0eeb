"""TRL integration: trust-region masks in TRL's ``GRPOTrainer``.

Drop-in use::

    from pdmask.integrations.trl import GRPOConfig, GRPOTrainer   # pdmask's subclasses
    args = GRPOConfig(output_dir="out", mask_mode="pdm-topk-kl", rollout_top_k=20, ...)
    GRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...).train()

Supported TRL: :data:`SUPPORTED_TRL` (the subclasses override private TRL methods, so
each TRL minor release is checked before it is admitted). Importing this module with
another TRL version raises ``ImportError``; set ``PDMASK_TRL_ALLOW_UNSUPPORTED=1`` to
try anyway (a warning is issued). See ``docs/trl.md``.

Held-out evaluation and a readable line per step during training: :func:`heldout_callbacks`
(``heldout.py``; ``evaluate(model)`` is the caller's, e.g. the built-in trainer's greedy
evaluation as ``examples/trl/train_grpo.py`` composes it).
"""

from __future__ import annotations

import os
import warnings

SUPPORTED_TRL = (">=1.16,<1.17", (1, 16))


def _check_trl_version() -> str:
    try:
        import trl
    except ImportError as e:  # pragma: no cover - exercised only without trl
        raise ImportError("pdmask.integrations.trl needs TRL: pip install -e '.[trl]' (from a pdmask checkout)") from e
    v = getattr(trl, "__version__", "0")
    parts = tuple(int(p) for p in v.split(".")[:2] if p.isdigit())
    if parts != SUPPORTED_TRL[1]:
        msg = (f"pdmask.integrations.trl supports trl{SUPPORTED_TRL[0]} (it overrides private GRPOTrainer "
               f"methods), found trl {v}. Install a supported version: pip install -e '.[trl]' "
               "(from a pdmask checkout).")
        if os.environ.get("PDMASK_TRL_ALLOW_UNSUPPORTED") == "1":
            warnings.warn(msg + " Continuing because PDMASK_TRL_ALLOW_UNSUPPORTED=1.", RuntimeWarning, stacklevel=3)
        else:
            raise ImportError(msg + " (Set PDMASK_TRL_ALLOW_UNSUPPORTED=1 to try anyway.)")
    return v


TRL_VERSION = _check_trl_version()

from .capture import TopKRecorder  # noqa: E402
from .config import PDMaskGRPOConfig  # noqa: E402
from .heldout import HeldoutCallback, StepLineCallback, heldout_callbacks  # noqa: E402
from .shutdown import finish_and_exit  # noqa: E402
from .trainer import PDMaskGRPOTrainer  # noqa: E402

#: Drop-in names.
GRPOConfig = PDMaskGRPOConfig
GRPOTrainer = PDMaskGRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "HeldoutCallback", "PDMaskGRPOConfig", "PDMaskGRPOTrainer", "SUPPORTED_TRL",
           "StepLineCallback", "TRL_VERSION", "TopKRecorder", "finish_and_exit", "heldout_callbacks"]
