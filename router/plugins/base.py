"""Plugin base class, the decision context and the type-name -> factory registry."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(slots=True)
class Ctx:
    """What a plugin may read besides the candidates: computed once per decision."""

    request_blocks: int = 0
    block_size: int = 16
    overlap: dict[str, int] = field(default_factory=dict)  # pod -> prefix blocks cached there
    predicted: dict[str, int] = field(default_factory=dict)  # pod -> of those, blocks only predicted (approximate)
    rng: random.Random = field(default_factory=random.Random)
    now: float = 0.0
    stage: str = "aggregated"
    group: str | None = None  # decode stage: the group the prefill pod belongs to
    prompt_tokens: int = 0
    load_epoch: int | None = None  # see Router.decide: lets load-only scorer columns be reused
    backends: Any = ()  # every backend the decision started from (filters that reason about whole PD groups)
    admission: bool = False  # the router queues requests when backends are full (busy filters defer to it)


class Plugin:
    kind: ClassVar[str] = ""  # filter | scorer | picker | handler
    type_name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    needs_overlap: ClassVar[bool] = False
    # a scorer whose column depends only on the candidates' load/health fields and its parameters
    # (not on the request, the overlap or the router's own in-flight counters): cacheable per load epoch
    load_only: ClassVar[bool] = False

    def __init__(self, name: str, params: BaseModel):
        self.name = name
        self.params = params

    def events(self) -> dict[str, int]:
        """Counted occurrences this plugin reports (exported as ``infernex_router_plugin_events_total``)."""
        return {}


#: type name -> plugin class
REGISTRY: dict[str, type[Plugin]] = {}


def register(cls: type[Plugin]) -> type[Plugin]:
    if not cls.type_name or cls.kind not in ("filter", "scorer", "picker", "handler"):
        raise ValueError(f"plugin {cls.__name__} needs a type_name and a kind")
    if cls.type_name in REGISTRY:
        raise ValueError(f"plugin type {cls.type_name!r} registered twice")
    REGISTRY[cls.type_name] = cls
    return cls


def build_plugin(type_name: str, name: str | None = None, parameters: dict[str, Any] | None = None) -> Plugin:
    """Build a plugin from its type name and raw parameters; clear ``ValueError`` on bad input."""
    cls = REGISTRY.get(type_name)
    if cls is None:
        raise ValueError(f"unknown plugin type {type_name!r}; known: {', '.join(sorted(REGISTRY))}")
    try:
        params = cls.Params.model_validate(parameters or {})
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"plugin {name or type_name!r} ({type_name}): {msgs}") from None
    return cls(name or type_name, params)


def plugin_types() -> dict[str, str]:
    return {t: c.kind for t, c in sorted(REGISTRY.items())}

