"""Peak RSS of a RAM-bounded (`--stream`) 3090 build of a random >= 2B-parameter qwen3_5_text model.

Writes the model as bf16 safetensors shards one tensor at a time (never the whole model in memory), builds it in
a child process (`qconv build --recipe 3090 --stream`), and reports the child's peak RSS against the model's bf16
size. Prints one JSON line. While the child runs, its VmRSS/VmHWM are sampled every second and written with the
child's latest log line to `--work`/rss_trace.tsv, so a peak can be traced to the build step that made it.

    OMP_NUM_THREADS=1 .venv/bin/python bench/build_memory.py --work /tmp/qconv-mem
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from qconv_cmd import streamed_build

REPO = Path(__file__).resolve().parents[1]


def model_config(layers: int, vocab: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=0,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Qwen3_5ForCausalLM"],
    )


def write_model(
    out: Path, layers: int, vocab: int, shard_bytes: int = 1 << 29, seed: int = 0, cfg=None
) -> tuple[int, int]:
    """A seeded random model (`cfg`, default model_config(layers, vocab)), one tensor at a time, in shards of
    ~shard_bytes. Returns (parameters, bytes)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    sys.path.insert(0, str(REPO))
    from tests.tiny import make_tokenizer

    cfg = cfg or model_config(layers, vocab)
    with torch.device("meta"):
        meta = Qwen3_5ForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shard, size, n_shard, weight_map, total, params = {}, 0, 0, {}, 0, 0
    names = [(n, p.shape) for n, p in meta.named_parameters()]

    def flush():
        nonlocal shard, size, n_shard
        if shard:
            name = f"model-{n_shard:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, n_shard = {}, 0, n_shard + 1

    for name, shape in names:
        if len(shape) == 2:
            t = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        elif name.endswith("A_log"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = (torch.ones(shape) if "norm" in name else torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        shard[name] = t.contiguous()
        size += t.numel() * 2
        total += t.numel() * 2
        params += t.numel()
        if size >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    cfg.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return params, total


def _status(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes; zeros once the process is gone."""
    vals = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    vals[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


def run_traced(cmd: list[str], trace: Path) -> tuple[int, str, str]:
    """Run the build; every second write (seconds, RSS, peak RSS, latest log line) to `trace`. Returns the exit
    code, the output's tail, and the log line that was latest when the peak grew for the last time."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state = {"line": "", "tail": []}

    def read():
        for line in proc.stdout:
            line = line.strip().rsplit("\r", 1)[-1]
            if line:
                state["line"] = line[-160:]
                state["tail"] = (state["tail"] + [line])[-60:]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0, hwm, peak_step = time.time(), 0, ""
    with open(trace, "w") as f:
        f.write("seconds\trss_bytes\thwm_bytes\tlog\n")
        while proc.poll() is None:
            rss, new_hwm = _status(proc.pid)
            if new_hwm > hwm:
                hwm, peak_step = new_hwm, state["line"]
            f.write(f"{time.time() - t0:.0f}\t{rss}\t{new_hwm}\t{state['line']}\n")
            f.flush()
            time.sleep(1)
    reader.join(timeout=10)
    return proc.returncode, "\n".join(state["tail"]), peak_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconv-build-memory"))
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    src, out = args.work / "model", args.work / "artifact"
    index = src / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text())["metadata"]["total_size"]
        params = total // 2
    else:
        params, total = write_model(src, args.layers, args.vocab)
    cal = args.work / "cal.txt"
    sys.path.insert(0, str(REPO))
    from tests.tiny import CORPUS

    cal.write_text(CORPUS * 50)
    cmd = streamed_build(src, out, cal, args.samples, args.seq_len, args.work / "work")
    t0 = time.time()
    rc, tail, peak_step = run_traced(cmd, args.work / "rss_trace.tsv")
    elapsed = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if rc:
        sys.stderr.write(tail)
        raise SystemExit(rc)
    from safetensors import safe_open

    art_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        packed = any(k.endswith("weight_packed") for k in f.keys())
    print(
        json.dumps(
            {
                "bench": "build_memory",
                "params": params,
                "bf16_bytes": total,
                "peak_rss_bytes": peak,
                "rss_over_bf16": round(peak / total, 3),
                "pass": peak < 0.75 * total,
                "artifact_bytes": art_bytes,
                "int4_packed": packed,
                "elapsed_s": round(elapsed, 1),
                "samples": args.samples,
                "seq_len": args.seq_len,
                "peak_during": peak_step,
            }
        )
    )


if __name__ == "__main__":
    main()
