"""Ordinary use of the sandbox: what well-behaved code sees, the result fields, fallbacks, the CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading

import pytest

from rlpipe.sandbox import SandboxLimits, SandboxResult, SandboxUnavailableError, isolation_report, run_python
from rlpipe.sandbox import _detect, _run
from tests.sandbox.conftest import last_json, need


def test_full_isolation_is_available_here(report):
    if not report["full"]:
        pytest.skip(f"full sandbox isolation unavailable on this machine: {report['missing']}")
    assert report["level"] == "bwrap+seccomp+uid+rlimits+cgroup"
    assert report["would_run"]


def test_ok_run_with_stdout(report):
    r = run_python("print('hello', 6 * 7)")
    assert isinstance(r, SandboxResult)
    assert (r.status, r.exit_code, r.stdout, r.stderr, r.truncated) == ("ok", 0, "hello 42\n", "", False)
    assert r.isolation == report["level"]
    assert 0 < r.wall_s < 10 and 0 <= r.cpu_s < 5
    d = r.to_dict()
    assert set(d) == {"status", "exit_code", "stdout", "stderr", "wall_s", "cpu_s", "isolation", "truncated"}
    json.dumps(d)


def test_stdin_is_passed_through_even_when_large():
    data = "".join(f"line {i}\n" for i in range(100_000))  # ~1 MB, more than a pipe buffer
    code = "import sys\nlines = sys.stdin.read().splitlines()\nprint(len(lines), lines[0], lines[-1])"
    r = run_python(code, stdin=data)
    assert r.status == "ok", r
    assert r.stdout == "100000 line 0 line 99999\n"
    r = run_python("print(input()[::-1])", stdin="abc\n")
    assert r.stdout == "cba\n"


def test_unread_stdin_does_not_block():
    r = run_python("print('ignored stdin')", stdin="x" * 5_000_000)
    assert r.status == "ok" and r.stdout == "ignored stdin\n"


def test_exception_is_an_error_with_traceback():
    r = run_python("def f():\n    raise ValueError('boom')\nf()\n")
    assert r.status == "error"
    assert r.exit_code == 1
    assert "Traceback (most recent call last)" in r.stderr
    assert 'File "/work/main.py"' in r.stderr or "main.py" in r.stderr
    assert "ValueError: boom" in r.stderr


def test_syntax_error_is_an_error():
    r = run_python("def broken(:\n")
    assert r.status == "error" and "SyntaxError" in r.stderr


@pytest.mark.parametrize("code,status,exit_code", [
    ("import sys; sys.exit(0)", "ok", 0),
    ("import sys; sys.exit(3)", "error", 3),
    ("import os; os._exit(42)", "error", 42),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "killed", -11),
])
def test_exit_codes(code, status, exit_code):
    r = run_python(code)
    assert (r.status, r.exit_code) == (status, exit_code), r


def test_extra_files_are_visible_and_importable_and_argv_is_passed():
    files = {"helper.py": "X = 42\n", "pkg/__init__.py": "", "pkg/mod.py": "Y = 'y'\n", "data/in.txt": "hello\n"}
    code = textwrap.dedent("""
        import sys, helper
        from pkg.mod import Y
        print(helper.X, Y, open("data/in.txt").read().strip(), sys.argv[1:])
    """)
    r = run_python(code, files=files, argv=["--flag", "two words", "3"])
    assert r.status == "ok", r
    assert r.stdout == "42 y hello ['--flag', 'two words', '3']\n"


def test_each_run_has_a_fresh_private_work_dir():
    r1 = run_python("open('left.txt', 'w').write('x'); open('/tmp/left.txt', 'w').write('x'); print('w')")
    assert r1.status == "ok"
    r2 = run_python("import os; print(os.path.exists('left.txt'), os.path.exists('/tmp/left.txt'))")
    assert r2.stdout == "False False\n"


def test_ordinary_python_features_work_inside():
    code = textwrap.dedent("""
        import asyncio, json, multiprocessing as mp, subprocess, tempfile, threading
        def work(x):
            return x * x
        async def main():
            await asyncio.sleep(0.01)
            return "async"
        if __name__ == "__main__":
            ts = [threading.Thread(target=sum, args=(range(1000),)) for _ in range(4)]
            [t.start() for t in ts]; [t.join() for t in ts]
            with mp.Pool(2) as pool:
                squares = pool.map(work, range(5))
            ls = subprocess.run(["ls"], capture_output=True, text=True).stdout.split()
            with tempfile.NamedTemporaryFile() as fh:
                fh.write(b"x")
            print(json.dumps({"squares": squares, "ls": ls, "async": asyncio.run(main())}))
    """)
    r = run_python(code)
    assert r.status == "ok", r
    assert last_json(r.stdout) == {"squares": [0, 1, 4, 9, 16], "ls": ["main.py"], "async": "async"}


def test_non_utf8_output_is_replaced_not_fatal():
    r = run_python("import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')")
    assert r.status == "ok"
    assert r.stdout.startswith("ok ") and r.stdout.endswith(" end\n") and "\ufffd" in r.stdout


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        run_python("pass", files={"../escape.py": "x"})
    with pytest.raises(ValueError):
        run_python("pass", files={"/etc/passwd": "x"})
    with pytest.raises(ValueError):
        run_python("pass", files={"main.py": "x"})
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError):
        SandboxLimits(memory_mb=8)


def test_concurrent_calls_from_threads():
    results = [None] * 4

    def go(i):
        results[i] = run_python(f"print({i})")

    ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]


def test_degraded_level_is_loud_and_named(report, monkeypatch, caplog):
    need(report, "bwrap")
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "bwrap")
    monkeypatch.setattr(_detect, "_warned_levels", set())
    with caplog.at_level(logging.WARNING, logger="rlpipe.sandbox"):
        r = run_python("print('fallback')")
    assert r.status == "ok" and r.stdout == "fallback\n"
    assert "bwrap" not in r.isolation and "rlimits" in r.isolation
    assert any("DEGRADED ISOLATION" in rec.getMessage() for rec in caplog.records)
    assert isolation_report()["missing"]["bwrap"].startswith("disabled by")


def test_strict_mode_refuses_a_weaker_level(report, monkeypatch):
    monkeypatch.setenv("RLPIPE_SANDBOX_STRICT", "1")
    if report["full"]:
        assert run_python("print(1)").status == "ok"
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "bwrap")
    with pytest.raises(SandboxUnavailableError):
        run_python("print(1)")
    assert isolation_report()["would_run"] is False


def test_import_has_no_side_effects(tmp_path):
    code = (
        f"import os, sys; os.chdir({str(tmp_path)!r})\n"
        "import rlpipe.sandbox, rlpipe.sandbox.cli\n"
        "from rlpipe.sandbox import _detect\n"
        "bad = [m for m in ('prefect', 'mlflow', 'boto3', 'vllm', 'deepspeed', 'torch', 'pyseccomp') if m in sys.modules]\n"
        "print(sorted(os.listdir('.')), bad, _detect._caps.peek() is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] [] True"


def test_cli_prints_one_json_object(tmp_path):
    from typer.testing import CliRunner

    from rlpipe.sandbox.cli import sandbox_app

    prog = tmp_path / "prog.py"
    prog.write_text("import sys\nprint(sys.stdin.read().upper())\n")
    inp = tmp_path / "in.txt"
    inp.write_text("hi")
    res = CliRunner().invoke(sandbox_app, ["run", str(prog), "--stdin", str(inp), "--timeout", "5", "--memory-mb", "128"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["status"] == "ok" and d["stdout"] == "HI\n" and d["exit_code"] == 0
    assert {"status", "exit_code", "stdout", "stderr", "wall_s", "cpu_s", "isolation", "truncated"} <= set(d)
    prog.write_text("while True: pass\n")
    d = json.loads(CliRunner().invoke(sandbox_app, ["run", str(prog), "--timeout", "1"]).stdout)
    assert d["status"] == "timeout"


def test_a_bubblewrap_setup_failure_is_not_blamed_on_the_code(report, monkeypatch):
    need(report, "bwrap")
    plan = _detect._plan_for_run()
    r = _run._execute("print(1)", "", SandboxLimits(), None, None, plan, binds=[("/nonexistent-rlpipe", "/x")])
    assert r.status == "error" and r.exit_code is None
    assert "sandbox setup failed" in r.stderr
    monkeypatch.setenv("RLPIPE_SANDBOX_STRICT", "1")
    monkeypatch.setattr(_run, "_execute", lambda *a, **k: r)
    with pytest.raises(SandboxUnavailableError):
        run_python("print(1)")
