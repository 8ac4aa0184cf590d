"""The ``fsspec`` tier: any filesystem fsspec opens (``file://``, ``memory://``, ``s3://`` via
s3fs, ``gs://``, ...), typically an object store shared by many nodes.

Objects are keyed by (block id, shard index) only, never by ``unique_id``, so every node reading
the same URL sees the same blocks: ``<url>/<hex[:2]>/<hex>/<shard>``. Each object is the shard
envelope (``ucm.envelope``: codec, length, XXH3-64 of the shard, digest of its key) followed by
the shard as the tier's ``codec:`` stored it (encoded and decoded on the I/O threads); a short
or corrupted object is deleted and its load fails with a TierError saying so (not a miss, so
the stack repairs it from below). A load reads no more of an object than the largest one a
shard has, plus a byte (``envelope.read_bytes_max``): a longer object is corrupt too, and costs
the reader no more memory than a valid one. An object of the format before the envelope
(``UCF2``/``UCMF``) is deleted too and reads as a miss.

An object of a later envelope version (``envelope.Newer``: written by a newer UCM sharing the
bucket, say during a rolling upgrade) is a miss here and is left alone: loads do not delete it,
eviction passes do not delete it (the victims' first bytes are read before the removal; one
whose read fails is kept too), and it never counts as corrupt (``newer_kept`` counts them).
So a tier's ``capacity`` may be exceeded by such objects, until the newer nodes evict them. A
dump of the same key replaces it with this node's version, an older one that the newer node
still reads (checking first would cost every dump one more request). A look-up
lists a block's objects without reading them, so it answers "present" for such an object (the
load is then a miss and the engine recomputes). An explicit ``batched_remove``
(``Store.remove``, a purge) still removes them: the user asked for it.

On ``file://`` an object is written to a temp name and renamed; the temp files of writers
killed mid-dump are removed behind open.
``<hex>/touch`` is a marker whose modification time records the block's last touch; with
``capacity`` set, an eviction pass drops whole blocks whose newest object is oldest, and so does
a namespace quota's pass (touches are recorded when either is set).

Control records (reset epochs, ``Tier.read_control``): ``<url>/control/<name hex>/<value>``, one
small checksummed object per value (``ucm.control``), outside every scan, capacity, quota,
eviction, listing and namespace of the tier.

Requests of a batch run concurrently on a thread pool (``io_threads``). For ``s3://`` we default
botocore's connect/read timeouts and retries low, so a down endpoint fails a key within seconds
instead of hanging a rank; ``storage_options`` overrides any of it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import fsspec  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from fsspec.registry import (  # type: ignore[import-untyped]
    get_filesystem_class,
    known_implementations,
)
from pydantic import Field

import ucm
from ucm import control, envelope, namespaces
from ucm.config import LowerTierConfig, Size
from ucm.errors import ConfigError, KeyMissingError, TierError
from ucm.fieldtypes import Int
from ucm.layout import Key
from ucm.threadname import enter_thread
from ucm.tier import (
    NAMESPACE_BYTES_OPTION,
    REMOVE_CHUNK_KEYS,
    NamespaceBytes,
    NamespaceUsage,
    Outcome,
    ShardViews,
    Tier,
    TierContext,
    chunks,
    scatter,
)

HEADER_BYTES = envelope.HEADER_BYTES
"""Bytes before the shard in every object (capacity counts them)."""
TOUCH_MARKER = "touch"
TEMP_MAX_AGE_S = 3600.0
"""A local root's temp file older than this is reaped even if a process of its writer's pid
is alive (the pid was reused since)."""

S3_DEFAULT_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"max_attempts": 2, "mode": "standard"},
}
S3_DEFAULT_RETRIES = 1
"""s3fs's own retry loop (its default is 5 attempts with back-off), on top of botocore's;
``storage_options: {retries: N}`` sets it (s3fs takes it as an attribute, not an argument)."""


class FsspecConfig(LowerTierConfig):
    """A directory/prefix on any fsspec filesystem."""

    type: Literal["fsspec"] = "fsspec"
    url: str = Field(min_length=1, description="fsspec URL, e.g. s3://bucket/prefix.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the fsspec filesystem."
    )
    capacity: Size | None = Field(
        default=None, description="Bound on the bytes stored; oldest-touched blocks go first."
    )
    io_threads: Int = Field(default=8, ge=1, le=256, description="Concurrent requests per batch.")

    def block_footprint(self, shard_size: int, shards_per_block: int) -> tuple[int, str] | None:
        size = shards_per_block * (HEADER_BYTES + shard_size)
        return size, (
            f"{shards_per_block} object(s) of a {HEADER_BYTES}-byte envelope header and a "
            f"{shard_size}-byte shard"
        )


def _protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def open_filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """``(filesystem, root path)`` for ``url``; ConfigError naming the URL and the package to
    install when the protocol's implementation is missing or unknown."""
    protocol = _protocol(url)
    try:
        get_filesystem_class(protocol)
    except ImportError as exc:
        spec = known_implementations.get(protocol, {})
        package = str(spec.get("class", protocol)).split(".")[0]
        raise ConfigError(
            f"fsspec tier url {url!r}: protocol {protocol!r} needs the package {package!r}, "
            f"which is not installed; install it with `pip install {package}` ({exc})"
        ) from None
    except ValueError:
        known = ", ".join(sorted(set(fsspec.available_protocols())))
        raise ConfigError(
            f"fsspec tier url {url!r}: unknown protocol {protocol!r}; known protocols: {known}"
        ) from None
    options = dict(storage_options)
    s3_retries = int(options.pop("retries", S3_DEFAULT_RETRIES))
    if protocol in ("s3", "s3a"):
        # Deep copies: botocore rewrites the `retries` dict it is given in place.
        config = copy.deepcopy(S3_DEFAULT_CONFIG)
        config.update(copy.deepcopy(options.get("config_kwargs", {})))
        options["config_kwargs"] = config
        # Listings must not be cached: other nodes add blocks behind our back.
        options.setdefault("use_listings_cache", False)
    if protocol in ("file", "local"):
        options.setdefault("auto_mkdir", True)
    options.setdefault("skip_instance_cache", True)
    try:
        fs, root = fsspec.url_to_fs(url, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"fsspec tier url {url!r}: bad storage_options: {exc}") from None
    if protocol in ("s3", "s3a") and hasattr(fs, "retries"):
        fs.retries = s3_retries
    return fs, str(root).rstrip("/")


def default_request_timeout(url: str, storage_options: dict[str, Any]) -> float | None:
    """For s3: the longest botocore and s3fs may legitimately take over one request, with
    every retry, plus a second; None for other protocols."""
    if _protocol(url) not in ("s3", "s3a"):
        return None
    config = {**S3_DEFAULT_CONFIG, **storage_options.get("config_kwargs", {})}
    retries = config.get("retries") or {}
    # botocore: max_attempts counts retries after the first try, total_max_attempts all tries.
    attempts = int(retries.get("total_max_attempts") or int(retries.get("max_attempts", 0)) + 1)
    s3fs_attempts = int(storage_options.get("retries", S3_DEFAULT_RETRIES) or 1)
    per_attempt = float(config.get("connect_timeout", 60)) + float(config.get("read_timeout", 60))
    return per_attempt * max(attempts, 1) * max(s3fs_attempts, 1) + 1.0


def _timestamp(info: dict[str, Any]) -> float:
    """Modification time (seconds) from an fsspec info dict, whatever the implementation."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.UTC)
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


class FsspecTier(Tier):
    type_name = "fsspec"
    config_model = FsspecConfig
    remove_chunk_keys = REMOVE_CHUNK_KEYS
    """Keys per lock acquisition in batched_remove (a benchmark compares other values)."""

    def __init__(self, config: ucm.TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, FsspecConfig)
        self.cfg: FsspecConfig = config
        self.fs, self.root = open_filesystem(config.url, config.storage_options)
        timeout = default_request_timeout(config.url, config.storage_options)
        # fsspec's sync wrapper of an async filesystem bounds a call with `timeout=`: botocore's
        # read_timeout alone does not stop a PUT to an endpoint that accepts and never answers.
        self._call: dict[str, Any] = (
            {"timeout": timeout} if timeout and getattr(self.fs, "async_impl", False) else {}
        )
        self._local_fs = isinstance(self.fs, LocalFileSystem)
        self.shard_size = self.layout.shard_size
        self._pool = ThreadPoolExecutor(
            config.io_threads, thread_name_prefix="ucm-fsspec", initializer=enter_thread
        )
        self._sweeper = ThreadPoolExecutor(
            1, thread_name_prefix="ucm-temp-sweep", initializer=enter_thread
        )
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stat: dict[str, int] = dict.fromkeys(
            (
                "hits",
                "misses",
                "corrupt",
                "errors",
                "bytes_read",
                "bytes_written",
                "bytes_stored",
                "lock_acquisitions",
                "remove_lock_acquisitions",
                "evictions",
                "eviction_passes",
                "namespace_eviction_passes",
                "evict_sink_failures",
                "touches",
                "newer_kept",
            ),
            0,
        )
        self._usage = 0
        self._written_since_scan = 0
        self._kept_bytes = 0
        """Bytes (estimated) of the objects the last eviction pass had to keep (a newer UCM's):
        left out of the bound that triggers the next pass, so that they do not make every
        dump rescan the tree; a pass still runs every capacity/8 bytes written."""
        self._closed = False
        # Each namespace's stored bytes here (this process's estimate, exact after every
        # scan): what namespace byte quotas (the stack's `quotas:` for this tier) are enforced
        # against, and what stats report per namespace.
        quotas: NamespaceBytes | None = context.options.get(NAMESPACE_BYTES_OPTION)
        self._namespace_usage = NamespaceUsage(quotas)
        if config.capacity is not None:
            entries = self._scan()
            self._usage = sum(size for _t, size, _b, _p in entries)
            self._namespace_usage.rescanned(_by_namespace(entries))
        if quotas is not None:
            self.evict_namespace_quotas()
        self.temp_sweep: Future[None] | None = None
        """The sweep of dead writers' temp files behind open (``file://`` only)."""
        if self._local_fs:
            # The temp files of writers killed mid-dump: removed behind open, on a thread
            # of its own (never one of the I/O pool's, which loads wait for); close stops
            # it between two directories.
            self.temp_sweep = self._sweeper.submit(self._reap_temps)
            self._sweeper.shutdown(wait=False)  # its thread exits when done

    # --------------------------------------------------------------------------------- paths

    def block_dir(self, block_id: bytes) -> str:
        hexid = block_id.hex()
        prefix = self.namespace_prefix(block_id)
        if not prefix:
            return f"{self.root}/{hexid[:2]}/{hexid}"
        # A namespace's own prefix, spread by a byte of the id's hash (not of its tag).
        return f"{self.root}/{prefix}{hexid[16:18]}/{hexid}"

    def list_keys(self) -> list[Key]:
        keys: list[Key] = []
        for _when, _size, block_id, paths in self._scan():
            for path in paths:
                parts = path.rstrip("/").split("/")
                # <root>/ns/<name>/<xx>/<hex>/<shard>: register the name, so the ids resolve.
                if len(parts) >= 5 and parts[-5] == "ns":
                    namespaces.register(parts[-4])
                if parts[-1].isdigit() and int(parts[-1]) < self.layout.shards_per_block:
                    keys.append((block_id, int(parts[-1])))
        return keys

    def object_path(self, key: Key) -> str:
        return f"{self.block_dir(key[0])}/{key[1]}"

    def _bump(self, **amounts: int) -> None:
        with self._stats_lock:
            for name, amount in amounts.items():
                self._stat[name] += amount

    def _error(self, what: str, key: Key, exc: BaseException) -> TierError:
        return TierError(
            f"fsspec tier {self.label!r} ({self.cfg.url}): {what} block {key[0].hex()} shard "
            f"{key[1]}: {type(exc).__name__}: {exc}"
        )

    def _map(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        if len(items) <= 1:
            return [fn(item) for item in items]
        return list(self._pool.map(fn, items))

    def _present_shards(self, block_id: bytes) -> set[int]:
        """Shard indices with an object in the block's directory (one listing)."""
        return self._listing(block_id)[0]

    def _listing(self, block_id: bytes) -> tuple[set[int], bool]:
        """(shard indices present, whether the touch marker exists): one listing."""
        try:
            names = self.fs.ls(self.block_dir(block_id), detail=False, **self._call)
        except FileNotFoundError:
            return set(), False
        shards = set()
        marker = False
        for name in names:
            base = str(name).rstrip("/").rsplit("/", 1)[-1]
            if base.isdigit() and int(base) < self.layout.shards_per_block:
                shards.add(int(base))
            elif base == TOUCH_MARKER:
                marker = True
        return shards, marker

    # -------------------------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        blocks = list(dict.fromkeys(block_id for block_id, _ in keys))
        present = dict(zip(blocks, self._present_all(blocks), strict=True))
        return [shard in present[block_id] for block_id, shard in keys]

    def lookup_blocks(self, block_ids: Sequence[bytes]) -> list[bool]:
        every = set(range(self.layout.shards_per_block))
        return [every <= found for found in self._present_all(list(block_ids))]

    def lookup_prefix(self, keys: Sequence[Key]) -> list[bool]:
        # One listing per block, ``io_threads`` blocks at a time, in order: stops after the
        # round holding the first absent key instead of listing every block of a long prompt.
        blocks = list(dict.fromkeys(block_id for block_id, _ in keys))
        present: dict[bytes, set[int]] = {}
        answers: list[bool] = []
        done = 0
        for start in range(0, len(blocks), self.cfg.io_threads):
            chunk = blocks[start : start + self.cfg.io_threads]
            present.update(zip(chunk, self._present_all(chunk), strict=True))
            while done < len(keys) and keys[done][0] in present:
                block_id, shard = keys[done]
                answers.append(shard in present[block_id])
                done += 1
            if not all(answers):
                break
        return answers

    def _present_all(self, block_ids: list[bytes]) -> list[set[int]]:
        """Shards present of each block; raises TierError when a listing failed (look-ups
        have no per-key outcome: the store answers "miss" and its breaker counts it)."""
        found = self._map(self._safe_present, block_ids)
        failed = [f for f in found if isinstance(f, BaseException)]
        if failed:
            raise TierError(
                f"fsspec tier {self.label!r} ({self.cfg.url}): look-up of {len(failed)} of "
                f"{len(block_ids)} block(s) failed: {type(failed[0]).__name__}: {failed[0]}"
            )
        return [f for f in found if not isinstance(f, BaseException)]

    def _safe_present(self, block_id: bytes) -> set[int] | BaseException:
        try:
            return self._present_shards(block_id)
        except Exception as exc:
            self._bump(errors=1)
            return exc

    # ---------------------------------------------------------------------------------- load

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        assert len(keys) == len(destinations), "one destination per key"
        return self._map(self._load_one, list(zip(keys, destinations, strict=True)))

    def _load_one(self, item: tuple[Key, ShardViews]) -> Outcome:
        key, views = item
        path = self.object_path(key)
        try:
            # Never more than the largest object a shard has (plus one byte, to see a longer
            # one): a hostile object of any size costs this reader a shard's memory.
            data = self.fs.cat_file(
                path, start=0, end=envelope.read_bytes_max(self.shard_size), **self._call
            )
        except FileNotFoundError:
            self._bump(misses=1)
            return KeyMissingError(
                f"fsspec tier {self.label!r}: block {key[0].hex()} shard {key[1]} is not present"
            )
        except Exception as exc:
            self._bump(errors=1)
            return self._error("loading", key, exc)
        try:
            shard = envelope.open_object(data, key, self.shard_size)
        except envelope.Newer as exc:
            # A newer UCM's shard (a rolling upgrade): not ours to delete or call corrupt.
            self._bump(misses=1, newer_kept=1)
            return KeyMissingError(
                f"fsspec tier {self.label!r}: block {key[0].hex()} shard {key[1]} is not "
                f"readable here ({exc}); it was kept for the UCM that wrote it"
            )
        except envelope.Foreign as exc:
            self._bump(misses=1)
            self._remove_unusable(path)  # lookups stop answering "present" for it
            return KeyMissingError(
                f"fsspec tier {self.label!r}: block {key[0].hex()} shard {key[1]} is not "
                f"readable here ({exc}); it was removed"
            )
        except envelope.Corrupt as exc:
            self._bump(corrupt=1)
            self._remove_unusable(path)
            # A failure, not a miss: the stack repairs the shard here from a tier below.
            return TierError(
                f"fsspec tier {self.label!r}: block {key[0].hex()} shard {key[1]} is corrupt "
                f"({exc}); it was removed"
            )
        scatter(shard, views)
        self._bump(hits=1, bytes_read=self.shard_size)
        return None

    def _remove_unusable(self, path: str) -> None:
        try:
            self.fs.rm_file(path, **self._call)
        except Exception:  # best effort: the next reader finds it unusable again
            self._bump(errors=1)

    # ---------------------------------------------------------------------------------- dump

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        assert len(keys) == len(sources), "one source per key"
        results = self._map(self._dump_one, list(zip(keys, sources, strict=True)))
        outcomes: list[Outcome] = [outcome for outcome, _ in results]
        written = self.shard_size * sum(1 for o in outcomes if o is None)
        stored = sum(size for _, size in results)
        with self._stats_lock:
            self._stat["bytes_written"] += written
            self._stat["bytes_stored"] += stored
            self._usage += stored
            self._written_since_scan += stored
            capacity = self.cfg.capacity
            over = capacity is not None and (
                self._usage - self._kept_bytes > capacity
                or self._written_since_scan > max(capacity // 8, 1)
            )
        if over:
            self.evict_to_capacity()
        usage = self._namespace_usage
        over = False
        for (block_id, _shard), (outcome, stored) in zip(keys, results, strict=True):
            if outcome is None:
                over = usage.add(namespaces.namespace_of(block_id), stored) or over
        if over:
            self.evict_namespace_quotas()
        return outcomes

    def _dump_one(self, item: tuple[Key, ShardViews]) -> tuple[Outcome, int]:
        """(outcome, bytes stored) of one shard; its codec runs here, on an I/O thread."""
        key, views = item
        assert sum(len(v) for v in views) == self.shard_size, "source size != shard_size"
        sealed = envelope.encode(key, views, self.cfg.codec)
        data = b"".join([sealed.header, *sealed.payload])
        path = self.object_path(key)
        try:
            if self._local_fs:
                # Local files are not written atomically by fsspec: write aside, then rename.
                temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                self.fs.pipe_file(temp, data)
                os.replace(temp, path)
            else:
                self.fs.pipe_file(path, data, **self._call)
        except Exception as exc:
            self._bump(errors=1)
            return self._error("writing", key, exc), 0
        return None, len(data)

    def _newer_object(self, path: str) -> bool:
        """Whether ``path`` holds an object of a later envelope version (a newer UCM's, never
        ours to delete): one ranged read of its first bytes; False when absent. Raises what
        the read raises."""
        try:
            head = self.fs.cat_file(path, start=0, end=envelope.NEWER_PREFIX_BYTES, **self._call)
        except FileNotFoundError:
            return False
        return envelope.newer_version(head) is not None

    def _newer_keys(self, keys: Sequence[Key]) -> set[Key]:
        """The keys among ``keys`` whose objects are a newer UCM's (kept by evictions), or
        whose first bytes could not be read (kept too: this pass cannot tell)."""

        def one(key: Key) -> bool:
            try:
                newer = self._newer_object(self.object_path(key))
            except Exception:
                self._bump(errors=1)
                return True  # unknown: kept, this pass cannot tell
            if newer:
                self._bump(newer_kept=1)
            return newer

        found = self._map(one, list(keys))
        return {key for key, keep in zip(keys, found, strict=True) if keep}

    def _reap_temps(self) -> None:
        """Removes the temp files (``<shard>.<pid>.<hex>.tmp``) that writers of a local root
        left when they died mid-dump: those of processes gone, or older than an hour."""
        now = time.time()
        for directory, _dirs, names in os.walk(self.root):
            if self._closed:
                return  # the next open sweeps again
            for name in names:
                parts = name.split(".")
                if len(parts) != 4 or parts[3] != "tmp" or not parts[1].isdigit():
                    continue
                path = os.path.join(directory, name)
                try:
                    age_s = now - os.stat(path).st_mtime
                except FileNotFoundError:
                    continue
                if _alive(int(parts[1])) and age_s <= TEMP_MAX_AGE_S:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # --------------------------------------------------------------------------------- touch

    def touch(self, block_ids: Sequence[bytes]) -> None:
        # Only eviction reads the touch time (capacity's and the namespace quotas' passes):
        # without either there is nothing to refresh.
        evicts = self.cfg.capacity is not None or self._namespace_usage.quotas is not None
        if not evicts or not block_ids:
            return

        def one(block_id: bytes) -> None:
            try:
                if self._present_shards(block_id):
                    self.fs.pipe_file(
                        f"{self.block_dir(block_id)}/{TOUCH_MARKER}",
                        str(time.time_ns()).encode(),
                        **self._call,
                    )
            except Exception:
                self._bump(errors=1)

        self._map(one, list(block_ids))
        self._bump(touches=len(block_ids))

    # ----------------------------------------------------------------------- control records

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        """Each record's value from ``<url>/control/<name hex>/`` (``ucm.control``)."""
        return [self._read_record(control.check_name(name)) for name in names]

    def _read_record(self, name: bytes) -> int | None:
        directory = f"{self.root}/{control.record_dir(name)}"

        def listing() -> list[str] | None:
            try:
                found = self.fs.ls(directory, detail=False, refresh=True, **self._call)
            except FileNotFoundError:
                return None
            return [str(path).rstrip("/").rsplit("/", 1)[-1] for path in found]

        def fetch(value: int) -> bytes | None:
            try:
                data = self.fs.cat_file(f"{directory}/{control.value_file(value)}", **self._call)
            except FileNotFoundError:
                return None
            return bytes(data)

        try:
            return control.read(name, listing, fetch, f"fsspec tier {self.label!r}")
        except TierError:
            raise
        except Exception as exc:
            raise TierError(
                f"fsspec tier {self.label!r} ({self.cfg.url}): reading control record "
                f"{name.hex()}: {type(exc).__name__}: {exc}"
            ) from exc

    def raise_control(self, name: bytes, value: int) -> None:
        """Writes the object of ``value`` (a local root: temp, fsync, rename; an object store's
        put is atomic), then drops the objects of lower values."""
        control.check_name(name)
        control.check_value(value)
        directory = f"{self.root}/{control.record_dir(name)}"
        path = f"{directory}/{control.value_file(value)}"
        data = control.encode(name, value)
        try:
            if self._local_fs:
                os.makedirs(directory, exist_ok=True)
                temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                with open(temp, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temp, path)
                dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            else:
                self.fs.pipe_file(path, data, **self._call)
            found = self.fs.ls(directory, detail=False, refresh=True, **self._call)
            values = control.values_of([str(p).rstrip("/").rsplit("/", 1)[-1] for p in found])
            control.prune(
                values, max(values), lambda v: self._rm_one(f"{directory}/{control.value_file(v)}")
            )
        except Exception as exc:
            raise TierError(
                f"fsspec tier {self.label!r} ({self.cfg.url}): raising control record "
                f"{name.hex()} to {value}: {type(exc).__name__}: {exc}"
            ) from exc

    # -------------------------------------------------------------------------------- remove

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        distinct = list(dict.fromkeys(keys))
        # Object stores take bulk deletes (s3: 1,000 keys a request) but report absent keys as
        # deleted too, so blocks are listed first for an exact count. Others delete one path
        # per call anyway, and the call says whether the path existed: no listing needed,
        # except to tell whether a partly removed block is left empty (some, like memory://,
        # list a directory by scanning every stored path).
        bulk = bool(getattr(self.fs, "async_impl", False))
        removed = 0
        for chunk in chunks(distinct, self.remove_chunk_keys):
            with self._lock:
                self._bump(lock_acquisitions=1, remove_lock_acquisitions=1)
                wanted: dict[bytes, set[int]] = {}
                for block_id, shard in chunk:
                    if force or not self.pins.is_pinned((block_id, shard)):
                        wanted.setdefault(block_id, set()).add(shard)
                try:
                    per_block = self._remove_listed(wanted) if bulk else self._remove_each(wanted)
                except TierError:
                    raise
                except Exception as exc:
                    raise TierError(
                        f"fsspec tier {self.label!r} ({self.cfg.url}): batched_remove: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                for block_id, count in per_block.items():
                    removed += count
                    # Each shard's object: its envelope and the shard (exact without a codec;
                    # the next scan corrects what a codec saved).
                    self._namespace_usage.remove(
                        namespaces.namespace_of(block_id), count * (HEADER_BYTES + self.shard_size)
                    )
        return removed

    def _remove_listed(self, wanted: dict[bytes, set[int]]) -> dict[bytes, int]:
        """Removes the wanted shards; the shards removed per block."""
        blocks = list(wanted)
        try:
            listings = self._map(self._listing, blocks)
        except Exception as exc:
            raise TierError(
                f"fsspec tier {self.label!r} ({self.cfg.url}): batched_remove could not list "
                f"blocks: {type(exc).__name__}: {exc}"
            ) from exc
        paths: list[str] = []
        removed: dict[bytes, int] = {}
        for block_id, (present, has_marker) in zip(blocks, listings, strict=True):
            gone = wanted[block_id] & present
            paths += [self.object_path((block_id, s)) for s in sorted(gone)]
            removed[block_id] = len(gone)
            if gone == present and has_marker:  # nothing left: the marker goes too
                paths.append(f"{self.block_dir(block_id)}/{TOUCH_MARKER}")
        if paths:
            self._rm(paths)
        return removed

    def _remove_each(self, wanted: dict[bytes, set[int]]) -> dict[bytes, int]:
        """Removes the wanted shards; the shards removed per block."""
        removed: dict[bytes, int] = {}
        for block_id, shards in wanted.items():
            removed[block_id] = sum(
                self._rm_one(self.object_path((block_id, s))) for s in sorted(shards)
            )
            if len(shards) == self.layout.shards_per_block or not self._listing(block_id)[0]:
                self._rm_one(f"{self.block_dir(block_id)}/{TOUCH_MARKER}")  # nothing left
        return removed

    def _rm_one(self, path: str) -> bool:
        """Removes one path; False when it was absent (or removed concurrently)."""
        try:
            self.fs.rm_file(path, **self._call)
        except FileNotFoundError:
            return False
        return True

    def _rm(self, paths: list[str]) -> None:
        try:
            if getattr(self.fs, "async_impl", False):
                self.fs.rm(paths, **self._call)  # object stores: bulk deletes
            else:
                # Others delete one by one anyway, and some (memory://) check each path of a
                # list against every stored path: quadratic in the number stored.
                for path in paths:
                    self._rm_one(path)
        except FileNotFoundError:
            pass  # removed concurrently by another node
        except Exception as exc:
            raise TierError(
                f"fsspec tier {self.label!r} ({self.cfg.url}): removing {len(paths)} objects: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    # ------------------------------------------------------------------------------ eviction

    def _scan(self) -> list[tuple[float, int, bytes, list[str]]]:
        """[(last touch, bytes, block id, object paths)] of every block under the root."""
        try:
            found = self.fs.find(self.root, detail=True, **self._call)
        except FileNotFoundError:
            return []
        blocks: dict[bytes, tuple[float, int, list[str]]] = {}
        control_root = f"{self.root.rstrip('/')}/{control.CONTROL_DIR}/"
        for path, info in found.items():
            if str(path).startswith(control_root):  # control records are no blocks
                continue
            parts = str(path).rstrip("/").split("/")
            if len(parts) < 2 or len(parts[-2]) != 32:
                continue
            if len(parts) >= 5 and parts[-5] == "ns":  # <root>/ns/<name>/<stripe>/<id>/<object>
                namespaces.register(parts[-4])  # its keys resolve to it (quotas)
            try:
                block_id = bytes.fromhex(parts[-2])
            except ValueError:
                continue
            when, size, paths = blocks.get(block_id, (0.0, 0, []))
            paths.append(str(path))
            blocks[block_id] = (
                max(when, _timestamp(info)),
                size + int(info.get("size") or 0),
                paths,
            )
        return [(when, size, b, paths) for b, (when, size, paths) in blocks.items()]

    def evict_to_capacity(self) -> int:
        """One eviction pass (a no-op without ``capacity``); returns the shards evicted."""
        capacity = self.cfg.capacity
        if capacity is None:
            return 0
        entries = self._scan()
        total = sum(size for _t, size, _b, _p in entries)
        with self._stats_lock:
            self._usage = total
            self._written_since_scan = 0
            self._kept_bytes = 0
        if self._namespace_usage.quotas is None:  # else their passes rescan
            self._namespace_usage.rescanned(_by_namespace(entries))
        if total <= capacity:
            return 0
        self._bump(eviction_passes=1)
        return self._evict_entries(entries, self._oldest(entries, total - capacity))

    def _oldest(
        self, entries: list[tuple[float, int, bytes, list[str]]], excess: int
    ) -> list[tuple[bytes, list[int]]]:
        """The oldest unpinned blocks of ``entries`` (newest object oldest first) that make up
        ``excess`` bytes, with their shards."""
        victims: list[tuple[bytes, list[int]]] = []
        for _when, size, block_id, paths in sorted(entries, key=lambda e: (e[0], e[2])):
            if excess <= 0:
                break
            shards = sorted(
                int(p.rsplit("/", 1)[-1]) for p in paths if p.rsplit("/", 1)[-1].isdigit()
            )
            if any(self.pins.is_pinned((block_id, s)) for s in shards):
                continue
            victims.append((block_id, shards))
            excess -= size
        return victims

    def evict_namespace_quotas(self) -> int:
        """One pass over the namespace byte quotas (a no-op without any): each namespace over
        its bytes here loses its oldest blocks first, down to them. Returns shards evicted."""
        estimate = self._namespace_usage
        if estimate.quotas is None:
            return 0
        entries = self._scan()
        by_namespace: dict[str, list[tuple[float, int, bytes, list[str]]]] = {}
        for entry in entries:
            by_namespace.setdefault(namespaces.namespace_of(entry[2]), []).append(entry)
        excess = estimate.rescanned(_by_namespace(entries))
        victims: list[tuple[bytes, list[int]]] = []
        for name, over in excess.items():
            victims += self._oldest(by_namespace[name], over)
        if not victims:
            return 0
        self._bump(namespace_eviction_passes=1)
        return self._evict_entries(entries, victims)

    def _evict_entries(
        self,
        entries: list[tuple[float, int, bytes, list[str]]],
        victims: list[tuple[bytes, list[int]]],
    ) -> int:
        """Writes the victims down (a `write: back` tier below) and removes them, keeping what
        could not be written down; returns the shards evicted."""
        # A block dir holding only a touch marker (its shards removed by a node without a
        # capacity) has nothing to write down: drop the marker so it stops counting.
        leftovers = [p for _w, _s, b, paths in entries for p in paths if (b, []) in victims]
        if leftovers:
            self._rm(leftovers)
        keys = [(block_id, s) for block_id, shards in victims for s in shards]
        # Objects of a newer UCM are never this node's to evict: kept, even past ``capacity``.
        keep: set[Key] = self._newer_keys(keys)
        if keep:
            with self._stats_lock:
                self._kept_bytes += len(keep) * (HEADER_BYTES + self.shard_size)
        keys = [key for key in keys if key not in keep]
        sink = self.context.evict_sink
        if sink is not None and keys:
            buffers = [bytearray(self.shard_size) for _ in keys]
            loaded = self.load(keys, [[memoryview(b)] for b in buffers])
            readable = [i for i, outcome in enumerate(loaded) if outcome is None]
            # A shard that could not be read (a failed request, not a miss) was not written
            # down: it stays. A corrupt one was removed by the load already.
            keep |= {
                key
                for key, outcome in zip(keys, loaded, strict=True)
                if outcome is not None and not isinstance(outcome, KeyMissingError)
            }
            try:
                outcomes = list(
                    sink([keys[i] for i in readable], [[memoryview(buffers[i])] for i in readable])
                )
            except Exception:
                outcomes = [TierError("evict sink raised")] * len(readable)
            failed = {keys[i] for i, o in zip(readable, outcomes, strict=True) if o is not None}
            self._bump(evict_sink_failures=len(failed))
            keep |= failed
        drop = [key for key in keys if key not in keep]
        # By namespace, so that each one's evictions count (its bytes come off the estimate
        # in batched_remove).
        by_namespace: dict[str, list[Key]] = {}
        for key in drop:
            by_namespace.setdefault(namespaces.namespace_of(key[0]), []).append(key)
        evicted = 0
        for name, group in by_namespace.items():
            dropped = self.batched_remove(group)
            self._namespace_usage.remove(name, 0, dropped)
            evicted += dropped
        self._bump(evictions=evicted)
        return evicted

    # ---------------------------------------------------------------------------- stats, close

    def namespace_figures(self, wait_s: float = 0.0) -> dict[str, dict[str, int]] | None:
        """Each namespace's stored bytes here (its objects' sizes) and this process's evictions
        of its shards. The bytes are exact after a listing of the tree (at open with
        ``capacity`` or quotas, at every eviction pass, and in the background when stats are
        read and the last listing is older than ``NamespaceUsage.scan_interval_s``), moved by
        this process's writes and removals since; unknown (None) until the first listing."""
        if not self._closed:
            self._namespace_usage.refresh(lambda: _by_namespace(self._scan()), wait_s)
        return self._namespace_usage.figures()

    def stats(self) -> dict[str, int | float]:
        with self._stats_lock:
            result: dict[str, int | float] = dict(self._stat)
            result["usage_bytes"] = self._usage
            result["capacity_bytes"] = self.cfg.capacity or 0
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._sweeper.shutdown(wait=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists here (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _by_namespace(entries: list[tuple[float, int, bytes, list[str]]]) -> dict[str, int]:
    """Stored bytes per namespace of scanned blocks."""
    usage: dict[str, int] = {}
    for _when, size, block_id, _paths in entries:
        name = namespaces.namespace_of(block_id)
        usage[name] = usage.get(name, 0) + size
    return usage


@ucm.hookimpl
def register_tiers(register: Any) -> None:
    register(FsspecTier)
