"""SLA history store: one SQL, two backends (embedded chDB, ClickHouse server via clickhouse-connect).

The SQL (tables, migrations, queries) lives in :mod:`consumers.sla_queries`; this module only
knows how to run a statement, insert ``JSONEachRow`` rows and read rows back as dicts.

chDB keeps its data under a directory and **one process owns that directory** (a second process
gets "Cannot lock file ..."); within one process only one chDB path can be open at a time. Run the
planner inside the sink (``infernex sla-sink --planner``) or use a ClickHouse server when several
processes need the history at once.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from streams.planner import PlannerConfig, SlaTargets

log = logging.getLogger(__name__)


class SlaConfig(BaseModel):
    """Settings section ``sla`` (env ``INFERNEX_SLA__...``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["chdb", "clickhouse"] = "chdb"
    chdb_path: Path = Path(".infernex/chdb")
    url: str | None = Field(default=None, description="ClickHouse HTTP URL, e.g. http://localhost:8123")
    user: str = "default"
    password: SecretStr | None = None
    database: str = Field(default="infernex", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    ttl_days: int = Field(default=30, ge=1, description="request records, diagnoses, hints, rollups")
    raw_metrics_ttl_days: int = Field(default=3, ge=1, description="raw engine metric samples")
    batch_rows: int = Field(default=5000, ge=1, le=10000, description="flush a table buffer at this many rows")
    flush_interval_s: float = Field(default=1.0, gt=0, description="... or when its oldest row is this old")
    ack_wait_s: float = Field(default=30.0, gt=0, description="redelivery delay of unacked messages")
    durable_prefix: str = Field(default="sla-sink", pattern=r"^[A-Za-z0-9_-]+$")
    consume: Literal["pull", "push"] = Field(
        default="push",
        description="push (default): a durable push consumer with a callback, about 2x the throughput "
                    "with nats-py (see bench/RESULTS.md); pull: bus.run_durable (fetch). Both ack only "
                    "after the insert and pass the same crash test")
    targets: SlaTargets = Field(default_factory=SlaTargets)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)

    @model_validator(mode="after")
    def _url_for_server(self):
        if self.backend == "clickhouse" and not self.url:
            raise ValueError("sla.backend=clickhouse needs sla.url (e.g. http://localhost:8123)")
        return self


class StoreError(RuntimeError):
    """A statement failed; the message carries the backend's error."""


class SlaStore(Protocol):
    database: str

    def command(self, sql: str, params: dict[str, Any] | None = None) -> None: ...

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]: ...

    def insert_json_each_row(self, table: str, rows: list[bytes]) -> None: ...

    def close(self) -> None: ...


def _parse_json(data: bytes) -> list[dict[str, Any]]:
    if not data or not data.strip():
        return []
    return json.loads(data)["data"]


_INSERT_SETTINGS = "input_format_skip_unknown_fields=1, date_time_input_format='best_effort'"


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class ChdbStore:
    """Embedded ClickHouse (chDB) with data on disk. Thread-safe through one lock."""

    def __init__(self, path: Path | str, database: str = "infernex"):
        from chdb import session  # imported here: settings load must not pull chDB in

        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.database = database
        self._lock = threading.Lock()
        self._structures: dict[str, tuple[str, str]] = {}
        try:
            self._session = session.Session(str(self.path))
        except Exception as exc:  # noqa: BLE001 - re-raised with the likely cause
            raise StoreError(
                f"cannot open chDB at {self.path}: {exc}. One process owns a chDB path (is `infernex "
                f"sla-sink` running on it?); query through that process or use a ClickHouse server."
            ) from None

    def _query(self, sql: str, fmt: str, params: dict[str, Any] | None):
        with self._lock:
            try:
                return self._session.query(sql, fmt, params=params or None)
            except Exception as exc:  # noqa: BLE001
                raise StoreError(f"chDB: {exc}") from None

    def command(self, sql: str, params: dict[str, Any] | None = None) -> None:
        self._query(sql, "CSV", params)
        # (a statement may change a table's columns: migrations run here, chDB has one owner a path)
        self._structures.clear()

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        res = self._query(sql, "JSON", params)
        return _parse_json(res.bytes())

    def insert_json_each_row(self, table: str, rows: list[bytes]) -> None:
        """Rows go through a file next to the data: chDB parses ``file()`` input several times
        faster than data inlined in the query text (10k records: ~60 ms vs ~300 ms)."""
        if not rows:
            return
        structure, names = self._structure(table)
        spool = self.path / "_spool"
        spool.mkdir(exist_ok=True)
        path = spool / f"{table}-{uuid.uuid4().hex}.jsonl"
        path.write_bytes(b"\n".join(rows))
        try:
            self._query(
                # the columns named: a column added since the structure was read takes its default
                f"INSERT INTO {self.database}.{table} ({names}) SETTINGS {_INSERT_SETTINGS} "
                f"SELECT * FROM file({_quote(str(path))}, 'JSONEachRow', {_quote(structure)})",
                "CSV",
                None,
            )
        finally:
            path.unlink(missing_ok=True)

    def _structure(self, table: str) -> tuple[str, str]:
        """(``name type, ...``, ``name, ...``) of the insertable columns, in table order (cached)."""
        if table not in self._structures:
            cols = self.rows(
                "SELECT name, type FROM system.columns WHERE database = {db:String} AND table = {t:String} "
                "AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') ORDER BY position",
                {"db": self.database, "t": table},
            )
            if not cols:
                raise StoreError(f"table {self.database}.{table} does not exist (run the migrations)")
            self._structures[table] = (", ".join(f"{c['name']} {c['type']}" for c in cols),
                                       ", ".join(c["name"] for c in cols))
        return self._structures[table]

    def close(self) -> None:
        with self._lock:
            try:
                self._session.close()
            except Exception:  # noqa: BLE001 - closing twice is harmless
                pass


class ClickHouseStore:
    """A ClickHouse server through clickhouse-connect (HTTP)."""

    def __init__(self, url: str, *, user: str = "default", password: SecretStr | None = None,
                 database: str = "infernex"):
        import clickhouse_connect

        self.database = database
        self._lock = threading.Lock()
        try:
            # connect to 'default' first: our database may not exist yet (migrations create it)
            self._client = clickhouse_connect.get_client(
                dsn=url, username=user, password=password.get_secret_value() if password else "",
                database="default",
            )
        except Exception as exc:  # noqa: BLE001
            raise StoreError(f"cannot reach ClickHouse at {url}: {exc}") from None

    def command(self, sql: str, params: dict[str, Any] | None = None) -> None:
        with self._lock:
            try:
                self._client.command(sql, parameters=params or None)
            except Exception as exc:  # noqa: BLE001
                raise StoreError(f"ClickHouse: {exc}") from None

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        with self._lock:
            try:
                data = self._client.raw_query(sql, parameters=params or None, fmt="JSON")
            except Exception as exc:  # noqa: BLE001
                raise StoreError(f"ClickHouse: {exc}") from None
        return _parse_json(data)

    def insert_json_each_row(self, table: str, rows: list[bytes]) -> None:
        if not rows:
            return
        with self._lock:
            try:
                self._client.raw_insert(
                    f"{self.database}.{table}", insert_block=b"\n".join(rows), fmt="JSONEachRow",
                    settings={"input_format_skip_unknown_fields": 1, "date_time_input_format": "best_effort"},
                )
            except Exception as exc:  # noqa: BLE001
                raise StoreError(f"ClickHouse: {exc}") from None

    def close(self) -> None:
        self._client.close()


def open_store(cfg: SlaConfig, *, migrate: bool = True) -> SlaStore:
    """The configured backend, with the schema brought up to date."""
    from consumers import sla_queries

    if cfg.backend == "chdb":
        store: SlaStore = ChdbStore(cfg.chdb_path, cfg.database)
    else:
        store = ClickHouseStore(cfg.url or "", user=cfg.user, password=cfg.password, database=cfg.database)
    if migrate:
        try:
            sla_queries.migrate(store, ttl_days=cfg.ttl_days, raw_metrics_ttl_days=cfg.raw_metrics_ttl_days)
        except Exception:
            store.close()
            raise
    return store
