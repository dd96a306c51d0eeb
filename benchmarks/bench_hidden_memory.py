"""Peak memory of the loss from hidden states vs the loss from materialised logits (CPU).

    PYTHONPATH=src python benchmarks/bench_hidden_memory.py                 # T=8192, V=151936, H=1024, bf16
    PYTHONPATH=src python benchmarks/bench_hidden_memory.py --T 512 --V 32768 --H 256   # quick

Two paths, each run once (forward + backward) in its own fresh process, one after the other:

  logits  logits = hidden @ W.T (autograd), then pdmask.policy_loss(logits, ...) and backward:
          what a trainer does today (the (T, V) logits and their gradient exist)
  hidden  pdmask.policy_loss_from_hidden(hidden, W, ...) and backward: the vocabulary is
          walked in column chunks, no (T, V) tensor exists

Both get gradients for ``hidden`` and ``W``. Memory is the growth of the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs after the inputs are built and a
small warm-up run), so the inputs (hidden, W) are not counted and the gradients are.
The ratio logits / hidden is printed from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import reset_peak, status_mib  # noqa: E402

import pdmask  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def inputs(T, V, H, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, T, H, generator=g).to(dtype)
    W = (torch.randn(V, H, generator=g) * (2.0 / H ** 0.5)).to(dtype)
    k = torch.randint(0, V, (1, T), generator=g)
    tk = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(min(T, 64))])
    tk = tk.repeat(T // tk.shape[0] + 1, 1)[:T][None]  # (1, T, K) distinct ids per row
    tk[..., 0] = k  # the sampled token in the top-K
    tk_lp = torch.full((1, T, K), -6.0)  # a flat rollout top-K: mass K e^-6 < 1
    tk_lp[..., 0] = -2.0
    rollout = pdmask.Rollout(sampled_ids=k, sampled_logprob=tk_lp[..., 0].clone(), topk_ids=tk, topk_logprobs=tk_lp,
                             response_mask=torch.ones(1, T, dtype=torch.bool))
    return dict(hidden=hidden, W=W, rollout=rollout, advantages=torch.randn(1, generator=g).sign())


def run(path: str, d: dict) -> float:
    """Forward and backward of one path; returns the loss (to show both agree)."""
    h = d["hidden"].detach().requires_grad_()
    W = d["W"].detach().requires_grad_()
    if path == "logits":
        out = pdmask.policy_loss(h @ W.T, d["rollout"], d["advantages"], mode="pdm-topk-kl")
    else:
        out = pdmask.policy_loss_from_hidden(h, W, d["rollout"], d["advantages"], mode="pdm-topk-kl")
    out.loss.backward()
    return float(out.loss)


def child(path, T, V, H, K, dt) -> None:
    d = inputs(T, V, H, K, DTYPES[dt])
    small = inputs(8, V, H, K, DTYPES[dt], seed=1)
    small["W"] = d["W"]
    run(path, small)  # warm-up: page in code and the weight, start the threads (not counted)
    if not reset_peak():  # VmHWM := current RSS
        raise RuntimeError("/proc/self/clear_refs: cannot reset the peak resident set (Linux >= 4.0 needed)")
    before = status_mib("VmRSS", required=True)
    t0 = time.perf_counter()
    loss = run(path, d)
    dt_s = time.perf_counter() - t0
    print(json.dumps({"path": path, "peak_extra_mib": status_mib("VmHWM", required=True) - before, "seconds": dt_s,
                      "loss": loss}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--K", type=int, default=20)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--_child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a._child:
        path, T, V, H, K, dt = a._child
        child(path, int(T), int(V), int(H), int(K), dt)
        return
    env = os.environ.copy()
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    print(f"# bench_hidden_memory: T={a.T} V={a.V} H={a.H} K={a.K} {a.dtype}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; forward + backward, mode pdm-topk-kl", flush=True)
    gib = lambda n_el, dt: n_el * (2 if dt == "bf16" else 4) / 2 ** 30  # noqa: E731
    print(f"# one (T, V) tensor in {a.dtype}: {gib(a.T * a.V, a.dtype):.2f} GiB; W: {gib(a.V * a.H, a.dtype):.2f} GiB",
          flush=True)
    res = {}
    for path in ("logits", "hidden"):
        args = [sys.executable, __file__, "--_child", path, str(a.T), str(a.V), str(a.H), str(a.K), a.dtype]
        if a.threads:
            args += ["--threads", str(a.threads)]
        r = subprocess.run(args, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            raise SystemExit(f"{path}: the child process failed (exit {r.returncode})")
        res[path] = json.loads(r.stdout.strip().splitlines()[-1])
        p = res[path]
        print(f"{path:7s} peak extra {p['peak_extra_mib']:9.1f} MiB   {p['seconds']:7.1f} s   loss {p['loss']:.6f}",
              flush=True)
    ratio = res["logits"]["peak_extra_mib"] / max(res["hidden"]["peak_extra_mib"], 1e-9)
    print(f"ratio logits / hidden peak extra memory: {ratio:.2f}")


if __name__ == "__main__":
    main()
