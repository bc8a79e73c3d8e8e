"""Strategy files: which plugins exist, how profiles combine them. YAML validated by pydantic.

The format follows the Gateway API Inference Extension ``EndpointPickerConfig`` that InferNex's
``pluginsCustomConfig`` uses: a list of named ``plugins`` (``type`` + ``parameters``) and
``schedulingProfiles`` that reference them by ``pluginRef`` with an optional ``weight``::

    plugins:
      - {name: prefix, type: prefix-scorer, parameters: {mode: exact}}
      - {name: pick, type: max-score-picker}
    schedulingProfiles:
      - name: default
        plugins: [{pluginRef: prefix, weight: 3}, {pluginRef: pick}]

A strategy with a ``pd-profile-handler`` plugin needs the profiles ``prefill`` and ``decode``;
otherwise it has exactly one profile. Built-in strategies live in ``router/strategies/*.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.plugins import build_plugin
from router.plugins.base import Plugin

BUILTIN_DIR = Path(__file__).parent / "strategies"


class PluginSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    type: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)


class PluginRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    plugin_ref: str = Field(alias="pluginRef", min_length=1)
    weight: float = Field(default=1.0, ge=0)


class ProfileSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    plugins: list[PluginRef] = Field(min_length=1)


class StrategySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    api_version: str | None = Field(default=None, alias="apiVersion")
    kind: str | None = None
    description: str = ""
    plugins: list[PluginSpec] = Field(min_length=1)
    scheduling_profiles: list[ProfileSpec] = Field(alias="schedulingProfiles", min_length=1)

    @model_validator(mode="after")
    def _refs(self) -> "StrategySpec":
        names = [p.name or p.type for p in self.plugins]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"plugin names used twice: {sorted(dup)}")
        known = set(names)
        for prof in self.scheduling_profiles:
            for ref in prof.plugins:
                if ref.plugin_ref not in known:
                    raise ValueError(f"profile {prof.name!r} references unknown plugin {ref.plugin_ref!r}")
        return self


@dataclass(slots=True)
class Profile:
    name: str
    filters: list[Plugin]
    scorers: list[tuple[Plugin, float]]
    picker: Plugin
    weight_sum: float
    # totals = sum of weight / weight_sum * column over the scorers with a weight, in one pass
    combine: Callable[[list[list[float]]], list[float]] | None = None

    def __post_init__(self) -> None:
        ws = self.weight_sum
        self.combine = weighted_sum([w / ws if ws > 0 else 0.0 for _, w in self.scorers])


def weighted_sum(weights: list[float]) -> Callable[[list[list[float]]], list[float]]:
    """``f(columns) -> [sum_k weights[k] * columns[k][i] for each i]``, one comprehension for the
    usual numbers of scorers (a pass per scorer costs ~4 µs over 64 backends; one pass ~1 µs per
    column). Columns with weight 0 are skipped; ``f`` gets every column and picks its own."""
    keep = [k for k, w in enumerate(weights) if w]
    ws = [weights[k] for k in keep]
    n = len(keep)
    if n == 0:
        return lambda cols: [0.0] * len(cols[0]) if cols else []
    if n == 1:
        (k0,), (w0,) = keep, ws
        return lambda cols: [w0 * a for a in cols[k0]]
    if n == 2:
        (k0, k1), (w0, w1) = keep, ws
        return lambda cols: [w0 * a + w1 * b for a, b in zip(cols[k0], cols[k1])]
    if n == 3:
        (k0, k1, k2), (w0, w1, w2) = keep, ws
        return lambda cols: [w0 * a + w1 * b + w2 * c for a, b, c in zip(cols[k0], cols[k1], cols[k2])]
    if n == 4:
        (k0, k1, k2, k3), (w0, w1, w2, w3) = keep, ws
        return lambda cols: [w0 * a + w1 * b + w2 * c + w3 * d
                             for a, b, c, d in zip(cols[k0], cols[k1], cols[k2], cols[k3])]
    if n == 5:
        (k0, k1, k2, k3, k4), (w0, w1, w2, w3, w4) = keep, ws
        return lambda cols: [w0 * a + w1 * b + w2 * c + w3 * d + w4 * e
                             for a, b, c, d, e in zip(cols[k0], cols[k1], cols[k2], cols[k3], cols[k4])]
    if n == 6:
        (k0, k1, k2, k3, k4, k5), (w0, w1, w2, w3, w4, w5) = keep, ws
        return lambda cols: [w0 * a + w1 * b + w2 * c + w3 * d + w4 * e + w5 * f for a, b, c, d, e, f
                             in zip(cols[k0], cols[k1], cols[k2], cols[k3], cols[k4], cols[k5])]

    def many(cols: list[list[float]]) -> list[float]:
        return [sum(w * x for w, x in zip(ws, xs)) for xs in zip(*(cols[k] for k in keep))]

    return many


@dataclass(slots=True)
class Strategy:
    name: str
    handler: Plugin
    profiles: dict[str, Profile]
    needs_overlap: bool
    approximate: bool
    description: str = ""
    pd: bool = False  # a prefill/decode strategy (its handler is the PD one): set from the handler

    def __post_init__(self) -> None:
        # (a field, not a property: the request path reads it several times a request)
        self.pd = self.handler.type_name == "pd-profile-handler"


def build_strategy(name: str, spec: StrategySpec | dict) -> Strategy:
    """Instantiate plugins and check the profiles; ``ValueError`` names what is wrong."""
    if isinstance(spec, dict):
        try:
            spec = StrategySpec.model_validate(spec)
        except ValidationError as exc:
            msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"strategy {name!r}: {msgs}") from None
    plugins = {}
    for ps in spec.plugins:
        p = build_plugin(ps.type, ps.name, ps.parameters)
        plugins[p.name] = p
    handlers = [p for p in plugins.values() if p.kind == "handler"]
    if len(handlers) > 1:
        raise ValueError(f"strategy {name!r}: more than one profile handler")
    handler = handlers[0] if handlers else build_plugin("single-profile-handler")
    profiles = {}
    needs_overlap = False
    approximate = False
    for prof in spec.scheduling_profiles:
        filters, scorers, pickers = [], [], []
        for ref in prof.plugins:
            p = plugins[ref.plugin_ref]
            if p.kind == "filter":
                filters.append(p)
            elif p.kind == "scorer":
                scorers.append((p, ref.weight))
                needs_overlap |= p.needs_overlap
                approximate |= getattr(p.params, "mode", None) == "approximate"
            elif p.kind == "picker":
                pickers.append(p)
            else:
                raise ValueError(f"strategy {name!r}: profile {prof.name!r} cannot reference handler {p.name!r}")
        if len(pickers) != 1:
            raise ValueError(f"strategy {name!r}: profile {prof.name!r} needs exactly one picker, has {len(pickers)}")
        profiles[prof.name] = Profile(prof.name, filters, scorers, pickers[0], sum(w for _, w in scorers))
    if handler.type_name == "pd-profile-handler":
        missing = {"prefill", "decode"} - set(profiles)
        if missing:
            raise ValueError(f"strategy {name!r}: a PD strategy needs profiles {sorted(missing)}")
    elif len(profiles) != 1:
        raise ValueError(f"strategy {name!r}: an aggregated strategy has exactly one profile")
    return Strategy(name, handler, profiles, needs_overlap, approximate, spec.description)


def load_strategy_file(path: Path, name: str | None = None) -> Strategy:
    """Our strategy YAML or an llm-d ``EndpointPickerConfig`` (mapped by :mod:`router.llmd`)."""
    from router import llmd

    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"strategy file {path}: not valid YAML: {exc}") from None
    except OSError as exc:
        raise ValueError(f"strategy file {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ValueError(f"strategy file {path}: must hold a mapping")
    llmd.check_types(data, str(path), text)
    if llmd.is_llmd(data):
        data = llmd.translate(data, str(path), text)
    return build_strategy(name or Path(path).stem, data)


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def load_strategy(name_or_path: str) -> Strategy:
    """A built-in strategy by name (``kv-aware``) or a YAML file path."""
    p = BUILTIN_DIR / f"{name_or_path}.yaml"
    if p.is_file():
        return load_strategy_file(p, name_or_path)
    if Path(name_or_path).is_file():
        return load_strategy_file(Path(name_or_path))
    raise ValueError(f"unknown strategy {name_or_path!r}; built-in: {', '.join(builtin_names())}, or a YAML file")
