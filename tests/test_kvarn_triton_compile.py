"""The KVarN Triton kernels through the real Triton compiler, on this CPU machine (no GPU, no driver, no launch).

tests/test_kvarn_triton.py runs the kernels under TRITON_INTERPRET=1, where a kernel is plain Python over numpy:
there tl.arange takes any int, so a size unpacked from a constexpr tuple (`D = F[0]; tl.arange(0, D)`) passes, yet
the compiled frontend rejects it ("arange's arguments must be of type tl.constexpr"), which is how the kernels once
failed on an H200 (Triton 3.6). triton.jit picks interpret mode when a kernel is decorated, so the compile runs in a
subprocess without TRITON_INTERPRET. Every kernel goes through the frontend (TTIR) at each shape the CPU tests run;
at D=64 G=64 all three compile to sm_86 (RTX 3090) cubin with Triton's bundled ptxas. At the 27B's D=256 G=128,
dequant and decode attention compile to sm_90a (H200) cubin, encode to sm_86 and sm_90a cubin, and ptxas -v must
report no spill stores for encode: holding a whole tile in registers it spilled 211 KB a thread (sm_90a), and its
ptxas took a CPU minute for sm_90a, over seven for sm_86 (now about a second each).

    python tests/test_kvarn_triton_compile.py   # the subprocess: one line per kernel compiled, then "ok"
"""

from __future__ import annotations

import contextlib
import io
import os
import re
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


def compile_kernel(fn, constexprs: dict, options: dict, stop: str, arch: int = 86) -> str:
    """triton.compile's pipeline (frontend, then the backend's stages) for GPUTarget cuda sm_`arch`, up to `stop`
    ("ttir", "ptx", "cubin"); without the cache, so every call compiles. Arguments not in POINTERS are constexpr;
    pointers are 16-byte aligned, as Triton specializes the torch tensors the wrappers pass (the loads vectorize,
    which sets encode's layouts). Returns ptxas -v's report when `stop` is "cubin", else ""."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if POINTERS.get(n, "")[:1] == "*"}
    src = triton.compiler.ASTSource(
        fn=fn, signature={n: POINTERS.get(n, "constexpr") for n in fn.arg_names}, constexprs=constexprs, attrs=aligned
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
    triton.knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's report to stdout
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        for ext, stage in stages.items():
            module = stage(module, metadata)
            if ext == stop:
                break
        else:
            raise ValueError(f"no stage {stop!r} in {list(stages)}")
    spills = " ".join(SPILLS.findall(report.getvalue()))
    print(fn.__name__, constexprs.get("D"), constexprs.get("G"), f"sm_{arch}", stop, spills, flush=True)
    return report.getvalue()


SPILLS = re.compile(r"\d+ bytes stack frame, \d+ bytes spill stores, \d+ bytes spill loads")


def spill_stores(report: str) -> int:
    """The spill stores ptxas -v reports for the one kernel of a cubin compile."""
    (n,) = re.findall(r"(\d+) bytes spill stores", report)
    return int(n)


def compile_all() -> None:
    """Each kernel with the arguments its Python wrapper passes on CUDA (libdevice, tf32x3 dots, num_warps 8; encode
    with kvarn_triton.encode_args, its cubins asserted free of spill stores)."""
    sys.path.insert(0, str(REPO / "plugins" / "vllm"))
    from qconv_vllm import kvarn_attention as ka
    from qconv_vllm import kvarn_triton as kt

    assert kt.use_libdevice(), "run without TRITON_INTERPRET=1"
    for d, g, kb, vb in CASES:
        a = kt.field_args(d, g, kb, vb)
        small, big = (d, g) == (64, 64), (d, g) == (256, 128)
        enc = kt.encode_args(a)
        launch = {k: enc.pop(k) for k in ("num_warps", "enable_fp_fusion")}
        if small or big:
            for arch in (86, 90) if big else (86,):
                report = compile_kernel(kt._encode_kernel, enc, launch, "cubin", arch)
                assert spill_stores(report) == 0, report
        else:
            compile_kernel(kt._encode_kernel, enc, launch, "ttir")
        compile_kernel(kt._dequant_kernel, a, {"num_warps": 8}, "cubin" if small else "ttir")
        dec = {**a, "HKV": 2, "GQ": 3, "BQ": 16, "BG": min(g, 8192 // d), "PREC": "tf32x3"}
        compile_kernel(ka._decode_kernel, dec, {"num_warps": 8}, "cubin" if small else "ttir")
        if big:  # the 27B's shape, for Hopper: tl.dot lowers to wgmma there
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
