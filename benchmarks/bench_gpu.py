"""GPU benchmark (CUDA): the fused Triton op against one read of the logits, measured side
by side in one run, after a correctness check of every shape against the reference.

    PYTHONPATH=src python benchmarks/bench_gpu.py --quick                  # ~1 min: T=4096, V=32768
    PYTHONPATH=src python benchmarks/bench_gpu.py --out results/gpu.jsonl  # T in {4096, 16384}, V in {32768, 151936}
    PYTHONPATH=src python benchmarks/bench_gpu.py --tune --quick           # also sweep BLOCK_V x num_warps

Rows (bf16 logits, K = 20):
  floor        torch.amax(logits, -1): one bf16 read of the logits
  naive-fp32   every statistic from a float32 log_softmax of the whole tensor
  reference    tests/ops/reference.py's reduce_rows (plain chunked torch, the tests' oracle)
  torch-fused  pdmask.ops.row_stats(impl="torch") (the CPU path, run on the GPU)
  triton       pdmask.ops.row_stats(impl="triton"): lse, logp, sum_p2, entropy, top-K log-probs
  *+bwd        forward and the backward of sum(g * log pi_k) (logp-only+bwd: plain
               logsumexp + gather through autograd)

Time: median of CUDA-event timings after warm-up; ratio: time / floor. Memory: peak
allocation above what was allocated before the call (torch.cuda.max_memory_allocated),
in MiB and as a fraction of the logits' bytes. Rows print (and append to --out as JSON
lines) as they are measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Sink, logp_only, make_inputs, naive_all  # noqa: E402

from pdmask import ops  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ops.reference import SampledLogprob, reduce_rows  # noqa: E402

KEYS = ("lse", "logp", "sum_p2", "entropy", "topk_logp")


DRY = False  # --dry-run: CPU + Triton interpreter, tiny shapes: exercises the script, measures nothing


def cuda_time(fn, reps: int, warmup: int = 2) -> float:
    if DRY:
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]  # ms


def peak_extra(fn) -> float:
    if DRY:
        fn()
        return math.nan
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def check(x, k, tk, sink, T, V) -> bool:
    """Triton vs reference on the first rows (the reference in float32 is exact enough)."""
    n = min(x.shape[0], 512)
    got = ops.row_stats(x[:n], k[:n], tk[:n], compute=ops.Compute("triton"))
    ref = reduce_rows(x[:n], k[:n], tk[:n])
    # the tests' tolerance: a few float32 ulps of the largest |z| plus 64 ulps relative
    eps = torch.finfo(torch.float32).eps
    tol = 64 * eps + 8 * eps * float(x[:n].float().abs().max())
    errs = {key: float(((getattr(got, key) - ref[key]).abs() - 64 * eps * ref[key].abs()).max()) for key in KEYS}
    # gradient on the same rows
    g = torch.randn(n, device=x.device)
    xa = x[:n].clone().requires_grad_()
    (ops.row_stats(xa, k[:n], compute=ops.Compute("triton")).logp * g).sum().backward()
    xb = x[:n].clone().requires_grad_()
    (SampledLogprob.apply(xb, k[:n], ref["lse"], 1.0, n) * g).sum().backward()
    gerr = float((xa.grad.float() - xb.grad.float()).abs().max())
    ok = all(e <= tol for e in errs.values()) and gerr <= 2 ** -7 * float(g.abs().max()) + 1e-6
    sink.row(f"# check T={T} V={V}: max(|triton - reference| - 64 eps |reference|) " +
             ", ".join(f"{key} {e:.1e}" for key, e in errs.items()) + f", grad {gerr:.1e} (tol {tol:.1e}) "
             + ("OK" if ok else "FAIL"),
             dict(kind="check", T=T, V=V, errors=errs, grad_error=gerr, tol=tol, ok=ok))
    return ok


def methods(x, k, tk, with_bwd: bool):
    g = torch.randn(x.shape[0], device=x.device)
    fns = {
        "floor": lambda: torch.amax(x, -1),
        "naive-fp32": lambda: naive_all(x, k, tk),
        "reference": lambda: reduce_rows(x, k, tk),
        "torch-fused": lambda: ops.row_stats(x, k, tk, compute=ops.Compute("torch"), validate=False),
        "triton": lambda: ops.row_stats(x, k, tk, compute=ops.Compute("triton"), validate=False),
    }
    if with_bwd:
        def logp_only_bwd():
            xr = x.detach().requires_grad_()
            (logp_only(xr, k) * g).sum().backward()
            return xr.grad

        def reference_bwd():
            xr = x.detach().requires_grad_()
            lse = reduce_rows(x, k, tk)["lse"]
            (SampledLogprob.apply(xr, k, lse, 1.0, max(1, (1 << 24) // x.shape[1])) * g).sum().backward()
            return xr.grad

        def triton_bwd():
            xr = x.detach().requires_grad_()
            (ops.row_stats(xr, k, tk, compute=ops.Compute("triton"), validate=False).logp * g).sum().backward()
            return xr.grad

        fns.update({"logp-only+bwd": logp_only_bwd, "reference+bwd": reference_bwd, "triton+bwd": triton_bwd})
    return fns


def tune(x, k, tk, sink, reps):
    from pdmask.ops import _kernel

    sink.row("# tune: forward kernel, BLOCK_V x num_warps (ms)")
    for bv in (1024, 2048, 4096, 8192, 16384):
        for nw in (4, 8, 16, 32):
            try:
                ms = cuda_time(lambda: _kernel.forward(x, k, tk, temperature=1.0, block_v=bv, num_warps=nw,
                                                        rescue=ops.tail_rescue_below(torch.float32, x.shape[1])), reps)
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                sink.row(f"tune BLOCK_V={bv:5d} warps={nw:2d}  failed: {type(e).__name__}")
                continue
            sink.row(f"tune BLOCK_V={bv:5d} warps={nw:2d}  {ms:8.3f} ms",
                     dict(kind="tune", T=x.shape[0], V=x.shape[1], block_v=bv, num_warps=nw, ms=ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T=4096, V=32768 only, fewer repetitions")
    ap.add_argument("--T", type=int, nargs="*", default=None)
    ap.add_argument("--V", type=int, nargs="*", default=None)
    ap.add_argument("--K", type=int, default=20)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], help="rows to leave out (e.g. naive-fp32 torch-fused)")
    ap.add_argument("--tune", action="store_true", help="sweep the forward kernel's launch configuration")
    ap.add_argument("--out", default=None, help="append JSON lines here (flushed per row)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: run every code path on CPU in Triton's interpreter at tiny sizes (no figures)")
    a = ap.parse_args()
    global DRY
    DRY = a.dry_run
    dev = "cpu" if DRY else "cuda"
    if DRY:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (CPU: benchmarks/bench_cpu.py; or --dry-run)")
    Ts = a.T or ([32] if DRY else [4096] if a.quick else [4096, 16384])
    Vs = a.V or ([300] if DRY else [32768] if a.quick else [32768, 151936])
    reps = a.reps or (5 if a.quick else 10)
    sink = Sink(a.out)
    import triton

    name = "DRY RUN on CPU (interpreter; timings meaningless)" if DRY else torch.cuda.get_device_name()
    sink.row(f"# bench_gpu: {name}, torch {torch.__version__}, triton "
             f"{triton.__version__}; bf16 logits, K={a.K}; median of {reps} CUDA-event timings")
    sink.row(f"{'T':>6s} {'V':>7s}  {'row':14s} {'ms':>9s} {'x floor':>8s} {'extra MiB':>10s} {'x logits':>9s}")
    all_ok = True
    for V in Vs:
        for T in Ts:
            x, k, tk = make_inputs(T, V, a.K, torch.bfloat16, device=dev)
            all_ok &= check(x, k, tk, sink, T, V)
            if a.tune:
                tune(x, k, tk, sink, reps)
            nbytes = x.numel() * x.element_size()
            floor = None
            for row, fn in methods(x, k, tk, with_bwd=not a.no_bwd).items():
                if row in a.skip:
                    continue
                try:
                    ms = cuda_time(fn, reps)
                    mem = peak_extra(fn)
                except torch.OutOfMemoryError:
                    sink.row(f"{T:6d} {V:7d}  {row:14s} out of memory", dict(T=T, V=V, row=row, oom=True))
                    torch.cuda.empty_cache()
                    continue
                floor = ms if row == "floor" else floor
                ratio = ms / floor if floor else math.nan
                sink.row(f"{T:6d} {V:7d}  {row:14s} {ms:9.3f} {ratio:8.2f} {mem:10.1f} {mem * 2**20 / nbytes:9.3f}",
                         dict(T=T, V=V, K=a.K, row=row, ms=ms, ratio_vs_floor=ratio, peak_extra_mib=mem,
                              extra_vs_logits=mem * 2**20 / nbytes, device=name))
            del x, k, tk
            if not DRY:
                torch.cuda.empty_cache()
    sink.row("# all checks OK" if all_ok else "# SOME CHECKS FAILED")
    sink.close()
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
