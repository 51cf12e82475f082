"""Where the build's work runs: the device named on the command line (`--device auto|cuda|cpu`), carried down to
the call that onloads each decoder layer. One code path for both devices: the CPU suite runs it."""

from __future__ import annotations

import contextlib
import logging

from qconv.convert.stream import GPTQ_BLOCK_BYTES
from qconv.errors import QconvError
from qconv.memory import available_ram

log = logging.getLogger(__name__)

CHOICES = ("auto", "cpu", "cuda")
# On a GPU the row block is this share of the device memory free when quantization starts: GPTQ's work on a block
# is about 4 float32 copies of it (the rows, their quantized values, the error product, the result's cast), so a
# 16th keeps it to a quarter of the card beside the layer's weights and Hessians (see qconv.build.memplan).
GPU_BLOCK_SHARE = 16


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(name: str | None) -> str:
    """`auto` (or None): cuda when torch sees a GPU, else cpu. `cuda` without one is refused (exit 2) before
    anything is read or written."""
    name = (name or "auto").lower()
    if name not in CHOICES:
        raise QconvError(f"unknown device {name!r}", where="--device", fix=f"use one of {', '.join(CHOICES)}")
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name == "cuda" and not cuda_available():
        import torch

        raise QconvError(
            f"--device cuda but torch {torch.__version__} sees no CUDA device",
            where="--device",
            fix="pass --device cpu (or auto), or run on a machine with an NVIDIA GPU and a CUDA build "
            "of torch; `--dry-run --device cuda` plans for a card without one",
        )
    return name


def free_bytes(device: str) -> int:
    """Bytes free now on the device: CUDA's own count, or the OS's MemAvailable for the CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    return available_ram()


def gptq_block_bytes(device: str, free: int | None = None) -> int:
    """Row-block size of GPTQ and of the MSE observer: fixed on the CPU (host memory is what a streamed build
    bounds), a share of the free memory on a GPU (fewer, larger blocks; the same weights either way, since rows
    are independent)."""
    if device == "cpu":
        return GPTQ_BLOCK_BYTES
    free = free_bytes(device) if free is None else free
    return max(GPTQ_BLOCK_BYTES, free // GPU_BLOCK_SHARE)


@contextlib.contextmanager
def onload_device(device: str):
    """Make llmcompressor onload each layer to `device`.

    llmcompressor 0.14's sequential and data-free pipelines take their onload device from get_main_device() (the
    first accelerator, else the CPU) and hand it to compressed-tensors' set_onload_device; oneshot has no argument
    for it. Here those two pipelines' reference (convert/patches.py) is pointed at the device the build was given,
    so `--device cpu` stays on the CPU beside a GPU and `--device cuda` is deliberate. Calibration activations
    between layers stay where llmcompressor offloads them (`sequential_offload_device`, the CPU; on disk in a
    streamed build)."""
    import torch

    from qconv.convert import patches

    target = torch.device(device)

    def main_device() -> torch.device:
        return target

    with patches.swap(sequential_main_device=main_device, data_free_main_device=main_device):
        log.info("build device: %s", device)
        yield target


def reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int:
    """Peak memory since the last reset_peak: torch's allocator count on a GPU, the process's resident set on the
    CPU (its high-water mark, which cannot be reset)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_reserved(device: str) -> int | None:
    """Peak memory torch's caching allocator held from the driver since the last reset_peak (what the card must
    have: allocated plus the allocator's free blocks); None off CUDA."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_reserved()
    return None


def key_part(device: str) -> tuple:
    """What a stage key adds for the device: nothing on the CPU (its cached stages and artifacts stay what they
    were), the device otherwise (GPU float arithmetic gives other roundings)."""
    return () if device == "cpu" else (device,)


@contextlib.contextmanager
def on_device(device: str, names: dict | None = None):
    """Quantization on `device`: each layer onloaded there, GPTQ and the MSE observer in row blocks sized for it
    (`names`: module -> its name, for the progress bar's note)."""
    from qconv.convert.stream import row_blocked_gptq, row_blocked_observer

    block = gptq_block_bytes(device)
    with onload_device(device), row_blocked_gptq(block, names), row_blocked_observer(block):
        log.info("GPTQ row blocks of %.0f MB on %s", block / 2**20, device)
        yield


class LayerClock:
    """Per-layer wall time, ETA and peak device memory of a layer-by-layer job, logged (build.log) and shown on
    the live bar as each decoder layer starts: a 40-minute GPU build and a 19-hour CPU build say which one they
    are from the first layer. Forward pre-hooks on the decoder layers (and the lm_head, which ends the last)."""

    def __init__(self, model, device: str):
        import re

        self.device, self.times, self.current, self.t0 = device, [], None, 0.0
        found = [
            (int(m.group(2)), mod)
            for name, mod in model.named_modules()
            if (m := re.search(r"(^|\.)layers\.(\d+)$", name)) and not name.startswith("mtp") and "visual" not in name
        ]
        self.n = len(found)
        self.handles = [mod.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, mod in found]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            self.handles.append(head.register_forward_pre_hook(self._hook(self.n), with_kwargs=True))

    def _hook(self, i: int):
        def pre(module, args, kwargs):
            import torch

            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if type(x) is torch.Tensor and i != self.current:  # a real forward, not a tracing proxy
                self.tick(i)

        return pre

    def tick(self, i: int | None) -> None:
        import time

        from qconv import progress

        now = time.time()
        where = f"{self.device} peak {'allocated' if self.device == 'cuda' else 'RSS'}"
        peak = peak_bytes(self.device) / 2**30
        reserved = peak_reserved(self.device)
        if reserved is not None:  # the allocator's high-water mark: what a smaller card would have to hold
            where = f"{self.device} peak reserved {reserved / 2**30:.2f} GiB, {where}"
        if self.current is not None and self.current < self.n:
            self.times.append(now - self.t0)
            mean, left = sum(self.times) / len(self.times), self.n - len(self.times)
            log.info(
                "layer %d/%d: %.1f s (mean %.1f s); eta %s for %d more; %s %.2f GiB",
                self.current + 1,
                self.n,
                self.times[-1],
                mean,
                _duration(left * mean),
                left,
                where,
                peak,
                extra=progress.note(),
            )
        elif self.current == self.n:
            log.info("lm_head: %.1f s; %s %.2f GiB", now - self.t0, where, peak, extra=progress.note())
        reset_peak(self.device)
        self.current, self.t0 = i, now

    def close(self) -> None:
        self.tick(None)
        for h in self.handles:
            h.remove()


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"
