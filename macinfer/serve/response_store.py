"""Stored Responses (OpenAI's `store: true`): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

    store = ResponseStore(cache_dir() / "responses", limit=1000)
    store.put("resp_...", {"response": {...}, "messages": [...]})
    store.get("resp_...")          # the record, or None (unknown, dropped, or unreadable)

Design choices:
- A record is the response object as it was returned and the conversation it ends (the chat
  messages, its own output included, instructions excluded: OpenAI does not carry them over), so
  the next turn renders the same prompt again and its KV comes from the prefix cache.
- One JSON file per response in `directory`, written atomically (a temporary file, then
  os.replace) and checked when read back (its id and version): responses survive a restart.
  directory None keeps them in memory only, for this server's life.
- At most `limit` records: storing one more drops the oldest (by when it was stored; on start,
  by the files' modification times). limit 0 stores nothing.
- NOTE: ids reach the file system, so only ids this module could have made (`resp_` and hex) are
  looked up; anything else is simply unknown.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.staging import remove_stale

log = logging.getLogger("macinfer.serve.server")

VERSION = 1
MAX_STORED = 1000
ID = re.compile(r"resp_[0-9a-f]{16,64}")


class ResponseStore:
    """{response id -> record}, bounded, on disk or in memory.

    Args:
        directory: where the records are kept (created if need be); None: in memory only.
        limit: records kept at most (the oldest are dropped first); 0: none.

    Raises:
        MacinferError: the directory cannot be made or read.
    """

    def __init__(self, directory: Path | None, limit: int = MAX_STORED):
        if limit < 0:
            raise ValueError(f"the number of stored responses must be >= 0, got {limit}")
        self.directory, self.limit = directory, limit
        # Oldest first. NOTE: on disk a record is read when asked for (None here), so memory stays
        # small whatever the limit; in memory it is the record itself.
        self._ids: OrderedDict[str, dict | None] = OrderedDict()
        if directory is not None and limit > 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                remove_stale(directory, ".resp_*.tmp")  # what a killed server was writing
                files = sorted(directory.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
            except OSError as e:
                raise MacinferError(f"cannot keep stored responses in {directory} ({e.strerror or e}): make it "
                                    "writable, or keep none (--max-stored-responses 0)") from None
            for p in files:
                self._ids[p.stem] = None
            self._trim()

    @property
    def persistent(self) -> bool:
        """Stored responses survive a restart."""
        return self.directory is not None and self.limit > 0

    def __len__(self) -> int:
        return len(self._ids)

    def put(self, rid: str, record: dict) -> None:
        """Store `record` under `rid` (replacing an older one), then drop the oldest beyond the limit."""
        if not ID.fullmatch(rid):
            raise ValueError(f"not a response id: {rid!r}")
        if self.limit == 0:
            return
        record = {"version": VERSION, "id": rid, **record}
        if self.directory is not None:
            path = self._path(rid)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
                os.replace(tmp, path)
            except OSError as e:  # a full disk: this response is not kept; the server serves on
                log.warning("could not store response %s (%s)", rid, e.strerror or e)
                tmp.unlink(missing_ok=True)
                return
        self._ids.pop(rid, None)
        self._ids[rid] = None if self.directory is not None else record
        self._trim()

    def get(self, rid: str) -> dict | None:
        """The record stored under `rid`, or None (unknown, dropped, or its file unreadable)."""
        if not ID.fullmatch(rid):
            return None
        if rid not in self._ids:
            # another server on the same directory may have stored it since this one started
            if self.directory is None or self.limit == 0 or not self._path(rid).is_file():
                return None
            self._ids[rid] = None
            self._trim()
        record = self._ids.get(rid) if self.directory is None else self._read(rid)
        if record is None:
            self._ids.pop(rid, None)
        return record

    def delete(self, rid: str) -> bool:
        """Forget `rid`; whether it was stored."""
        if not ID.fullmatch(rid):
            return False
        known = rid in self._ids
        self._ids.pop(rid, None)
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

    def _trim(self) -> None:
        while len(self._ids) > self.limit:
            rid, _ = self._ids.popitem(last=False)
            if self.directory is not None:
                self._path(rid).unlink(missing_ok=True)

    def _path(self, rid: str) -> Path:
        return self.directory / f"{rid}.json"
