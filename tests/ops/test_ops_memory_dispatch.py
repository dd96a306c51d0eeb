"""Peak extra memory of the chunked path (every tensor it allocates, recorded at the
dispatcher level), and the impl dispatcher's choices and errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ops_cases import AllocRecorder, row_stats

from pdmask import ops
from tests import flat  # noqa: E402


def _largest(fn):
    rec = AllocRecorder()
    with rec:
        fn()
    return max(n for _, n in rec.sizes), rec.sizes


def test_recorder_sees_a_naive_full_copy():
    # control: the naive float32 route allocates (N, V) temporaries; the recorder must see them
    x = torch.randn(64, 1000, dtype=torch.bfloat16)
    big, _ = _largest(lambda: torch.log_softmax(x.float(), -1))
    assert big == 64 * 1000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_forward_allocates_at_most_the_chunk(dtype):
    N, V, K, rows = 64, 1000, 20, 4
    x = torch.randn(N, V).to(dtype)
    k, tk = torch.randint(0, V, (N,)), torch.randint(0, V, (N, K))
    big, sizes = _largest(lambda: row_stats(x, k, tk, impl="torch", chunk_rows=rows, validate=False))
    assert big <= max(rows * V, N * K), sizes  # two chunk buffers + O(N K) outputs; never N * V


def test_forward_with_neg_inf_fixup_stays_chunked():
    N, V, rows = 32, 500, 4
    x = torch.randn(N, V)
    x[:, ::7] = float("-inf")  # every row takes the -inf fix-up path
    big, sizes = _largest(lambda: row_stats(x, torch.zeros(N, dtype=torch.long), impl="torch",
                                                chunk_rows=rows, validate=False))
    assert big <= rows * V, sizes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_allocates_the_gradient_and_one_chunk(dtype):
    N, V, rows = 64, 1000, 4
    x = torch.randn(N, V).to(dtype)
    k = torch.randint(0, V, (N,))
    logp = row_stats(x.requires_grad_(), k, impl="torch", chunk_rows=rows, validate=False)["logp"]
    rec = AllocRecorder()
    with rec:
        logp.backward(torch.randn(N))
    full = [s for s in rec.sizes if s[1] == N * V]
    assert len(full) == 1, rec.sizes  # the gradient itself, in the logits' dtype
    assert max(n for n in [s[1] for s in rec.sizes] if n != N * V) <= rows * V


def test_default_chunk_is_the_one_rule():
    cpu = ops.CHUNK_ELEMENTS["cpu"]
    assert ops.rows_per_chunk(151936) * 151936 <= 2 * cpu
    assert ops.rows_per_chunk(32768) == cpu // 32768
    assert ops.rows_per_chunk(10**7) == 1 and ops.rows_per_chunk(10**7, 3) == 3
    assert ops.rows_per_chunk(32768, device="cuda") == ops.CHUNK_ELEMENTS["cuda"] // 32768


# ------------------------------------------------------------------ dispatcher
def test_auto_resolves_to_torch_on_cpu():
    assert ops.resolve_impl("auto", torch.zeros(2, 3)) == "torch"
    with pytest.raises(ValueError, match="impl: unknown value 'reference'"):  # the oracle lives in the tests
        ops.resolve_impl("reference", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="impl: unknown value 'gpu'"):
        ops.resolve_impl("gpu", torch.zeros(2, 3))


def test_auto_never_imports_triton_on_cpu():
    # a fresh interpreter: the whole public path on CPU must not import triton
    code = ("import sys, torch, pdmask\n"
            "x = torch.randn(2, 3, 10, requires_grad=True)\n"
            "r = pdmask.Rollout(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), -2.0),"
            " torch.zeros(2, 3, 1, dtype=torch.long), torch.full((2, 3, 1), -2.0), torch.ones(2, 3, dtype=torch.bool))\n"
            "out = pdmask.policy_loss(x, r, torch.ones(2))\n"
            "out.loss.backward()\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n"
            "assert 'pdmask.ops._kernel' not in sys.modules\n"
            "print('ok')\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_bad_arguments_name_the_argument():
    x = torch.randn(4, 10)
    k = torch.zeros(4, dtype=torch.long)
    cases = [
        (dict(logits=torch.randn(4, 10, 2), sampled_ids=k), "logits"),
        (dict(logits=x.long(), sampled_ids=k), "logits"),
        (dict(logits=x, sampled_ids=k.float()), "sampled_ids"),
        (dict(logits=x, sampled_ids=k[:3]), "sampled_ids"),
        (dict(logits=x, sampled_ids=k + 10), r"sampled_ids: ids must lie in \[0, 10\)"),
        (dict(logits=x, sampled_ids=k, topk_ids=torch.zeros(4, dtype=torch.long)), "topk_ids"),
        (dict(logits=x, sampled_ids=k, topk_ids=torch.full((4, 2), -1)), "topk_ids: ids must lie"),
        (dict(logits=x, sampled_ids=k, temperature=0.0), "temperature"),
        (dict(logits=x, sampled_ids=k, chunk_rows=0), "chunk_rows"),
        (dict(logits=x, sampled_ids=k, impl="fast"), "impl"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            row_stats(**kw)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if not ops.triton_available():
        with pytest.raises(ValueError, match=r"pip install -e '\.\[triton\]'"):
            row_stats(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), impl="triton")
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        row_stats(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), impl="triton")
