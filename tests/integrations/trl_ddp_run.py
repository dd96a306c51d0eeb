"""Two-process training run for test_two_processes_gloo (launched by torchrun).

Each rank trains the tiny model for two steps with the probing trainer and writes what
it saw to ``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import trl_helpers as H
from pdmask.integrations.trl import finish_and_exit


def main(outdir: str, *flags: str) -> None:
    out = Path(outdir)
    extra = {"loss_from_hidden": True} if "hidden" in flags else {}  # test_trl_hidden's DDP run
    tr = H.make_trainer(out, n_prompts=16, mask_mode="pdm-topk-kl", max_steps=2, steps_per_generation=2,
                        per_device_train_batch_size=4, num_generations=4, **extra)
    before = float(sum(p.detach().double().sum() for p in tr.model.parameters()))
    tr.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    logs = [h for h in tr.state.log_history if "pdmask/num_tokens" in h]
    res = {
        "rank": rank, "world_size": world, "backend": dist.get_backend(),
        "param_sum_before": before,
        "param_sum": float(sum(p.detach().double().sum() for p in tr.model.parameters())),
        "n_steps_logged": len(logs),
        "loss_matches": [bool(torch.allclose(r["loss"], r["expected"], atol=1e-6, rtol=1e-5)) for r in tr.records],
        "local_num_tokens": int(tr.records[0]["metrics"]["num_tokens"]),
        "logged_num_tokens": int(logs[0]["pdmask/num_tokens"]) if logs else None,
        "local_completions": tr.records[0]["inputs"]["completion_ids"].tolist(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    # The deterministic end (wait, destroy the group, os._exit): letting the interpreter tear
    # down the DDP-held gloo group can deadlock or abort (pdmask.integrations.trl.shutdown).
    finish_and_exit(tr)


if __name__ == "__main__":
    main(*sys.argv[1:])
