"""The audit trail: who changed shared state, what they changed, and when.

Shared state is what other people and runs rely on: registry aliases (``latest``, ``best``, …), what
``rlpipe gc`` deletes, a resume that changes a run's config, the Prefect automations, a run stopped by a
cancel (an automation's, the UI's or the CLI's). Each such change writes one :class:`AuditRecord`:

- **in the object store**, as its own small object ``audit/date=YYYY-MM-DD/<UTC time>-<uuid>.jsonl`` (one JSON
  line). S3 has no append, so the log is append-only by construction: a record is a new key, never rewritten,
  and two writers at the same instant write two keys. :meth:`AuditLog.read` lists and merges them in time order.
- **as a Prefect event** ``rlpipe.audit.<action>`` (the ``emit`` callable the orchestration layer hands in:
  this module imports no orchestrator);
- **as an MLflow tag** ``rlpipe.audit.<action>`` on the model version, registered model or MLflow run touched
  (set by the caller, which holds the tracker; :func:`tag` gives key and value).

The store's record is the one that counts, and it is written **before** the change (:meth:`AuditLog.change`):
a change whose record cannot be written is not made, and the error names the store and the fix. A change that
then fails adds a second record, ``status: failed``, naming the first. So the log may hold a change that a
kill stopped half way (the record, then nothing), never a change without its record. The event and the tag
follow the change and are notifications: one that cannot be sent is logged, the change stands.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AUDIT_PREFIX", "AuditError", "AuditLog", "AuditRecord", "move_alias", "parse_since", "set_tag", "tag", "who"]

AUDIT_PREFIX = "audit"
TAG_PREFIX = "rlpipe.audit."
_KEY = re.compile(r"/(\d{8}T\d{6}\.\d{6}Z)-([0-9a-f]{32})\.jsonl$")
log = logging.getLogger("rlpipe.audit")


class AuditError(RuntimeError):
    """An audit record could not be written: the change it describes was not made."""


@dataclass(frozen=True)
class AuditRecord:
    """One change. ``target`` names what was touched (``model``, ``version``, ``alias``, ``run_id``, ``keys``…),
    ``details`` how (``from`` → ``to``, the reason, the config changes). ``status`` is ``ok``, or ``failed``
    for the record that says the change ``ref`` names did not go through (``details.error`` says why)."""

    id: str
    time: str  # UTC, ISO 8601 with microseconds
    action: str
    target: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    who: dict[str, str] = field(default_factory=dict)
    status: str = "ok"
    ref: str | None = None

    @property
    def key(self) -> str:
        stamp = dt.datetime.fromisoformat(self.time)
        return f"{AUDIT_PREFIX}/date={stamp:%Y-%m-%d}/{stamp:%Y%m%dT%H%M%S.%fZ}-{self.id}.jsonl"

    def line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)

    @classmethod
    def parse(cls, text: str, where: str) -> "AuditRecord":
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: not an audit record ({e}); it was not written by rlpipe, move it out of "
                             f"{AUDIT_PREFIX}/") from None


def who(settings: Any = None, extra: dict[str, str | None] | None = None, environ: dict[str, str] | None = None
        ) -> dict[str, str]:
    """The person and process behind a change: OS ``user`` and ``host``; ``identity``, the actor the change is
    charged to (``RLPIPE_ACTOR`` where set, else the S3 access key id, else the MLflow user, else user@host);
    and each identity known beside it. Never a secret: the access key id names a key, its secret stays out."""
    env = os.environ if environ is None else environ
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container running as an anonymous uid)
        user = f"uid-{os.getuid()}"
    host = socket.gethostname()
    out = {"user": user, "host": host,
           "s3_access_key_id": (settings.s3_access_key_id if settings is not None else None)
           or env.get("RLPIPE_S3_ACCESS_KEY_ID") or env.get("AWS_ACCESS_KEY_ID") or "",
           "mlflow_user": env.get("MLFLOW_TRACKING_USERNAME", "")}
    out |= {k: str(v) for k, v in (extra or {}).items() if v}
    actor = env.get("RLPIPE_ACTOR") or (out["s3_access_key_id"] and f"s3:{out['s3_access_key_id']}") \
        or (out["mlflow_user"] and f"mlflow:{out['mlflow_user']}") or f"{user}@{host}"
    return {"identity": actor} | {k: v for k, v in out.items() if v}


def tag(record: AuditRecord) -> tuple[str, str]:
    """The MLflow tag (key, value) a change leaves on what it touched: the latest change of each action."""
    by = record.who.get("identity", "?")
    return f"{TAG_PREFIX}{record.action}", f"{record.time} {record.id} by {by}"[:5000]


class AuditLog:
    """The audit log in an object store (:class:`rlpipe.storage.ObjectStore`). ``emit`` sends a record as an
    event (the orchestration layer's); ``actor``: :func:`who` of this process, computed once."""

    def __init__(self, store: Any, *, actor: dict[str, str] | None = None,
                 emit: Callable[[AuditRecord], None] | None = None):
        self.store, self.emit = store, emit
        self.actor = actor if actor is not None else who()

    def write(self, action: str, target: dict[str, Any], details: dict[str, Any] | None = None, *,
              status: str = "ok", ref: str | None = None) -> AuditRecord:
        """Append one record (a new object). Raises :class:`AuditError` naming the store when it cannot."""
        now = dt.datetime.now(dt.timezone.utc)
        rec = AuditRecord(uuid.uuid4().hex, now.isoformat(timespec="microseconds"), action, dict(target),
                          dict(details or {}), dict(self.actor), status, ref)
        try:
            self.store.put_bytes(rec.key, (rec.line() + "\n").encode())
        except Exception as e:  # noqa: BLE001 - any store failure means: no record
            raise AuditError(f"{action} on {_short(target)}: the audit record could not be written to "
                             f"{self.store.url(rec.key)} ({type(e).__name__}: {e}). Make the store writable "
                             "(credentials, RLPIPE_STORAGE_URI)") from e
        return rec

    @contextmanager
    def change(self, action: str, target: dict[str, Any], details: dict[str, Any] | None = None
               ) -> Iterator[AuditRecord]:
        """Record, then make the change (the ``with`` body); a body that raises adds a ``failed`` record. The event
        is sent after a change that went through."""
        try:
            rec = self.write(action, target, details)
        except AuditError as e:
            raise AuditError(f"{e}, then run it again: the change was not made") from e.__cause__
        try:
            yield rec
        except BaseException as e:
            try:
                self.write(action, target, {"error": f"{type(e).__name__}: {e}"[:2000]}, status="failed", ref=rec.id)
            except AuditError as err:
                log.error("%s", err)
            raise
        self.announce(rec)

    def announce(self, rec: AuditRecord) -> None:
        if self.emit is None:
            return
        try:
            self.emit(rec)
        except Exception as e:  # noqa: BLE001 - the store's record stands; the event is a notification
            log.warning("audit %s %s: the event could not be sent (%s: %s); the record is in %s", rec.action, rec.id,
                        type(e).__name__, e, self.store.url(rec.key))

    def read(self, since: dt.datetime | None = None, action: str | None = None) -> list[AuditRecord]:
        """Every record at or after ``since`` (UTC), of ``action`` (or actions under ``action.``), oldest first.
        Keys carry their time, so objects before ``since`` are left unread."""
        found = []
        for key in self.store.list(AUDIT_PREFIX):
            m = _KEY.search(key)
            if not m:
                continue  # a stray object; records are only what rlpipe names this way
            stamp = dt.datetime.strptime(m.group(1), "%Y%m%dT%H%M%S.%fZ").replace(tzinfo=dt.timezone.utc)
            if since is None or stamp >= since:
                found.append((stamp, m.group(2), key))
        out = []
        for _, _, key in sorted(found):
            for text in self.store.get_bytes(key).decode().splitlines():
                rec = AuditRecord.parse(text, self.store.url(key))
                if action is None or rec.action == action or rec.action.startswith(action + "."):
                    out.append(rec)
        return out


def set_tag(setter: Callable[[str, str], Any], rec: AuditRecord, what: str) -> None:
    """Leave :func:`tag` on what a change touched (``setter(key, value)``: an MLflow client's tag call bound to a
    version, model or run). A tag that cannot be set is logged as an error; the store holds the record."""
    try:
        setter(*tag(rec))
    except Exception as e:  # noqa: BLE001
        log.error("audit %s %s: the MLflow tag on %s could not be set (%s: %s); the record is in the audit log",
                  rec.action, rec.id, what, type(e).__name__, e)


def move_alias(audit: AuditLog, tracker: Any, name: str, alias: str, version: str, *, action: str = "alias.move",
               why: str = "") -> AuditRecord | None:
    """Point ``alias`` of registered model ``name`` at ``version`` (``tracker``: a
    :class:`rlpipe.tracking.mlflow_utils.Tracker`), recorded before it moves, with where it pointed before; the
    version gets the tag. None, and nothing written, when the alias is there already."""
    old = tracker.version_by_alias(name, alias)
    if old is not None and str(old.version) == str(version):
        return None
    details = {"from": old.version if old else None, "to": str(version)} | ({"why": why} if why else {})
    with audit.change(action, {"model": name, "alias": alias, "version": str(version)}, details) as rec:
        tracker.set_alias(name, alias, str(version))
    set_tag(lambda k, v: tracker.client.set_model_version_tag(name, str(version), k, v), rec, f"{name} v{version}")
    return rec


def _short(target: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in target.items() if not isinstance(v, (list, dict)))[:200] or "-"


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``--since``: a duration back from now (``90m``, ``12h``, ``7d``, ``2w``) or a UTC date/time
    (``2026-12-01``, ``2026-12-01T09:30``)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    if m := _DURATION.match(text.strip()):
        return now - dt.timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected a duration (90m, 12h, 7d, 2w) or a UTC date "
                         "(2026-12-01, 2026-12-01T09:30)") from None
    return when.replace(tzinfo=dt.timezone.utc) if when.tzinfo is None else when.astimezone(dt.timezone.utc)
