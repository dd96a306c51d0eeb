"""Compile every variant of pdmask's Triton kernels for a GPU architecture down to a cubin,
without a GPU (the compiler-only errors the interpreter cannot see); used by
``test_ops_triton_compile.py`` in a fresh process (TRITON_INTERPRET unset)."""

from __future__ import annotations

import triton

from pdmask.ops import _kernel


def compile_check(arch: int = 90, dtypes=("bf16", "fp16", "fp32"), num_warps: int | None = None) -> list[str]:
    """Compile every kernel variant for ``sm_{arch}`` down to a cubin, without a GPU.

    Catches what the interpreter cannot (constexpr globals, type rules of the compiler,
    ptxas errors). Needs ``TRITON_INTERPRET`` unset when triton is imported. Returns one
    line per variant.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile

    if _kernel.language_interpreted():
        raise RuntimeError("compile_check: triton was imported with TRITON_INTERPRET=1")
    fwd, bwd = triton.jit(_kernel._row_stats_fwd), triton.jit(_kernel._logp_bwd)
    target = GPUTarget("cuda", arch, 32)
    opts = {"num_warps": num_warps or _kernel.NUM_WARPS}
    done = []
    for dt in dtypes:
        for has_topk in (True, False):
            sig = {"X": f"*{dt}", "stride_x": "i32", "IDS": "*i64", "TOPK": "*i64", "stride_tk": "i32",
                   "LSE": "*fp32", "LOGP": "*fp32", "SUMP2": "*fp32", "ENT": "*fp32", "TOPK_LOGP": "*fp32",
                   "stride_tl": "i32", "SUP": "*i64", "stride_sup": "i32", "LSE_TAIL": "*fp32",
                   "P2_TAIL": "*fp32", "V": "i32", "K": "i32", "scale": "fp32", "rescue": "fp32",
                   "BLOCK_V": "constexpr", "BLOCK_K": "constexpr", "HAS_TOPK": "constexpr"}
            src = ASTSource(fwd, sig, constexprs={"BLOCK_V": _kernel.FWD_BLOCK_V, "BLOCK_K": 32, "HAS_TOPK": has_topk})
            k = tcompile(src, target=target, options=opts)
            assert k.asm.get("cubin"), "no cubin produced"
            done.append(f"fwd {dt} topk={has_topk} sm_{arch}: {len(k.asm['cubin'])} bytes")
        sig = {"X": f"*{dt}", "stride_x": "i32", "IDS": "*i64", "LSE": "*fp32", "G": "*fp32", "DX": f"*{dt}",
               "stride_dx": "i32", "V": "i32", "scale": "fp32", "inv_t": "fp32", "BLOCK_V": "constexpr"}
        k = tcompile(ASTSource(bwd, sig, constexprs={"BLOCK_V": _kernel.BWD_BLOCK_V}), target=target, options=opts)
        assert k.asm.get("cubin"), "no cubin produced"
        done.append(f"bwd {dt} sm_{arch}: {len(k.asm['cubin'])} bytes")
    return done
