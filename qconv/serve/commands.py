"""CLI verb `qconv serve`: an OpenAI-compatible server on qconv's engine, or vLLM launched with the artifact's
profile. Thin layer over qconv.serve.native / qconv.serve.vllm."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from qconv.errors import QconvError


def _resolve(target: str) -> Path:
    """A folder as is; otherwise a cached artifact name through the hub (when that area is installed)."""
    try:
        from qconv.hub.cache import resolve_artifact
    except ImportError:
        p = Path(target).expanduser()
        if not p.is_dir():
            raise QconvError(f"no model folder {target!r}", fix="pass an artifact or model folder")
        return p.resolve()
    return resolve_artifact(target)


def _cuda_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    import torch

    return torch.cuda.is_available() or os.path.exists("/dev/nvidia0")


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("target", metavar="ARTIFACT_OR_NAME")
@click.option("--backend", type=click.Choice(["native", "vllm", "auto"]), default="auto", show_default=True,
              help="auto: vLLM when a CUDA GPU and vLLM are present, else qconv's engine.")
@click.option("--profile", default=None, help="Serving profile (fast | long | huge); default: the recipe's.")
@click.option("--recipe", default=None, help="Take profiles from this recipe (for a config folder without qconv.json).")
@click.option("--print-command", is_flag=True, help="Print the vLLM command line and exit (no weights needed).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (0.0.0.0 exposes the server).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key", default=None, envvar="QCONV_API_KEY",
              help="Require 'Authorization: Bearer KEY'. Prefer the QCONV_API_KEY environment variable: a key on "
                   "the command line is visible to every user in the process list.")
@click.option("--tensor-parallel-size", default=1, show_default=True, type=int, help="vLLM: GPUs to shard over.")
@click.option("--max-batch", default=None, type=int,
              help="Sequences decoded together (native, default 8; vLLM: --max-num-seqs, default the profile's).")
@click.option("--max-model-len", default=None, type=int, help="Native: cap the context (the cache is preallocated).")
@click.option("--vllm-python", default=None, envvar="QCONV_VLLM_PYTHON",
              help="Python interpreter with vLLM installed (default: this one), e.g. the scripts/setup_vllm_cpu.sh venv.")
@click.option("--vllm-feature", "vllm_features", multiple=True, metavar="TOKEN",
              help="Declare that your vLLM handles a feature the artifact's qconv.json requires (e.g. "
                   "quantized-embeddings for a patched vLLM); repeatable.")
@click.option("--spec-tokens", default=None, type=int,
              help="Native: prompt-lookup draft tokens per step (0: off; default: the artifact's speculative config).")
@click.option("--served-model-name", default=None, help="Model id clients send (default: the folder name).")
@click.option("--datastore", multiple=True, type=click.Path(), metavar="PATH",
              help="Native: greedy rows with no prompt-lookup match also draft from these text files / folders "
                   "(repeatable; indexed once, cached under QCONV_HOME).")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
def serve(target, backend, profile, recipe, print_command, host, port, api_key, tensor_parallel_size, max_batch,
          max_model_len, vllm_python, vllm_features, spec_tokens, served_model_name, datastore, vllm_args) -> None:
    """Serve ARTIFACT_OR_NAME over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models).

    Arguments after `--` go to vLLM unchanged (e.g. `-- --enforce-eager --dtype float32`)."""
    from qconv.serve import vllm

    if api_key and click.get_current_context().get_parameter_source("api_key") == ParameterSource.COMMANDLINE:
        click.echo("warning: --api-key on the command line is visible in the process list; set QCONV_API_KEY "
                   "instead", err=True)
    path = _resolve(target)
    python = vllm_python or sys.executable
    if print_command:
        backend = "vllm"
    if backend == "auto":
        backend = "vllm" if _cuda_gpu() and _has_vllm(python) and _fits_vllm(path, recipe, profile, vllm_features) \
            else "native"
    if backend == "native":
        if vllm_args:
            raise QconvError(f"extra arguments {' '.join(vllm_args)!r} are for vLLM", where="--backend native",
                             fix="drop them, or use --backend vllm")
        from qconv.serve.native import NativeOptions, run_native

        run_native(path, NativeOptions(host=host, port=port, api_key=api_key, max_batch=max_batch or 8,
                                       max_model_len=max_model_len, profile=profile, spec_tokens=spec_tokens,
                                       served_model_name=served_model_name, datastore=tuple(datastore)))
        return
    src = vllm.load_source(path, recipe)
    if served_model_name:
        src.name = served_model_name
    opts = vllm.LaunchOptions(host=host, port=port, tensor_parallel_size=tensor_parallel_size,
                              max_num_seqs=max_batch, python=python, extra_args=list(vllm_args))
    argv = vllm.build_command(src, profile, opts)
    if print_command:
        click.echo(shlex.join(argv))
        return
    info = vllm.probe_vllm(python)
    vllm.check_vllm(src, profile, info, vllm_features)
    vllm.check_quant_config(src, python, info.version)
    click.echo(f"starting: {shlex.join(argv)}", err=True)
    sys.exit(vllm.run_vllm(argv, host, port, api_key=api_key))


def _fits_vllm(path, recipe, profile, features) -> bool:
    """--backend auto: an artifact whose qconv.json requires what a stock vLLM lacks goes to the native engine."""
    from qconv.convert.requires import missing_for_vllm
    from qconv.serve import vllm

    src = vllm.load_source(path, recipe)
    missing = missing_for_vllm(src.requires, vllm.pick_profile(src, profile)[0], set(features))
    if missing:
        click.echo(f"auto: native backend ({missing[0].get('feature')} needs {missing[0].get('needs')})", err=True)
    return not missing


def _has_vllm(python: str) -> bool:
    import subprocess

    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


COMMANDS = [serve]
