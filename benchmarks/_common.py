"""Shared helpers for the benchmark scripts: inputs, the naive routes, process memory, printing."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
import sys
import time

import torch


# ------------------------------------------------------------------ process memory (Linux /proc)
def status_mib(key: str, *, required: bool = False) -> float | None:
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the peak) in MiB; None where
    it cannot be read (not Linux), or a RuntimeError naming the key with ``required``."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:  # not Linux: the same answer as a missing line
        lines = []
    for line in lines:
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB
    if required:
        raise RuntimeError(f"{key} not in /proc/self/status")
    return None


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set (``5`` into ``/proc/self/clear_refs``, Linux >= 4.0),
    so that peaks before this point are not counted; False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return status_mib("VmHWM") is not None


def make_inputs(T: int, V: int, K: int, dtype: torch.dtype, device="cpu", seed=0):
    """Logits (T, V) filled chunk by chunk (no full float32 temporary), sampled ids, top-K ids."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.empty(T, V, dtype=dtype, device=device)
    step = max(1, (1 << 22) // V)
    for a in range(0, T, step):
        b = min(a + step, T)
        x[a:b] = torch.randn(b - a, V, generator=g, device=device) * 2.0
    k = torch.randint(0, V, (T,), generator=g, device=device)
    tk = torch.randint(0, V, (T, K), generator=g, device=device)
    return x, k, tk


def logp_only(x, k, temperature=1.0):
    """The cost to beat on CPU: only ``log pi_k`` in plain torch (logsumexp + gather)."""
    z = x.float() / temperature if temperature != 1.0 else x.float()
    return z.gather(1, k[:, None]).squeeze(1) - torch.logsumexp(z, -1)


def logp_only_chunked(x, k, rows):
    """The same, chunked like the fused path (no (N, V) temporary): a stricter floor."""
    out = torch.empty(x.shape[0], device=x.device)
    for a in range(0, x.shape[0], rows):
        torch.logsumexp(x[a:a + rows].float(), -1, out=out[a:a + rows])
    return x.gather(1, k[:, None]).squeeze(1).float() - out


def naive_all(x, k, tk):
    """Every statistic through a float32 log-softmax of the whole tensor."""
    logq = torch.log_softmax(x.float(), -1)
    p = logq.exp()
    return {
        "lse": torch.logsumexp(x.float(), -1),
        "logp": logq.gather(1, k[:, None]).squeeze(1),
        "sum_p2": (p * p).sum(-1),
        "entropy": -(p * logq).sum(-1),
        "topk_logp": logq.gather(1, tk),
    }


def interleaved_times(fns: dict, rounds: int, sync=lambda: None) -> dict:
    """Wall times (s) per function, measured in interleaved rounds after one warm-up each,
    so that load changes on a shared machine hit every candidate alike."""
    for f in fns.values():
        f()
    sync()
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            res[n].append(time.perf_counter() - t0)
    return res


def summary(ts):
    return min(ts), statistics.median(ts)


class Sink:
    """Print rows as they come and append them as JSON lines to a file, flushed each time."""

    def __init__(self, path: str | None):
        self.f = open(path, "a") if path else None

    def row(self, text: str, record: dict | None = None):
        print(text, flush=True)
        if self.f is not None and record is not None:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self):
        if self.f is not None:
            self.f.close()


def env_line() -> str:
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, python "
            f"{sys.version.split()[0]}")
