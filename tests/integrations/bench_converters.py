"""Converter throughput: B x T positions, K = 20, vLLM dict vs FlatLogprobs (fakes).

    OMP_NUM_THREADS=1 PYTHONPATH=src python tests/integrations/bench_converters.py
"""
import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import engine_fakes as F
from pdmask.integrations.vllm import from_vllm_logprobs
B, T, K, V = 64, 512, 20, 1000
g = torch.Generator().manual_seed(0)
for flat in (False, True):
    seqs, ids = [], []
    for b in range(B):
        c = F.FlatLogprobs() if flat else []
        toks = []
        for t in range(T):
            lp = torch.randn(V, generator=g).log_softmax(-1)
            v, i = lp.topk(K)
            s = int(i[0]) if t % 3 else int(torch.randint(K, V, (1,), generator=g))
            F.append_position(c, [s] + i.tolist(), [float(lp[s])] + v.tolist(), 1 if t % 3 else K + 5, K)
            toks.append(s)
        seqs.append(c); ids.append(toks)
    t0 = time.perf_counter(); r = from_vllm_logprobs(seqs, ids, k=K); dt = time.perf_counter() - t0
    print(f"{'flat' if flat else 'dict'}: {B}x{T} positions, K={K}: {dt:.2f} s ({B*T/dt/1e3:.0f}k positions/s)")
