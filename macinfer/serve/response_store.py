"""Stored Responses (OpenAI's `store: true`): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

    store = ResponseStore(cache_dir() / "responses", limit=1000)
    store.put("resp_...", {"response": {...}, "messages": [...]})
    store.get("resp_...")          # the record, or None (unknown, dropped, or unreadable)

Design choices:
- A record is the response object as it was returned and the conversation it ends (the chat
  messages, its own output included, instructions excluded: OpenAI does not carry them over), so
  the next turn renders the same prompt again and its KV comes from the prefix cache.
- One JSON file per response in `directory`, written atomically (a temporary file, fsynced, then
  os.replace) and checked when read back (its id and version): responses survive a restart, and
  a crash or power loss leaves a record whole or absent. The server calls the store from worker
  threads (its disk work off the event loop); a lock keeps its index consistent.
  directory None keeps them in memory only, for this server's life.
- At most `limit` records and `max_bytes` of them (their JSON, images included): storing one more
  drops the oldest (by when it was stored; on start, by the files' modification times) until both
  hold. limit 0 stores nothing; a record larger than max_bytes alone is not kept (one log line).
- NOTE: ids reach the file system, so only ids this module could have made (`resp_` and hex) are
  looked up; anything else is simply unknown.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.staging import remove_stale

log = logging.getLogger("macinfer.serve.server")

VERSION = 1
MAX_STORED = 1000
MAX_STORED_BYTES = 1_000_000_000
ID = re.compile(r"resp_[0-9a-f]{16,64}")


def _locked(method):
    """The method under the store's lock (ResponseStore is called from several threads)."""
    @functools.wraps(method)
    def run(self, *args):
        with self._lock:
            return method(self, *args)
    return run


class ResponseStore:
    """{response id -> record}, bounded, on disk or in memory.

    Args:
        directory: where the records are kept (created if need be); None: in memory only.
        limit: records kept at most (the oldest are dropped first); 0: none.
        max_bytes: their total size at most (the oldest are dropped first).

    Raises:
        MacinferError: the directory cannot be made or read.
    """

    def __init__(self, directory: Path | None, limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        if limit < 0 or max_bytes < 0:
            raise ValueError(f"stored responses' bounds must be >= 0, got {limit} records, {max_bytes} bytes")
        self.directory, self.limit, self.max_bytes = directory, limit, max_bytes
        # Oldest first. NOTE: on disk a record is read when asked for (None here), so memory stays
        # small whatever the limit; in memory it is the record itself.
        self._ids: OrderedDict[str, dict | None] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes of each record in _ids; invariant: self.bytes is their sum
        self.bytes = 0
        self._lock = threading.Lock()  # held by put, get and delete: their callers are threads
        if directory is not None and limit > 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                remove_stale(directory, ".resp_*.tmp")  # what a killed server was writing
                files = sorted(directory.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
            except OSError as e:
                raise MacinferError(f"cannot keep stored responses in {directory} ({e.strerror or e}): make it "
                                    "writable, or keep none (--max-stored-responses 0)") from None
            for p in files:
                self._add(p.stem, None, p.stat().st_size)
            self._trim()

    @property
    def persistent(self) -> bool:
        """Stored responses survive a restart."""
        return self.directory is not None and self.limit > 0

    def __len__(self) -> int:
        return len(self._ids)

    @_locked
    def put(self, rid: str, record: dict) -> None:
        """Store `record` under `rid` (replacing an older one), then drop the oldest beyond the limit."""
        if not ID.fullmatch(rid):
            raise ValueError(f"not a response id: {rid!r}")
        if self.limit == 0:
            return
        record = {"version": VERSION, "id": rid, **record}
        data = json.dumps(record, ensure_ascii=False).encode("utf-8")
        if len(data) > self.max_bytes:
            log.warning("response %s is not stored: %d bytes, over the %d stored responses may take", rid, len(data),
                        self.max_bytes)
            return
        if self.directory is not None:
            path = self._path(rid)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())  # whole on disk before it takes the record's name
                os.replace(tmp, path)
            except OSError as e:  # a full disk: this response is not kept; the server serves on
                log.warning("could not store response %s (%s)", rid, e.strerror or e)
                tmp.unlink(missing_ok=True)
                return
        self._forget(rid)
        self._add(rid, None if self.directory is not None else record, len(data))
        self._trim()

    @_locked
    def get(self, rid: str) -> dict | None:
        """The record stored under `rid`, or None (unknown, dropped, or its file unreadable)."""
        if not ID.fullmatch(rid):
            return None
        if rid not in self._ids:
            # another server on the same directory may have stored it since this one started
            try:
                size = self._path(rid).stat().st_size if self.directory is not None and self.limit else None
            except OSError:
                size = None
            if size is None:
                return None
            self._add(rid, None, size)
            self._trim()
            if rid not in self._ids:
                return None
        record = self._ids.get(rid) if self.directory is None else self._read(rid)
        if record is None:
            self._forget(rid)
        return record

    @_locked
    def delete(self, rid: str) -> bool:
        """Forget `rid`; whether it was stored."""
        if not ID.fullmatch(rid):
            return False
        known = rid in self._ids
        self._forget(rid)
        if self.directory is None or self.limit == 0:
            return known
        path = self._path(rid)
        on_disk = path.is_file()  # another server on the same directory may have stored it (as in get)
        path.unlink(missing_ok=True)
        return known or on_disk

    def _read(self, rid: str) -> dict | None:
        try:
            record = json.loads(self._path(rid).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            log.warning("stored response %s is unreadable (%s): dropped", rid, type(e).__name__)
            self._path(rid).unlink(missing_ok=True)
            return None
        if not isinstance(record, dict) or record.get("id") != rid or record.get("version") != VERSION:
            log.warning("stored response %s is not one this server wrote: dropped", rid)
            return None
        return record

    def _add(self, rid: str, record: dict | None, size: int) -> None:
        self._ids[rid] = record
        self._sizes[rid] = size
        self.bytes += size

    def _forget(self, rid: str) -> None:
        self._ids.pop(rid, None)
        self.bytes -= self._sizes.pop(rid, 0)

    def _trim(self) -> None:
        while len(self._ids) > self.limit or self.bytes > self.max_bytes:
            rid = next(iter(self._ids))
            self._forget(rid)
            if self.directory is not None:
                self._path(rid).unlink(missing_ok=True)

    def _path(self, rid: str) -> Path:
        return self.directory / f"{rid}.json"
