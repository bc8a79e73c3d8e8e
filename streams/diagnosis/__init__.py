"""Diagnosis rules and engine (pure): :mod:`.rules` loads and validates the YAML rules and the
error-code catalog (``streams/data/``); :mod:`.engine` turns telemetry into deduplicated findings.

May import: the standard library, pydantic, pyyaml, xxhash, :mod:`schemas` and :mod:`streams`.
No broker, HTTP or socket library; no ``await``.
"""

from streams.diagnosis.engine import DiagnosisEngine, Signal, finding_id, msg_id
from streams.diagnosis.rules import RuleSet, RulesError, build_ruleset, load_ruleset

__all__ = ["DiagnosisEngine", "RuleSet", "RulesError", "Signal", "build_ruleset", "finding_id", "load_ruleset",
           "msg_id"]
