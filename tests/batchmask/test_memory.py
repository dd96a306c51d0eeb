"""No allocation grows with T x |theta|: the peak memory of one batch mask at two lengths.

A per-token gradient store (the naive route) would add (T2 - T1) * B * |theta| * 8 bytes
(~1.8 GB here); the activations that legitimately grow with T add 10-45 MB. Each length
runs in a fresh process so that the peak resident set (``ru_maxrss``) is its own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


SCRIPT = r"""
import json, resource, sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from batchmask.helpers import TinyLM, make_batch
import pdmask
import pdmask_lab.batchmask
m = TinyLM(vocab=512, d=256, layers=2, heads=4, ff=1024, max_pos=128, seed=0)
b = make_batch(m, B=2, P=4, T={T}, seed=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
opt = torch.optim.AdamW(m.parameters())
methods = []
for method, params in (("jvp", "all"), ("double-backward", "all"), ("jvp", 1)):
    r = pdmask.Rollout(b["input_ids"][:, -{T}:], b["rollout_logprob"], b["rollout_topk_ids"], b["rollout_topk_logprobs"],
                       b["response_mask"])
    out = pdmask_lab.batchmask.batch_mask(m, b["input_ids"], b["attention_mask"], r, b["advantages"], method=method, params=params,
                            optimizer=opt)
    methods.append(out.method)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(dict(before=before * 1024, after=after * 1024, n_params=sum(p.numel() for p in m.parameters()),
                      n_out=int(out.out_of_region.sum()), methods=methods)))
"""


def _peak(T):
    tests = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests, T=T)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_peak_memory_does_not_grow_with_length_times_parameters():
    """The three passes (forward mode, double backward, forward mode over the top block) in one process each."""
    short, long = _peak(16), _peak(80)
    theta_bytes = short["n_params"] * 8
    assert short["n_out"] > 0 and long["n_out"] > 0
    assert short["methods"] == ["jvp", "double-backward", "jvp-top"]
    growth = long["after"] - short["after"]
    added_tokens = (80 - 16) * 2
    # per added token, less than a tenth of |theta| (measured: ~2.5% for the double
    # backward, which keeps its graph; ~1% for the JVP); a per-token gradient store adds 100%
    assert growth < 0.1 * added_tokens * theta_bytes, (growth / 2**20, added_tokens * theta_bytes / 2**20)
