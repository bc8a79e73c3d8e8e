"""Shared helpers of the format parsers."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families


class ParseError(ValueError):
    """The text is not in the expected format; the message says where."""


def prom_samples(text: str, wanted_prefix: tuple[str, ...], key_label: str) -> dict[str, dict[str, tuple[dict, float]]]:
    """Group Prometheus samples by the value of ``key_label``:
    ``{key: {family_name: (labels, value)}}``, families filtered by name prefix.

    Family names are used (not sample names), so counters declared without the
    ``_total`` suffix (as dcgm-exporter does) are found under their declared name.
    """
    out: dict[str, dict[str, tuple[dict, float]]] = defaultdict(dict)
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # noqa: BLE001 - the parser raises bare ValueErrors/TypeErrors
        raise ParseError(f"not Prometheus text exposition: {exc}") from None
    for fam in families:
        if not fam.name.startswith(wanted_prefix):
            continue
        for s in fam.samples:
            key = s.labels.get(key_label)
            if key is None:
                continue
            out[key][fam.name] = (s.labels, float(s.value))
    return dict(out)
