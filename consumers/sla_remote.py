"""SLA queries through the running ``sla-sink`` (NATS request-reply on ``sla.query``).

chDB lets one process own its directory; while ``sla-sink`` runs, ``infernex sla report`` cannot
open it ("Cannot lock file"). The sink therefore answers read-only SQL on ``<prefix>.sla.query``
(:func:`serve_queries`), and :class:`RemoteStore` is an :class:`~consumers.sla_store.SlaStore`
that sends its ``rows()`` there, so every query in :mod:`consumers.sla_queries` runs unchanged.

Only one ``SELECT``/``WITH`` statement per request is answered; anything else is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from typing import Any

from schemas import subjects as S

log = logging.getLogger(__name__)

QUERY_SUBJECT = "sla.query"
_READ_ONLY = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)


class RemoteQueryError(RuntimeError):
    """No sink answered, or the sink refused or failed the query."""


def _allowed(sql: str) -> str | None:
    if not _READ_ONLY.match(sql):
        return "only SELECT/WITH statements are answered through the sink"
    if ";" in sql.rstrip().rstrip(";"):
        return "one statement per request"
    return None


async def serve_queries(nc, store, prefix: str | None = None):  # noqa: ANN001
    """Answer ``{"sql", "params"}`` requests with ``{"rows": [...]}`` or ``{"error": "..."}``
    (read-only; each query runs in a thread so consumption goes on). Returns the subscription."""

    async def handle(msg) -> None:  # noqa: ANN001
        try:
            req = json.loads(msg.data)
            sql, params = req["sql"], req.get("params") or None
            problem = _allowed(sql)
            if problem:
                body = {"error": problem}
            else:
                body = {"rows": await asyncio.to_thread(store.rows, sql, params), "database": store.database}
        except Exception as exc:  # noqa: BLE001 - the asker gets the reason
            body = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        data = json.dumps(body, default=str).encode()
        if len(data) > nc.max_payload:
            data = json.dumps({"error": f"result of {len(data)} bytes exceeds NATS max_payload "
                                        f"({nc.max_payload}); narrow the window"}).encode()
        await msg.respond(data)

    return await nc.subscribe(S.with_prefix(prefix, QUERY_SUBJECT), queue="sla-query", cb=handle)


class RemoteStore:
    """A read-only SLA store whose queries run in the ``sla-sink`` process, over NATS.

    Synchronous like the other stores: a private event loop in a thread holds the connection."""

    def __init__(self, nats_cfg, database: str, *, timeout_s: float = 30.0):  # noqa: ANN001
        from consumers import bus

        self.database = database
        self.timeout_s = timeout_s
        self._subject = S.with_prefix(nats_cfg.subject_prefix, QUERY_SUBJECT)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sla-remote", daemon=True)
        self._thread.start()
        try:
            self._nc = self._call(bus.connect(nats_cfg, name="infernex-sla-query"), timeout=nats_cfg.connect_timeout_s * 3)
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro, timeout: float):  # noqa: ANN001
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout + 1)

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

        payload = json.dumps({"sql": sql, "params": params or {}}, default=str).encode()
        try:
            msg = self._call(self._nc.request(self._subject, payload, timeout=self.timeout_s), self.timeout_s)
        except NoRespondersError:
            raise RemoteQueryError(f"no sla-sink answers on NATS subject {self._subject}") from None
        except (NatsTimeout, asyncio.TimeoutError, TimeoutError):
            raise RemoteQueryError(f"the sla-sink did not answer on {self._subject} within {self.timeout_s:g} s") from None
        body = json.loads(msg.data)
        if "error" in body:
            raise RemoteQueryError(f"sla-sink: {body['error']}")
        return body["rows"]

    def ping(self) -> None:
        self.rows("SELECT 1 AS ok")

    def command(self, sql: str, params: dict[str, Any] | None = None) -> None:
        raise RemoteQueryError("the sink answers queries only; stop it to migrate or rebuild the rollup")

    def insert_json_each_row(self, table: str, rows: list[bytes]) -> None:
        raise RemoteQueryError("the sink answers queries only")

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def close(self) -> None:
        try:
            self._call(self._nc.close(), timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._stop_loop()
