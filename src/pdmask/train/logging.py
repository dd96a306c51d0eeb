"""Run outputs: ``metrics.jsonl`` (one record per step), TensorBoard events, ``config.yaml``.

Every record has ``step`` (completed RL steps; 0 is the SFT base before any update).
On resume the JSONL is cut back to the checkpoint's step and TensorBoard is opened
with ``purge_step`` so that re-run steps replace, not duplicate, the lost ones.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .rundir import writing


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a metrics file; a torn last line (killed mid-write) is skipped."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def truncate_jsonl(path: str | Path, max_step: int) -> None:
    """Keep only records with ``step <= max_step`` (atomically rewritten)."""
    p = Path(path)
    if not p.exists():
        return
    keep = [r for r in read_jsonl(p) if r.get("step", 0) <= max_step]
    tmp = p.with_suffix(".tmp")
    with writing(tmp):
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    tmp.replace(p)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class RunLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, purge_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._f = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=purge_step)

    def log(self, record: dict) -> None:
        rec = {k: _clean(v) for k, v in record.items()}
        with writing(self.path):
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
        if self.tb is not None:
            step = int(record["step"])
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
