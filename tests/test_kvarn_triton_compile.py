"""The KVarN Triton kernels through the real Triton compiler, on this CPU machine (no GPU, no driver, no launch).

tests/test_kvarn_triton.py runs the kernels under TRITON_INTERPRET=1, where a kernel is plain Python over numpy:
there tl.arange takes any int, so a size unpacked from a constexpr tuple (`D = F[0]; tl.arange(0, D)`) passes, yet
the compiled frontend rejects it ("arange's arguments must be of type tl.constexpr"), which is how the kernels once
failed on an H200 (Triton 3.6). triton.jit picks interpret mode when a kernel is decorated, so the compile runs in a
subprocess without TRITON_INTERPRET. Every kernel goes through the frontend (TTIR) at each shape the CPU tests run;
at D=64 G=64 dequant and decode attention compile to sm_86 (RTX 3090) cubin with Triton's bundled ptxas, and
encode to PTX: its ptxas alone takes about a minute at D=64 on this 2-core machine (at D=256 G=128 a CPU minute
for sm_90a, over seven for sm_86). At the 27B's D=256 G=128, dequant and decode attention compile to sm_90a (H200)
cubin, encode to TTGIR.

    python tests/test_kvarn_triton_compile.py   # the subprocess: one line per kernel compiled, then "ok"
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CASES = [(64, 64, 4, 2), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 2), (256, 64, 4, 2), (256, 128, 4, 4)]
POINTERS = {
    "k_ptr": "*fp32",
    "v_ptr": "*fp32",
    "rec_ptr": "*u8",
    "rec16_ptr": "*fp16",
    **dict.fromkeys(("q_ptr", "qr_ptr", "m_ptr", "den_ptr", "accn_ptr", "accr_ptr"), "*fp32"),
    "pool_ptr": "*u8",
    "pool16_ptr": "*fp16",
    **dict.fromkeys(("bt_ptr", "nc_ptr", "sink_ptr", "cur_ptr"), "*i32"),
    "sk_ptr": "*fp16",
    "sv_ptr": "*fp16",
    "scale": "fp32",
    **dict.fromkeys(("max_blocks", "S", "TPS"), "i32"),
}


def compile_kernel(fn, constexprs: dict, options: dict, stop: str, arch: int = 86) -> None:
    """triton.compile's pipeline (frontend, then the backend's stages) for GPUTarget cuda sm_`arch`, up to `stop`
    ("ttir", "ptx", "cubin"); without the cache, so every call compiles. Arguments not in POINTERS are constexpr."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    src = triton.compiler.ASTSource(
        fn=fn, signature={n: POINTERS.get(n, "constexpr") for n in fn.arg_names}, constexprs=constexprs
    )
    backend = make_backend(target)
    opts = backend.parse_options(options)
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
    metadata = {"hash": src.hash(), "target": target, **opts.__dict__}
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == stop:
            break
    else:
        raise ValueError(f"no stage {stop!r} in {list(stages)}")
    print(fn.__name__, constexprs.get("D"), constexprs.get("G"), f"sm_{arch}", stop, flush=True)


def compile_all() -> None:
    """Each kernel with the arguments its Python wrapper passes on CUDA (libdevice, tf32x3 dots, num_warps 8)."""
    sys.path.insert(0, str(REPO / "plugins" / "vllm"))
    from qconv_vllm import kvarn_attention as ka
    from qconv_vllm import kvarn_triton as kt

    assert kt.use_libdevice(), "run without TRITON_INTERPRET=1"
    for d, g, kb, vb in CASES:
        a = kt.field_args(d, g, kb, vb)
        small = (d, g) == (64, 64)
        enc = {**a, "ITERS": 8, "LIBDEV": True}
        compile_kernel(kt._encode_kernel, enc, {"num_warps": 8, "enable_fp_fusion": False}, "ptx" if small else "ttir")
        compile_kernel(kt._dequant_kernel, a, {"num_warps": 8}, "cubin" if small else "ttir")
        dec = {**a, "HKV": 2, "GQ": 3, "BQ": 16, "BG": min(g, 8192 // d), "PREC": "tf32x3"}
        compile_kernel(ka._decode_kernel, dec, {"num_warps": 8}, "cubin" if small else "ttir")
        if (d, g) == (256, 128):  # the 27B's shape, for Hopper: tl.dot lowers to wgmma there
            compile_kernel(kt._encode_kernel, enc, {"num_warps": 8, "enable_fp_fusion": False}, "ttgir", arch=90)
            compile_kernel(kt._dequant_kernel, a, {"num_warps": 8}, "cubin", arch=90)
            compile_kernel(ka._decode_kernel, dec, {"num_warps": 8}, "cubin", arch=90)
    print("ok")


def test_kernels_compile_for_a_real_gpu():
    pytest.importorskip("triton", reason="triton is not installed in this environment (pip install triton==3.9.0)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset; 1 is that default
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.splitlines()[-1:] == ["ok"], (r.stdout + r.stderr)[-4000:]


if __name__ == "__main__":
    compile_all()
