"""The audit log on a local folder and on SeaweedFS S3: a record per object, never rewritten; concurrent writers
all land; read back in time order with who, what and when; a change whose record cannot be written is not made;
``rlpipe audit`` prints it."""

from __future__ import annotations

import datetime as dt
import getpass
import json
import socket
import threading

import pytest
from typer.testing import CliRunner

from rlpipe.audit import AuditError, AuditLog, parse_since, who
from rlpipe.storage import open_store


@pytest.fixture
def store(local_or_s3_store):
    return local_or_s3_store


def test_a_record_says_who_what_and_when_and_a_second_never_overwrites_it(store):
    log = AuditLog(store)
    before = dt.datetime.now(dt.timezone.utc)
    first = log.write("alias.move", {"model": "m", "alias": "last", "version": "2"}, {"from": "1", "to": "2"})
    second = log.write("alias.move", {"model": "m", "alias": "last", "version": "3"}, {"from": "2", "to": "3"})
    assert first.key != second.key and len(store.list("audit")) == 2
    assert json.loads(store.get_bytes(first.key))["details"] == {"from": "1", "to": "2"}  # untouched by the second
    got = log.read()
    assert [r.id for r in got] == [first.id, second.id]
    rec = got[0]
    assert rec.who["user"] == getpass.getuser() and rec.who["host"] == socket.gethostname()
    assert before <= dt.datetime.fromisoformat(rec.time) <= dt.datetime.now(dt.timezone.utc)
    assert rec.target == {"model": "m", "alias": "last", "version": "2"} and rec.status == "ok"
    if not store.is_local:  # on S3 the identity is the access key the change was made with; its secret never
        assert rec.who["identity"] == "s3:rlpipe-test-key"
        assert "rlpipe-test-secret" not in store.get_bytes(rec.key).decode()


def test_concurrent_writers_all_land(store):
    logs = [AuditLog(store, actor=who(extra={"writer": str(w)})) for w in range(6)]
    errors: list[BaseException] = []

    def write(log: AuditLog) -> None:
        try:
            for k in range(4):
                log.write("gc.delete", {"prefixes": [f"runs/r/iter={k}"]})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = AuditLog(store).read()
    assert len(got) == 24 and len({r.id for r in got}) == 24
    assert sorted(r.who["writer"] for r in got) == sorted(str(w) for w in range(6) for _ in range(4))
    assert [r.time for r in got] == sorted(r.time for r in got)  # merged in time order


def test_a_failed_change_adds_a_failed_record_and_an_unwritable_log_stops_the_change(tmp_path):
    log = AuditLog(open_store(str(tmp_path / "store")))
    with pytest.raises(RuntimeError, match="registry down"):
        with log.change("alias.promote", {"model": "m", "alias": "best", "version": "4"}):
            raise RuntimeError("registry down")
    first, failed = log.read()
    assert failed.status == "failed" and failed.ref == first.id and "registry down" in failed.details["error"]

    broken = AuditLog(open_store(str(tmp_path / "broken")))
    (tmp_path / "broken" / "audit").write_text("a file where the log's folder should be")
    changed = []
    with pytest.raises(AuditError, match=r"alias.promote on model=m.*could not be written.*the change was not made"):
        with broken.change("alias.promote", {"model": "m", "alias": "best", "version": "4"}):
            changed.append(1)
    assert not changed


def test_events_are_sent_after_the_change_and_a_failing_sender_does_not_undo_it(tmp_path, caplog):
    sent = []
    log = AuditLog(open_store(str(tmp_path / "store")), emit=sent.append)
    with log.change("automations.install", {"prefect_api": "x"}) as rec:
        assert not sent  # not before the change is made
    assert sent == [rec]

    def refuse(_):
        raise ConnectionError("no API")

    quiet = AuditLog(log.store, emit=refuse)
    with quiet.change("automations.install", {"prefect_api": "x"}):
        pass
    assert len(quiet.read()) == 2 and "the event could not be sent (ConnectionError: no API)" in caplog.text


@pytest.mark.parametrize("text, expect", [
    ("90m", dt.datetime(2026, 12, 6, 10, 30, tzinfo=dt.timezone.utc)),
    ("2d", dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.timezone.utc)),
    ("1w", dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)),
    ("2026-12-01", dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)),
    ("2026-12-01T09:30", dt.datetime(2026, 12, 1, 9, 30, tzinfo=dt.timezone.utc)),
    ("2026-12-01T09:30+01:00", dt.datetime(2026, 12, 1, 8, 30, tzinfo=dt.timezone.utc)),
])
def test_since_takes_durations_and_dates(text, expect):
    assert parse_since(text, now=dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.timezone.utc)) == expect


def test_since_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="expected a duration"):
        parse_since("yesterday")


def test_the_command_prints_the_log_filtered_oldest_first(tmp_path, monkeypatch):
    from rlpipe.cli import app

    monkeypatch.setenv("RLPIPE_STORAGE_URI", str(tmp_path / "store"))
    monkeypatch.setenv("RLPIPE_ACTOR", "alice")
    log = AuditLog(open_store())
    old = log.write("gc.delete", {"prefixes": ["runs/a/iter=0", "runs/a/iter=1"]}, {"freed_bytes": 10})
    # a record from three days ago, written as the log names it
    stamp = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)
    aged = type(old)(**{**old.__dict__, "id": "0" * 32, "time": stamp.isoformat(timespec="microseconds")})
    log.store.put_bytes(aged.key, (aged.line() + "\n").encode())
    log.write("alias.move", {"model": "m", "alias": "last", "version": "2"}, {"from": "1", "to": "2"})

    res = CliRunner().invoke(app, ["audit"])
    assert res.exit_code == 0, res.output
    lines = [x for x in res.stdout.splitlines() if x.strip()]
    assert [x.split()[1] for x in lines] == ["gc.delete", "gc.delete", "alias.move"]
    assert "alice (" in lines[2] and "model=m" in lines[2] and "from=1 to=2" in lines[2]
    recent = CliRunner().invoke(app, ["audit", "--since", "1d", "--action", "alias", "--json"])
    assert [json.loads(x)["action"] for x in recent.stdout.splitlines()] == ["alias.move"]
    bad = CliRunner().invoke(app, ["audit", "--since", "soon"])
    assert bad.exit_code == 2 and "expected a duration" in bad.output
