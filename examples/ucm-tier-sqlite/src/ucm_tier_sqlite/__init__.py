"""A third-party UCM tier that keeps shards in one SQLite database file.

It is a complete example of a tier plugin: a pydantic config model, a ``ucm.Tier`` subclass, a
``register_tiers`` hook implementation, and (in ``pyproject.toml``) the ``ucm.backends`` entry
point that makes UCM find it. Use it in a stack as::

    - type: sqlite
      path: /var/cache/ucm/kv.sqlite3
      capacity: 64GiB

Concurrency: every thread gets its own connection (opened again after a fork), the database runs
in WAL mode so readers never block the writer, and every write is one ``BEGIN IMMEDIATE``
transaction, so several threads and processes can share one file. A reader sees a shard either
whole or not at all (SQLite transactions), which is why the pin table only has to protect keys
from ``batched_remove`` within this process.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import Field

import ucm
from ucm.config import Size
from ucm.errors import ConfigError, InvalidArgumentError, KeyMissingError, TierError
from ucm.layout import BLOCK_ID_BYTES, Key
from ucm.tier import REMOVE_CHUNK_KEYS, Outcome, ShardViews, TierContext, chunks, scatter

__all__ = ["SqliteTier", "SqliteTierConfig", "register_tiers"]

__version__ = "0.1.0"

# Keys per query: 2 parameters each, far below SQLite's parameter limit, and few enough that
# one query's rows (shard data) do not pile up in memory.
_QUERY_CHUNK_KEYS = 64

_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS shards (
        block_id BLOB NOT NULL CHECK (length(block_id) = 16),
        shard INTEGER NOT NULL CHECK (shard >= 0),
        data BLOB NOT NULL,
        nbytes INTEGER NOT NULL,
        touched REAL NOT NULL,
        PRIMARY KEY (block_id, shard)
    );
    """,
    """
    CREATE INDEX IF NOT EXISTS shards_by_touched ON shards (touched);
    """,
    # Running totals kept by triggers, so capacity checks never scan the table.
    """
    CREATE TABLE IF NOT EXISTS usage (
        id INTEGER PRIMARY KEY CHECK (id = 0),
        shards INTEGER NOT NULL,
        bytes INTEGER NOT NULL
    );
    """,
    """
    INSERT OR IGNORE INTO usage (id, shards, bytes) VALUES (0, 0, 0);
    """,
    """
    CREATE TRIGGER IF NOT EXISTS shards_insert AFTER INSERT ON shards BEGIN
        UPDATE usage SET shards = shards + 1, bytes = bytes + NEW.nbytes WHERE id = 0;
    END;
    """,
    """
    CREATE TRIGGER IF NOT EXISTS shards_delete AFTER DELETE ON shards BEGIN
        UPDATE usage SET shards = shards - 1, bytes = bytes - OLD.nbytes WHERE id = 0;
    END;
    """,
    """
    CREATE TRIGGER IF NOT EXISTS shards_update AFTER UPDATE OF nbytes ON shards BEGIN
        UPDATE usage SET bytes = bytes - OLD.nbytes + NEW.nbytes WHERE id = 0;
    END;
    """,
    # Control records (a stack's reset epochs): no shards, so outside usage, capacity,
    # eviction and removal. The value is 8 bytes big-endian, so SQLite's max() of two blobs
    # (a byte comparison) is the larger number, and a u64 fits (an INTEGER is signed).
    """
    CREATE TABLE IF NOT EXISTS control (
        name BLOB PRIMARY KEY CHECK (length(name) = 16),
        value BLOB NOT NULL CHECK (length(value) = 8)
    );
    """,
)

# An upsert (not INSERT OR REPLACE): REPLACE deletes the old row without firing the delete
# trigger, which would corrupt the usage totals.
_UPSERT = (
    "INSERT INTO shards (block_id, shard, data, nbytes, touched) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (block_id, shard) DO UPDATE SET data = excluded.data, "
    "nbytes = excluded.nbytes, touched = excluded.touched"
)


class SqliteTierConfig(ucm.LowerTierConfig):
    """``type: sqlite``: shards as rows of a SQLite database file."""

    type: Literal["sqlite"] = "sqlite"
    path: Path = Field(
        description=(
            "Database file, created (with its directory) if missing. Every process and node "
            "that names the same file shares its shards."
        )
    )
    capacity: Size | None = Field(
        default=None,
        description=(
            "Most shard bytes kept; beyond it the least recently touched shards that are not "
            "in use are evicted. Omitted: unbounded."
        ),
    )
    timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds to wait for another writer (thread or process) before failing.",
    )


class SqliteTier(ucm.Tier):
    """Shards in a SQLite table keyed by (block_id, shard), with a last-touch timestamp."""

    type_name = "sqlite"
    config_model = SqliteTierConfig

    def __init__(self, config: ucm.TierConfig, context: TierContext) -> None:
        if not isinstance(config, SqliteTierConfig):
            raise TypeError(f"SqliteTier needs a SqliteTierConfig, got {type(config).__name__}")
        super().__init__(config, context)
        self.sqlite_config = config
        self.shard_size = context.layout.shard_size
        where = f"tiers[{context.position}]"
        if config.capacity is not None and config.capacity < self.shard_size:
            raise ConfigError(
                f"{where}.capacity: {config.capacity} bytes cannot hold one shard "
                f"({self.shard_size} bytes); give at least {self.shard_size}"
            )
        self.path = config.path.expanduser().resolve()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{where}.path: cannot create the directory of {str(self.path)!r}: {exc.strerror}"
            ) from None
        self._local = threading.local()
        # Serialises this process's writers before they queue on SQLite's file lock, whose
        # busy handler sleeps and retries instead of handing over promptly.
        self._write_lock = threading.Lock()
        self._connections: list[tuple[int, sqlite3.Connection]] = []
        self._connections_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._counters: dict[str, int] = {
            "hits": 0,
            "misses": 0,
            "failures": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "shards_written": 0,
            "rejected_full": 0,
            "evictions": 0,
            "removed": 0,
            "lock_acquisitions": 0,
            "remove_lock_acquisitions": 0,
        }
        self._closed = False
        try:
            self._create_schema()
        except sqlite3.Error as exc:
            raise ConfigError(
                f"{where}.path: cannot open SQLite database {str(self.path)!r}: {exc}"
            ) from None

    # -- connections and transactions ---------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._closed:
            raise TierError(f"sqlite tier {self.label!r} is closed")
        pid = os.getpid()
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        # A connection must never cross a fork: the child opens its own.
        if conn is not None and getattr(self._local, "pid", None) == pid:
            return conn
        conn = sqlite3.connect(
            self.path,
            timeout=self.sqlite_config.timeout,
            isolation_level=None,  # autocommit; writes use explicit BEGIN IMMEDIATE
            check_same_thread=False,  # only so that close() may close it from another thread
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self.sqlite_config.timeout * 1000)}")
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: survives a process crash
        self._local.conn = conn
        self._local.pid = pid
        with self._connections_lock:
            self._connections.append((pid, conn))
        return conn

    def _create_schema(self) -> None:
        conn = self._connect()
        # Switching to WAL needs a moment of exclusive access; racing creators just retry
        # (bounded by the busy timeout inside each attempt and by the attempt count).
        for attempt in range(20):
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError:
                if attempt == 19:
                    raise
                time.sleep(0.05)
        with self._write() as conn:
            for statement in _SCHEMA:
                conn.execute(statement)

    @contextmanager
    def _write(self, counter: str = "") -> Iterator[sqlite3.Connection]:
        """One write transaction = one acquisition of the tier's lock, counted in stats as
        ``lock_acquisitions`` and, when given, ``counter``."""
        conn = self._connect()
        if not self._write_lock.acquire(timeout=self.sqlite_config.timeout):
            raise TierError(
                f"sqlite tier {self.label!r}: another thread held the write lock for more "
                f"than {self.sqlite_config.timeout} s"
            )
        try:
            conn.execute("BEGIN IMMEDIATE")  # the database write lock, waits up to timeout
            self._count(lock_acquisitions=1, **({counter: 1} if counter else {}))
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            self._write_lock.release()

    def _count(self, **deltas: int) -> None:
        with self._counters_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _error(self, operation: str, exc: BaseException) -> TierError:
        return TierError(f"sqlite tier {self.label!r} ({self.path}): {operation} failed: {exc}")

    # -- argument checks ----------------------------------------------------------------------

    def _check_batch(self, keys: Sequence[Key], views: Sequence[ShardViews], what: str) -> None:
        if len(keys) != len(views):
            raise InvalidArgumentError(
                f"{what}: got {len(views)} entries for {len(keys)} keys; give one per key"
            )

    def _key_problem(self, key: Key) -> InvalidArgumentError | None:
        block_id, shard = key
        if not isinstance(block_id, bytes) or len(block_id) != BLOCK_ID_BYTES:
            return InvalidArgumentError(f"block id {block_id!r} must be {BLOCK_ID_BYTES} bytes")
        if not (isinstance(shard, int) and 0 <= shard < self.layout.shards_per_block):
            return InvalidArgumentError(
                f"shard index {shard!r} out of range 0..{self.layout.shards_per_block - 1}"
            )
        return None

    def _views_problem(self, views: ShardViews, writable: bool) -> InvalidArgumentError | None:
        total = 0
        for view in views:
            if writable and view.readonly:
                return InvalidArgumentError("destination view is read-only")
            total += view.nbytes
        if total != self.shard_size:
            return InvalidArgumentError(
                f"views hold {total} bytes; a shard is {self.shard_size} bytes"
            )
        return None

    # -- queries ------------------------------------------------------------------------------

    @staticmethod
    def _select(conn: sqlite3.Connection, columns: str, keys: Sequence[Key]) -> sqlite3.Cursor:
        """``columns`` of the rows of ``keys`` (at most _QUERY_CHUNK_KEYS). The keys join the
        table from a VALUES list, so SQLite seeks the primary key once per key; the shorter
        ``(block_id, shard) IN (VALUES ...)`` makes it scan the whole index instead."""
        values = ",".join(["(?,?)"] * len(keys))
        params = [part for key in keys for part in key]
        return conn.execute(
            f"WITH wanted(b, s) AS (VALUES {values}) SELECT {columns} FROM wanted "
            "CROSS JOIN shards ON shards.block_id = wanted.b AND shards.shard = wanted.s",
            params,
        )

    def list_keys(self) -> list[Key]:
        """Every key held (purge and per-namespace usage enumerate these; a key's namespace is
        part of its block id, so one table holds every namespace, kept apart)."""
        try:
            rows = self._connect().execute("SELECT block_id, shard FROM shards").fetchall()
        except sqlite3.Error as exc:
            raise self._error("list_keys", exc) from exc
        return [(bytes(block_id), shard) for block_id, shard in rows]

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        distinct = list(dict.fromkeys(keys))
        found: set[Key] = set()
        try:
            conn = self._connect()
            for part in chunks(distinct, _QUERY_CHUNK_KEYS):
                for block_id, shard in self._select(conn, "block_id, shard", part):
                    found.add((bytes(block_id), shard))
        except sqlite3.Error as exc:
            raise self._error("lookup", exc) from exc
        return [key in found for key in keys]

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        self._check_batch(keys, destinations, "destinations")
        outcomes: list[Outcome] = [None] * len(keys)
        wanted: dict[Key, list[int]] = {}
        for i, (key, views) in enumerate(zip(keys, destinations, strict=True)):
            problem = self._key_problem(key) or self._views_problem(views, writable=True)
            if problem is not None:
                outcomes[i] = problem
            else:
                wanted.setdefault(key, []).append(i)
        hits: list[Key] = []
        with self.pins.pinned(list(wanted)):
            try:
                conn = self._connect()
                for part in chunks(list(wanted), _QUERY_CHUNK_KEYS):
                    rows = self._select(conn, "block_id, shard, data", part)
                    for block_id, shard, data in rows:
                        key = (bytes(block_id), shard)
                        if len(data) != self.shard_size:
                            for i in wanted.pop(key):
                                outcomes[i] = TierError(
                                    f"sqlite tier {self.label!r}: block {key[0].hex()} shard "
                                    f"{shard} holds {len(data)} bytes, expected "
                                    f"{self.shard_size} (written with another shard_size?)"
                                )
                            continue
                        for i in wanted.pop(key):
                            scatter(data, destinations[i])
                        hits.append(key)
            except (sqlite3.Error, TierError) as exc:  # TierError: closed, or lock timeout
                error = exc if isinstance(exc, TierError) else self._error("load", exc)
                for indices in wanted.values():
                    for i in indices:
                        outcomes[i] = error
                wanted.clear()
        for key, indices in wanted.items():  # what the database did not return is a miss
            for i in indices:
                outcomes[i] = KeyMissingError(
                    f"block {key[0].hex()} shard {key[1]} is not in sqlite tier {self.label!r}"
                )
        self._count(
            hits=len(hits),
            misses=sum(isinstance(o, KeyMissingError) for o in outcomes),
            failures=sum(o is not None and not isinstance(o, KeyMissingError) for o in outcomes),
            bytes_read=len(hits) * self.shard_size,
        )
        if hits:
            self._touch_keys(hits)
        return outcomes

    def _touch_keys(self, keys: Sequence[Key]) -> None:
        # A hit is a use: refresh the timestamp that eviction orders by. Best effort: a busy
        # database must not turn a successful load into a failure.
        try:
            with self._write() as conn:
                now = time.time()
                conn.executemany(
                    "UPDATE shards SET touched = ? WHERE block_id = ? AND shard = ?",
                    [(now, block_id, shard) for block_id, shard in keys],
                )
        except (sqlite3.Error, TierError):
            pass

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        self._check_batch(keys, sources, "sources")
        outcomes: list[Outcome] = [None] * len(keys)
        last: dict[Key, int] = {}  # a key given twice: the last source wins
        for i, (key, views) in enumerate(zip(keys, sources, strict=True)):
            problem = self._key_problem(key) or self._views_problem(views, writable=False)
            if problem is not None:
                outcomes[i] = problem
            else:
                last[key] = i
        if not last:
            return outcomes
        try:
            with self._write() as conn:
                admitted = list(last)
                if self.sqlite_config.capacity is not None:
                    admitted, full = self._make_room(conn, admitted)
                    for key in full:
                        outcomes[last[key]] = TierError(
                            f"sqlite tier {self.label!r} is full: capacity "
                            f"{self.sqlite_config.capacity} bytes, every other shard is in use "
                            "or could not be written back below"
                        )
                now = time.time()
                conn.executemany(_UPSERT, self._rows(admitted, last, sources, now))
        except (sqlite3.Error, TierError) as exc:  # TierError: closed, or lock timeout
            error = exc if isinstance(exc, TierError) else self._error("dump", exc)
            for i in last.values():
                outcomes[i] = error
        else:
            self._count(
                shards_written=len(admitted),
                bytes_written=len(admitted) * self.shard_size,
                rejected_full=len(last) - len(admitted),
            )
        # Duplicates of a key share the outcome of its last occurrence.
        for i, key in enumerate(keys):
            if key in last and i != last[key]:
                outcomes[i] = outcomes[last[key]]
        return outcomes

    def _rows(
        self, keys: Iterable[Key], last: dict[Key, int], sources: Sequence[ShardViews], now: float
    ) -> Iterator[tuple[bytes, int, bytes, int, float]]:
        # A generator, so only one gathered shard is in memory at a time.
        for key in keys:
            data = b"".join(sources[last[key]])  # gather the caller's views into one blob
            yield key[0], key[1], data, len(data), now

    def _make_room(
        self, conn: sqlite3.Connection, incoming: list[Key]
    ) -> tuple[list[Key], list[Key]]:
        """Evicts least recently touched shards so that ``incoming`` fits; returns the keys
        that fit and those that do not. Runs inside the dump's write transaction."""
        capacity = self.sqlite_config.capacity
        assert capacity is not None
        (used,) = conn.execute("SELECT bytes FROM usage WHERE id = 0").fetchone()
        existing: dict[Key, int] = {}
        for part in chunks(incoming, _QUERY_CHUNK_KEYS):
            for block_id, shard, nbytes in self._select(conn, "block_id, shard, nbytes", part):
                existing[(bytes(block_id), shard)] = nbytes
        growth = sum(self.shard_size - existing.get(key, 0) for key in incoming)
        excess = used + growth - capacity
        if excess > 0:
            used -= self._evict(conn, excess, protected=set(incoming))
        admitted: list[Key] = []
        full: list[Key] = []
        free = capacity - used
        for key in incoming:
            delta = self.shard_size - existing.get(key, 0)
            if delta <= free:
                admitted.append(key)
                free -= delta
            else:
                full.append(key)
        return admitted, full

    def _evict(self, conn: sqlite3.Connection, excess: int, protected: set[Key]) -> int:
        """Drops least recently touched, unpinned shards worth ``excess`` bytes; returns the
        bytes freed. With a ``write: back`` tier below, each victim goes to the evict sink
        first and is kept if the sink failed for it (never drop the only copy)."""
        victims: list[tuple[Key, int]] = []
        planned = 0
        oldest_first = conn.execute(
            "SELECT block_id, shard, nbytes FROM shards ORDER BY touched ASC"
        )
        for block_id, shard, nbytes in oldest_first:
            key = (bytes(block_id), shard)
            if key in protected or self.pins.is_pinned(key):
                continue
            victims.append((key, nbytes))
            planned += nbytes
            if planned >= excess:
                break
        oldest_first.close()  # finish the read before deleting from the same table
        sink = self.context.evict_sink
        if sink is not None and victims:
            keys = [key for key, _ in victims]
            data: dict[Key, bytes] = {}
            for part in chunks(keys, _QUERY_CHUNK_KEYS):
                for block_id, shard, blob in self._select(conn, "block_id, shard, data", part):
                    data[(bytes(block_id), shard)] = blob
            outcomes = sink(keys, [[memoryview(data[key])] for key in keys])
            victims = [v for v, outcome in zip(victims, outcomes, strict=True) if outcome is None]
        conn.executemany(
            "DELETE FROM shards WHERE block_id = ? AND shard = ?", [key for key, _ in victims]
        )
        self._count(evictions=len(victims))
        return sum(nbytes for _, nbytes in victims)

    def touch(self, block_ids: Sequence[bytes]) -> None:
        distinct = list(dict.fromkeys(block_ids))
        if not distinct:
            return
        try:
            with self._write() as conn:
                now = time.time()
                for part in chunks(distinct, _QUERY_CHUNK_KEYS):
                    marks = ",".join("?" * len(part))
                    conn.execute(
                        f"UPDATE shards SET touched = ? WHERE block_id IN ({marks})", [now, *part]
                    )
        except sqlite3.Error as exc:
            raise self._error("touch", exc) from exc

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        for name in names:
            self._check_control_name(name)
        try:
            conn = self._connect()
            found = {}
            for part in chunks(list(names), _QUERY_CHUNK_KEYS):
                marks = ",".join("?" * len(part))
                rows = conn.execute(
                    f"SELECT name, value FROM control WHERE name IN ({marks})", list(part)
                ).fetchall()
                found.update({bytes(name): int.from_bytes(value, "big") for name, value in rows})
        except sqlite3.Error as exc:
            raise self._error("read_control", exc) from exc
        return [found.get(name) for name in names]

    def raise_control(self, name: bytes, value: int) -> None:
        self._check_control_name(name)
        if not isinstance(value, int) or not 0 <= value < 2**64:
            raise InvalidArgumentError(f"value={value!r} is not valid: expected a u64")
        try:
            with self._write() as conn:
                conn.execute(
                    "INSERT INTO control (name, value) VALUES (?, ?) ON CONFLICT (name) "
                    "DO UPDATE SET value = max(value, excluded.value)",
                    (name, value.to_bytes(8, "big")),
                )
        except sqlite3.Error as exc:
            raise self._error("raise_control", exc) from exc

    @staticmethod
    def _check_control_name(name: object) -> None:
        if not isinstance(name, bytes) or len(name) != 16:
            raise InvalidArgumentError(
                f"name={name!r} is not valid: a control record's name is 16 bytes"
            )

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        distinct = list(dict.fromkeys(keys))
        removed = 0
        try:
            for part in chunks(distinct, REMOVE_CHUNK_KEYS):
                # One lock acquisition per chunk, never per key (seed 003).
                with self._write("remove_lock_acquisitions") as conn:
                    doomed = [key for key in part if force or not self.pins.is_pinned(key)]
                    if doomed:
                        removed += self._delete(conn, doomed)
        except sqlite3.Error as exc:
            raise self._error("batched_remove", exc) from exc
        finally:
            self._count(removed=removed)
        return removed

    @staticmethod
    def _delete(conn: sqlite3.Connection, keys: Sequence[Key]) -> int:
        """Deletes the keys with one statement (row values: 2 parameters a key, at most
        2 * REMOVE_CHUNK_KEYS, below SQLite's 32,766): one parse and one index walk instead of
        a bound, stepped and reset statement per key."""
        assert 0 < len(keys) <= REMOVE_CHUNK_KEYS
        rows = ",".join(["(?,?)"] * len(keys))
        flat = [value for key in keys for value in key]
        cursor = conn.execute(
            f"DELETE FROM shards WHERE (block_id, shard) IN (VALUES {rows})",
            flat,
        )
        return max(cursor.rowcount, 0)

    def stats(self) -> dict[str, int | float]:
        with self._counters_lock:
            result: dict[str, int | float] = dict(self._counters)
        if not self._closed:
            try:
                (shards, used) = (
                    self._connect()
                    .execute("SELECT shards, bytes FROM usage WHERE id = 0")
                    .fetchone()
                )
                result["shards"] = shards
                result["used_bytes"] = used
            except sqlite3.Error:
                pass
        if self.sqlite_config.capacity is not None:
            result["capacity"] = self.sqlite_config.capacity
        return result

    def close(self) -> None:
        self._closed = True
        pid = os.getpid()
        with self._connections_lock:
            mine = [conn for owner, conn in self._connections if owner == pid]
            self._connections.clear()
        for conn in mine:
            conn.close()


@ucm.hookimpl
def register_tiers(register: Callable[[type[ucm.Tier]], None]) -> None:
    register(SqliteTier)
