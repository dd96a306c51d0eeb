"""Converter throughput: B x T positions, K = 20, vLLM dicts vs FlatLogprobs, one run.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_converters.py

The inputs are the vLLM-shaped fakes of the converter tests (tests/formats/engine_fakes.py):
one position in three has its sampled token outside the top-K (K + 1 entries), the others
sample the rank-1 token (the flat format then stores it twice). Each format is timed once
on the same (B, T, K); the ratio line compares the two from this one run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "formats"))
import engine_fakes as F  # noqa: E402

from pdmask.formats.vllm import from_vllm_logprobs  # noqa: E402

B, T, K, V = 64, 512, 20, 1000


def make_outputs(flat: bool, g: torch.Generator):
    """B completions of T positions in vLLM's dict (or flat) format, and their sampled ids."""
    seqs, ids = [], []
    for _ in range(B):
        c = F.FlatLogprobs() if flat else []
        toks = []
        for t in range(T):
            lp = torch.randn(V, generator=g).log_softmax(-1)
            v, i = lp.topk(K)
            s = int(i[0]) if t % 3 else int(torch.randint(K, V, (1,), generator=g))
            F.append_position(c, [s] + i.tolist(), [float(lp[s])] + v.tolist(), 1 if t % 3 else K + 5, K)
            toks.append(s)
        seqs.append(c)
        ids.append(toks)
    return seqs, ids


def main() -> None:
    g = torch.Generator().manual_seed(0)
    secs = {}
    for flat in (False, True):
        name = "flat" if flat else "dict"
        seqs, ids = make_outputs(flat, g)
        t0 = time.perf_counter()
        from_vllm_logprobs(seqs, ids, k=K)
        secs[name] = dt = time.perf_counter() - t0
        print(f"{name}: {B}x{T} positions, K={K}: {dt:.2f} s ({B * T / dt / 1e3:.0f}k positions/s)")
    print(f"flat / dict time: {secs['flat'] / secs['dict']:.2f}")


if __name__ == "__main__":
    main()
