"""llm-d / GIE ``EndpointPickerConfig`` files, read as InferNex strategies.

Users bring the files they run llm-d's inference scheduler with (``kind: EndpointPickerConfig``,
``plugins`` + ``schedulingProfiles``). Their plugin types map onto ours:

=============================  =========================================================
llm-d / GIE type               InferNex plugin
=============================  =========================================================
prefix-cache-scorer            prefix-scorer, mode approximate (routing history + events)
precise-prefix-cache-scorer    prefix-scorer, mode exact (KV events)
kv-cache-utilization-scorer    kv-usage-scorer
queue-scorer                   queue-scorer
max-score-picker               max-score-picker (``maxNumOfEndpoints``: see epp_fallbacks)
random-picker                  random-picker
prefill-filter                 role-filter [prefill]
decode-filter                  role-filter [decode, aggregated] (llm-d: decode or "both")
pd-profile-handler             pd-profile-handler (``threshold`` -> threshold_tokens; the
                               ``prefillProfile``/``decodeProfile`` names are honoured)
single-profile-handler         single-profile-handler
prefill-header-handler         (none: the endpoint picker always names the prefill pod in
                               ``x-prefiller-host-port`` when it disaggregates)
=============================  =========================================================

Our own type names are accepted as they are. GIE's picker only sees ready pods serving the
pool's model; ours sees every backend, so each profile gets a ``model-filter`` and a
``healthy-filter`` in front unless it already has them. An unknown type is an error naming the
file and line. Pure: no I/O besides the text it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from router.plugins import REGISTRY

#: top-level keys of llm-d configs that do not concern the scheduling pipeline
_IGNORED_TOP = ("featureGates", "saturationDetector", "data", "flowControl")
_IGNORED_PARAMS = {"hashBlockSize", "maxPrefixBlocksToMatch", "lruCapacityPerServer", "autoTune",
                   "maxNumOfEndpoints", "primaryPort", "prefixPluginName", "prefixPluginType"}


def _role(*roles: str) -> Callable[[dict], tuple[str, dict]]:
    return lambda p: ("role-filter", {"roles": list(roles)})


def _pd(p: dict) -> tuple[str, dict]:
    out: dict[str, Any] = {"same_group": False}
    if "threshold" in p:
        out["threshold_tokens"] = int(p["threshold"])
    return "pd-profile-handler", out


#: llm-d type -> (our type, our parameters) built from its parameters; None: no plugin needed
LLMD_TYPES: dict[str, Callable[[dict], tuple[str, dict]] | None] = {
    "prefix-cache-scorer": lambda p: ("prefix-scorer", {"mode": "approximate"}),
    "precise-prefix-cache-scorer": lambda p: ("prefix-scorer", {"mode": "exact"}),
    "kv-cache-utilization-scorer": lambda p: ("kv-usage-scorer", {}),
    "prefill-filter": _role("prefill"),
    "decode-filter": _role("decode", "aggregated"),
    "pd-profile-handler": _pd,
    "prefill-header-handler": None,
    "max-score-picker": lambda p: ("max-score-picker", {}),
    "random-picker": lambda p: ("random-picker", {}),
    "queue-scorer": lambda p: ("queue-scorer", {}),
    "single-profile-handler": lambda p: ("single-profile-handler", {}),
}


class ConfigError(ValueError):
    pass


def _lines(text: str) -> dict[tuple, int]:
    """1-based line of each plugin entry and profile plugin reference: ("plugin", i) / ("ref", j, k)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[tuple, int] = {}
    if not isinstance(root, yaml.MappingNode):
        return out
    for k, v in root.value:
        if k.value == "plugins" and isinstance(v, yaml.SequenceNode):
            for i, item in enumerate(v.value):
                line = item.start_mark.line + 1
                if isinstance(item, yaml.MappingNode):
                    for ik, iv in item.value:
                        if ik.value == "type":
                            line = iv.start_mark.line + 1
                out[("plugin", i)] = line
        if k.value == "schedulingProfiles" and isinstance(v, yaml.SequenceNode):
            for j, prof in enumerate(v.value):
                if not isinstance(prof, yaml.MappingNode):
                    continue
                for pk, pv in prof.value:
                    if pk.value == "plugins" and isinstance(pv, yaml.SequenceNode):
                        for n, ref in enumerate(pv.value):
                            out[("ref", j, n)] = ref.start_mark.line + 1
    return out


def is_llmd(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    if data.get("kind") == "EndpointPickerConfig":
        return True
    plugins = data.get("plugins")
    return isinstance(plugins, list) and any(
        isinstance(p, dict) and p.get("type") in LLMD_TYPES and p.get("type") not in REGISTRY for p in plugins)


def translate(data: dict, source: str = "<config>", text: str | None = None) -> dict:
    """An llm-d ``EndpointPickerConfig`` mapping -> our strategy mapping (``profiles.StrategySpec``)."""
    lines = _lines(text) if text else {}

    def where(key: tuple) -> str:
        return f"{source}:{lines[key]}" if key in lines else source

    plugins = data.get("plugins")
    profiles = data.get("schedulingProfiles")
    if not isinstance(plugins, list) or not isinstance(profiles, list):
        raise ConfigError(f"{source}: an EndpointPickerConfig needs 'plugins' and 'schedulingProfiles' lists")
    out_plugins: list[dict] = []
    dropped: set[str] = set()
    renames: dict[str, str] = {}  # profile name -> prefill/decode
    names: dict[str, str] = {}  # plugin name -> our type
    for i, p in enumerate(plugins):
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise ConfigError(f"{where(('plugin', i))}: plugin {i} needs a 'type'")
        typ, name = p["type"], p.get("name") or p["type"]
        params = p.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{where(('plugin', i))}: plugin {name!r}: 'parameters' must be a mapping")
        if typ in LLMD_TYPES:
            conv = LLMD_TYPES[typ]
            if conv is None:
                dropped.add(name)
                continue
            ours, our_params = conv(params)
            if typ == "pd-profile-handler":
                for key, std in (("prefillProfile", "prefill"), ("decodeProfile", "decode")):
                    if isinstance(params.get(key), str) and params[key] != std:
                        renames[params[key]] = std
            extra = set(params) - _IGNORED_PARAMS - {"threshold", "prefillProfile", "decodeProfile", "mode"}
            if extra and ours not in ("prefix-scorer",):
                raise ConfigError(f"{where(('plugin', i))}: plugin {name!r} ({typ}): unsupported parameters "
                                  f"{sorted(extra)}")
        elif typ in REGISTRY:
            ours, our_params = typ, params
        else:
            known = sorted(set(LLMD_TYPES) | set(REGISTRY))
            raise ConfigError(f"{where(('plugin', i))}: unknown plugin type {typ!r} (plugin {name!r}); "
                              f"known: {', '.join(known)}")
        names[name] = ours
        out_plugins.append({"name": name, "type": ours, "parameters": our_params})
    implicit = {"model-filter": "model-filter", "healthy-filter": "healthy-filter"}
    for n, t in implicit.items():
        if t not in names.values():
            out_plugins.append({"name": n, "type": t})
    out_profiles = []
    for j, prof in enumerate(profiles):
        if not isinstance(prof, dict) or not isinstance(prof.get("name"), str):
            raise ConfigError(f"{source}: schedulingProfiles[{j}] needs a 'name'")
        refs = []
        for k, ref in enumerate(prof.get("plugins") or []):
            pr = ref.get("pluginRef") if isinstance(ref, dict) else None
            if not isinstance(pr, str):
                raise ConfigError(f"{where(('ref', j, k))}: profile {prof['name']!r}: entry {k} needs a 'pluginRef'")
            if pr in dropped:
                continue
            if pr not in names:
                raise ConfigError(f"{where(('ref', j, k))}: profile {prof['name']!r} references unknown plugin {pr!r}")
            r = {"pluginRef": pr}
            if "weight" in ref:
                r["weight"] = ref["weight"]
            refs.append(r)
        have = {names[r["pluginRef"]] for r in refs}
        front = [{"pluginRef": next(n for n, t in names.items() if t == typ) if typ in names.values() else n}
                 for n, typ in implicit.items() if typ not in have]
        out_profiles.append({"name": renames.get(prof["name"], prof["name"]), "plugins": front + refs})
    spec = {"plugins": out_plugins, "schedulingProfiles": out_profiles}
    if isinstance(data.get("description"), str):
        spec["description"] = data["description"]
    else:
        spec["description"] = f"llm-d EndpointPickerConfig from {source}"
    unknown_top = set(data) - {"apiVersion", "kind", "plugins", "schedulingProfiles", "description", *_IGNORED_TOP}
    if unknown_top:
        raise ConfigError(f"{source}: unknown top-level keys {sorted(unknown_top)}")
    return spec


def check_types(data: Any, source: str, text: str | None = None) -> None:
    """Every plugin type is known (ours or llm-d's), else a ``ConfigError`` naming file and line."""
    plugins = data.get("plugins") if isinstance(data, dict) else None
    if not isinstance(plugins, list):
        return
    lines = _lines(text) if text else {}
    for i, p in enumerate(plugins):
        typ = p.get("type") if isinstance(p, dict) else None
        if isinstance(typ, str) and typ not in REGISTRY and typ not in LLMD_TYPES:
            at = f"{source}:{lines[('plugin', i)]}" if ("plugin", i) in lines else source
            known = sorted(set(LLMD_TYPES) | set(REGISTRY))
            raise ConfigError(f"{at}: unknown plugin type {typ!r} (plugin {p.get('name') or typ!r}); "
                              f"known: {', '.join(known)}")
