"""CPU benchmark: the fused torch path (all row statistics) vs computing only the sampled
token's log-prob in plain torch, measured side by side in one run.

    PYTHONPATH=src python benchmarks/bench_cpu.py            # T in {256, 1024}, V in {32768, 151936}
    PYTHONPATH=src python benchmarks/bench_cpu.py --quick    # one small shape
    PYTHONPATH=src python benchmarks/bench_cpu.py --no-memory

Rows (forward unless marked):
  logp-only        torch.logsumexp(x.float()) + gather: log pi_k only (the cost to beat)
  logp-only-chunk  the same in the fused path's row chunks (a stricter floor: no (N, V) temporary)
  naive-fp32       every statistic from a float32 log_softmax of the whole tensor
  reference        tests/ops/reference.py's reduce_rows (the tests' plain chunked oracle)
  fused            pdmask.ops.row_stats(impl="torch"): lse, logp, sum_p2, entropy, top-K log-probs
  *+bwd            forward and the backward of sum(g * log pi_k)

Times are the minimum over interleaved rounds (a shared machine adds noise, never removes
it); the median is printed too. Memory is the growth of the peak resident set of a fresh
process that runs the row once (``--no-memory`` skips these subprocesses).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Sink, env_line, interleaved_times, logp_only, logp_only_chunked, make_inputs, naive_all, reset_peak, status_mib,
    summary,
)

from pdmask import ops  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ops.reference import SampledLogprob, reduce_rows  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def methods(x, k, tk, with_bwd: bool):
    rows = ops.rows_per_chunk(x.shape[1])
    g = torch.randn(x.shape[0])
    fns = {
        "logp-only": lambda: logp_only(x, k),
        "logp-only-chunk": lambda: logp_only_chunked(x, k, rows),
        "naive-fp32": lambda: naive_all(x, k, tk),
        "reference": lambda: reduce_rows(x, k, tk),
        "fused": lambda: ops.row_stats(x, k, tk, compute=ops.Compute("torch"), validate=False),
    }
    if with_bwd:
        def logp_only_bwd():
            xr = x.detach().requires_grad_()
            (logp_only(xr, k) * g).sum().backward()

        def fused_bwd():
            xr = x.detach().requires_grad_()
            (ops.row_stats(xr, k, tk, compute=ops.Compute("torch"), validate=False).logp * g).sum().backward()

        def reference_bwd():
            xr = x.detach().requires_grad_()
            lse = reduce_rows(x, k, tk)["lse"]
            rws = max(1, (1 << 24) // x.shape[1])
            (SampledLogprob.apply(xr, k, lse, 1.0, rws) * g).sum().backward()

        fns.update({"logp-only+bwd": logp_only_bwd, "reference+bwd": reference_bwd, "fused+bwd": fused_bwd})
    return fns


def measure_memory(name: str, T: int, V: int, K: int, dt: str) -> None:
    """Child process: peak RSS growth (MiB) of one run of ``name``."""
    x, k, tk = make_inputs(T, V, K, DTYPES[dt])
    methods(x[:2], k[:2], tk[:2], with_bwd=True)[name]()  # page in code, start threads: not counted
    fns = methods(x, k, tk, with_bwd=True)
    # VmHWM is the peak resident set; resetting it to the current RSS leaves the peaks of
    # input creation and warm-up out
    if not reset_peak():
        raise RuntimeError("/proc/self/clear_refs: cannot reset the peak resident set (Linux >= 4.0 needed)")
    before = status_mib("VmRSS", required=True)
    fns[name]()
    print(f"{max(status_mib('VmHWM', required=True) - before, 0.0):.1f}")


def child_memory(name, T, V, K, dt) -> float | None:
    r = subprocess.run([sys.executable, __file__, "--_mem", name, str(T), str(V), str(K), dt],
                       capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    try:
        return float(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(r.stderr, file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small shape, few rounds")
    ap.add_argument("--T", type=int, nargs="*", default=None)
    ap.add_argument("--V", type=int, nargs="*", default=None)
    ap.add_argument("--K", type=int, default=20)
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=None, help="append JSON lines here (flushed per row)")
    ap.add_argument("--_mem", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._mem:
        name, T, V, K, dt = a._mem
        measure_memory(name, int(T), int(V), int(K), dt)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the memory subprocesses
    Ts = a.T or ([256] if a.quick else [256, 1024])
    Vs = a.V or ([32768] if a.quick else [32768, 151936])
    rounds = a.rounds or (3 if a.quick else 7)
    sink = Sink(a.out)
    sink.row(f"# bench_cpu: {env_line()}; K={a.K}; min over {rounds} interleaved rounds; "
             f"chunk {_torch.CHUNK_ELEMENTS} elements")
    sink.row(f"{'dtype':5s} {'T':>5s} {'V':>7s}  {'row':16s} {'min ms':>9s} {'med ms':>9s} {'ratio':>6s} "
             f"{'peak extra MiB':>14s}")
    for dt in a.dtypes:
        for V in Vs:
            for T in Ts:
                x, k, tk = make_inputs(T, V, a.K, DTYPES[dt])
                fns = methods(x, k, tk, with_bwd=not a.no_bwd)
                res = interleaved_times(fns, rounds)
                base = {"": min(res["logp-only"]), "+bwd": min(res.get("logp-only+bwd", [float("nan")]))}
                for name, ts in res.items():
                    lo, med = summary(ts)
                    ref = base["+bwd" if name.endswith("+bwd") else ""]
                    mem = None if a.no_memory else child_memory(name, T, V, a.K, dt)
                    ms = "-" if mem is None else f"{mem:.0f}"
                    sink.row(f"{dt:5s} {T:5d} {V:7d}  {name:16s} {lo * 1e3:9.2f} {med * 1e3:9.2f} "
                             f"{lo / ref:6.2f} {ms:>14s}",
                             dict(dtype=dt, T=T, V=V, K=a.K, row=name, min_ms=lo * 1e3, median_ms=med * 1e3,
                                  ratio_vs_logp_only=lo / ref, peak_extra_mib=mem, threads=torch.get_num_threads()))
                del x, k, tk, fns
    sink.close()


if __name__ == "__main__":
    main()
