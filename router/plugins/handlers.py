"""Profile handlers: which scheduling profiles run for a request."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from router.plugins.base import Plugin, register


class _P(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Handler(Plugin):
    kind = "handler"


@register
class SingleProfileHandler(Handler):
    """Aggregated serving: one profile picks one backend."""

    type_name = "single-profile-handler"


class PdParams(_P):
    threshold_tokens: int = Field(
        default=256, ge=0,
        description="disaggregate only if the decode pod lacks more than this many prompt tokens in its cache")
    same_group: bool = Field(default=True, description="decode pod from the prefill pod's PD group")


@register
class PdProfileHandler(Handler):
    """PD: the ``prefill`` profile picks a prefill pod, the ``decode`` profile a decode pod in its group.

    The decider skips remote prefill when the chosen decode pod already holds all but
    ``threshold_tokens`` of the prompt (the llm-d prefix-based decider).
    """

    type_name = "pd-profile-handler"
    Params = PdParams
