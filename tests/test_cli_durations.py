"""One duration parser for every ``--since`` (issue 21: ``tail`` refused ``1h30m``)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import typer

from infernex.commands import backbone, common, replay, sla


@pytest.mark.parametrize("text, seconds", [
    ("90", 90), ("90s", 90), ("15m", 900), ("1h", 3600), ("1h30m", 5400), ("2d", 172800), ("1w", 604800),
    ("500ms", 0.5), ("1H30M", 5400), (" 10m ", 600), ("1.5h", 5400),
])
def test_parse_duration(text, seconds):
    assert common.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "1x", "1h30", "m30", "1h 30m", "-5m", "1h30mfoo"])
def test_parse_duration_rejects(text):
    with pytest.raises(typer.BadParameter):
        common.parse_duration(text)


def test_since_is_a_duration_ago_or_an_iso_time():
    now = 1_800_000_000.0
    assert common.parse_since("1h30m", now=now).timestamp() == now - 5400
    assert common.parse_since("2026-01-31T12:00:00", now=now) == datetime(2026, 1, 31, 12, tzinfo=timezone.utc)
    with pytest.raises(typer.BadParameter, match="1h30m"):
        common.parse_since("yesterday", now=now)


def test_every_command_uses_the_one_parser():
    assert backbone.parse_since is common.parse_since
    assert sla.parse_duration is common.parse_duration
    assert not hasattr(backbone, "_DUR") and not hasattr(sla, "_UNITS")
    assert replay._time("1h30m") == pytest.approx(common.parse_since("1h30m").timestamp(), abs=2)
