"""The KVarN Triton kernels through the real Triton compiler, on this CPU machine (no GPU, no driver, no launch).

tests/test_kvarn_triton.py runs the kernels under TRITON_INTERPRET=1, where a kernel is plain Python over numpy:
there tl.arange takes any int, so a size unpacked from a constexpr tuple (`D = F[0]; tl.arange(0, D)`) passes, yet
the compiled frontend rejects it ("arange's arguments must be of type tl.constexpr"), which is how the kernels once
failed on an H200 (Triton 3.6). triton.jit picks interpret mode when a kernel is decorated, so the compile runs in a
subprocess without TRITON_INTERPRET. Both kernels (encode, attention) go through the frontend (TTIR) at each shape
the CPU tests run, and at the 27B's D=256 G=128 to sm_86 (RTX 3090) and sm_90a (H200) cubin with Triton's bundled
ptxas: on sm_86 the shared memory Triton records (what it checks against the device at launch) must be at most
101,376 B and ptxas -v must report no spill stores. Each compile prints one JSON line (shared bytes, registers,
spills, the PTX's float64 instructions by opcode and per loop); docs/BENCHMARKS.md keeps the table.

    python tests/test_kvarn_triton_compile.py [OUT.jsonl]   # the subprocess: one line per compile, then "ok"
"""

from __future__ import annotations

import contextlib
import io
import json
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
    **dict.fromkeys(("q_ptr", "m_ptr", "den_ptr", "acc_ptr", "ek_ptr", "ev_ptr"), "*fp32"),
    "pool_ptr": "*u8",
    "pool16_ptr": "*fp16",
    **dict.fromkeys(("bt_ptr", "lens_ptr", "qs_ptr", "epos_ptr", "es_ptr"), "*i32"),
    "scale": "fp32",
    **dict.fromkeys(("max_blocks", "E", "nreq", "S", "TPS"), "i32"),
}


def compile_kernel(fn, constexprs: dict, options: dict, stop: str, arch: int = 86) -> tuple[str, dict]:
    """triton.compile's pipeline (frontend, then the backend's stages) for GPUTarget cuda sm_`arch`, up to `stop`
    ("ttir", "ptx", "cubin"); without the cache, so every call compiles. Arguments not in POINTERS are constexpr;
    pointers are 16-byte aligned, as Triton specializes the torch tensors the wrappers pass (the loads vectorize,
    which sets encode's layouts). Returns ptxas -v's report (when `stop` is "cubin") and the metadata: `shared` is
    the kernel's shared memory in bytes, as Triton checks it against the device at launch."""
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
            if ext == "ptx":
                metadata["fp64_ops"], metadata["fp64_loops"] = fp64_ops(module), fp64_loops(module)
            if ext == stop:
                break
        else:
            raise ValueError(f"no stage {stop!r} in {list(stages)}")
    row = {
        "kernel": fn.__name__,
        "D": constexprs.get("D"),
        "G": constexprs.get("G"),
        "arch": f"sm_{arch}",
        "stage": stop,
        "num_stages": options.get("num_stages"),
        "shared": metadata.get("shared"),
        "registers": registers(report.getvalue()) if stop == "cubin" else None,
        "spill_stores": spill_stores(report.getvalue()) if stop == "cubin" else None,
        "fp64_ops": metadata.get("fp64_ops"),
        "fp64_loops": metadata.get("fp64_loops"),
    }
    print(json.dumps(row), flush=True)
    return report.getvalue(), row


SM86_SHARED = 101_376  # an RTX 3090's shared memory per block (opt-in maximum), what Triton checks at launch


def fp64_ops(ptx: str) -> dict[str, int]:
    """Static count of the PTX's float64 instructions by opcode (add, mul, fma, div, sqrt, ...): what the
    balance costs where FP64 runs at 1/64 rate (sm_86)."""
    ops: dict[str, int] = {}
    for op in re.findall(r"^\s*(?:@%p\d+\s+)?([a-z]+)(?:\.[a-z]+)*\.f64\b", ptx, re.M):
        ops[op] = ops.get(op, 0) + 1
    return ops


F64 = re.compile(r"^\s*(?:@%p\d+\s+)?[a-z]+(?:\.[a-z0-9]+)*\.f64\b")


def fp64_loops(ptx: str) -> list[list[int]]:
    """[first line, last line, float64 instructions] of each PTX loop (a branch back to an earlier label), outer
    loops including their inner ones: with the trip counts (row chunks, balance iterations) they give the dynamic
    count per thread that docs/BENCHMARKS.md turns into an RTX 3090's FP64 time."""
    lines = ptx.splitlines()
    labels = {m[1]: i for i, x in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", x.strip()))}
    out = []
    for i, x in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", x)
        if m and labels.get(m[1], i) < i:
            out.append([labels[m[1]], i, sum(1 for y in lines[labels[m[1]] : i + 1] if F64.match(y))])
    return out


def spill_stores(report: str) -> int:
    """The spill stores ptxas -v reports for the one kernel of a cubin compile."""
    (n,) = re.findall(r"(\d+) bytes spill stores", report)
    return int(n)


def registers(report: str) -> int:
    (n,) = re.findall(r"Used (\d+) registers", report)
    return int(n)


def compile_all(out: Path | None = None) -> None:
    """Each kernel with the arguments its Python wrapper passes on CUDA (libdevice, tf32x3 dots, num_warps 8):
    at the 27B's D=256 G=128 to sm_86 (RTX 3090) and sm_90a (H200) cubin, at the other shapes the CPU tests run
    through the frontend only. sm_86: shared memory <= 101,376 B and no spill stores, asserted; one JSON line
    per compile (also written to `out`)."""
    sys.path.insert(0, str(REPO / "plugins" / "vllm"))
    from qconv_vllm import kvarn_attention as ka
    from qconv_vllm import kvarn_triton as kt

    assert kt.use_libdevice(), "run without TRITON_INTERPRET=1"
    rows = []
    for d, g, kb, vb in CASES:
        a = kt.field_args(d, g, kb, vb)
        big = (d, g) == (256, 128)
        archs = (86, 90) if big else (86,)
        for arch in archs:
            att = ka.launch_args(d, g, kb, vb, 4, 6, arch)
            enc = kt.encode_args(a)
            kernels = [
                (kt._encode_kernel, enc, {k: enc.pop(k) for k in ("num_warps", "enable_fp_fusion")}),
                (ka._attn_kernel, att, {k: att.pop(k) for k in ("num_warps", "num_stages")}),
            ]
            for fn, const, launch in kernels:
                report, row = compile_kernel(fn, const, launch, "cubin" if big else "ttir", arch)
                rows.append(row)
                if big and arch == 86:
                    assert row["spill_stores"] == 0, report
                    assert row["shared"] <= SM86_SHARED, row
    if out is not None:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("ok")


def test_kernels_compile_for_a_real_gpu():
    pytest.importorskip("triton", reason="triton is not installed in this environment (pip install triton==3.9.0)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset; 1 is that default
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.splitlines()[-1:] == ["ok"], (r.stdout + r.stderr)[-4000:]


if __name__ == "__main__":
    compile_all(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
