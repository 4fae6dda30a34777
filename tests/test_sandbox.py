"""The code rewards' sandbox against hostile programs: each scores 0 on its test case, ends in
bounded time, and leaves the host as it was (no process left behind, no file written, nothing
read or reached). Every program is sent as a policy would send it: a response with a fenced
block, scored by compute_score("code", ...) on a case whose answer it never prints."""

from __future__ import annotations

import ast
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megarl.reward import compute_score
from megarl.reward.sandbox import FAILED, OK, OUTPUT_LIMIT, SANDBOX_UID_BASE, TIMEOUT, Limits, LocalSandbox

if shutil.which("bwrap") is None:  # make setup installs it (as root); CI must have it
    if os.environ.get("CI"):
        pytest.fail("bubblewrap is not installed: `make setup` should have installed it", pytrace=False)
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap", allow_module_level=True)

CASE = {"language": "python", "test_cases": [{"input": "1 2\n", "output": "3\n", "type": "stdin_stdout"}]}
LIMITS = Limits(wall_s=2.0, cpu_s=2, memory_mb=256, processes=16, output_bytes=1 << 16, file_mb=4)
BOUND_S = 10.0  # a hostile case ends well within this (the wall limit is 2 s)


def response(code: str) -> str:
    return f"<think>\nI will solve it.\n</think>\n<answer>\n```python\n{code}\n```\n</answer>"


def sandbox_processes() -> list[int]:
    """Processes of the sandbox uids megarl uses as root that still run (none may outlive a
    case); not zombies, which have ended and wait to be reaped (the namespace's init, orphaned
    when bubblewrap exits, waits for the system's init, seconds on some machines)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + 1000 and stat[stat.rindex(")") + 2] not in "ZX":
                found.append(int(entry.name))
    return found


def scored(code: str) -> tuple[float, float]:
    """(score, seconds) of a response whose program is `code`, under the test limits."""
    start = time.monotonic()
    score = compute_score("code", response(code), CASE, code_wall_s=LIMITS.wall_s, code_memory_mb=LIMITS.memory_mb)
    return score["score"], time.monotonic() - start


def assert_host_clean() -> None:
    """No sandbox process is left once its case has been scored (the sandbox waits for them)."""
    if os.geteuid() == 0:
        assert sandbox_processes() == []


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox(LIMITS)


def test_a_correct_program_scores_and_the_sandbox_is_clean():
    score, seconds = scored("a, b = map(int, input().split())\nprint(a + b)")
    assert score == 1.0 and seconds < BOUND_S


@pytest.mark.parametrize("name, code, status", [
    ("endless loop", "while True:\n    pass", TIMEOUT),
    ("sleep past the wall limit", "import time\ntime.sleep(60)\nprint(3)", TIMEOUT),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", TIMEOUT),
    ("all memory", "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))", FAILED),
    ("1 GB to stdout", "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)", OUTPUT_LIMIT),
])
def test_a_hostile_program_scores_0_in_bounded_time_and_leaves_nothing(sandbox, name, code, status):
    score, seconds = scored(code)
    assert score == 0.0 and seconds < BOUND_S, (name, seconds)
    result = sandbox.run_python(code, "1 2\n")
    assert result.status == status, (name, result)
    assert_host_clean()
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the host can still start processes


def test_a_fork_bomb_meets_the_process_limit(sandbox):
    code = ("import os, time\nkids = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        kids += 1\n    except OSError:\n        break\n"
            "print(kids, flush=True)\nos._exit(0)")
    result = sandbox.run_python(code)
    assert result.status == OK and 0 < int(result.stdout) < LIMITS.processes  # refused at the limit
    assert_host_clean()  # the sleeping children died with the sandbox


def test_it_cannot_write_outside_its_temporary_directory(sandbox, tmp_path):
    target = tmp_path / "written.txt"
    code = ("import os\nfor path in [%r, '/usr/evil.txt', '/evil.txt', '/sandbox/evil.txt', '/root/evil.txt']:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as e:\n        print('denied', path, type(e).__name__)\n"
            "open('/tmp/mine.txt', 'w').write('ok')\nprint('tmp', open('/tmp/mine.txt').read())") % str(target)
    result = sandbox.run_python(code)
    assert result.status == OK and "wrote" not in result.stdout and "tmp ok" in result.stdout
    assert result.stdout.count("denied") == 5  # the sandbox's own root and /usr are read-only too
    assert not target.exists() and not Path("/usr/evil.txt").exists() and not Path("/tmp/mine.txt").exists()
    assert scored(code)[0] == 0.0


def test_it_cannot_read_the_users_files(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    code = ("import os\nfor path in [%r, os.path.expanduser('~'), '/root', '/home', '/work', '/etc/passwd']:\n"
            "    try:\n        print('read', path, open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
            "    except OSError as e:\n        print('denied', path, type(e).__name__)") % str(secret)
    result = sandbox.run_python(code)
    assert result.status == OK and "s3cret" not in result.stdout
    assert "read /tmp []" in result.stdout or "read" not in result.stdout.replace("read /tmp", "")
    assert all(f"denied {p}" in result.stdout for p in (str(secret), "/root", "/home", "/work", "/etc/passwd"))
    assert compute_score("code", response(code.replace("print('read', path,", "print(")),
                         {**CASE, "test_cases": [{"input": "", "output": "s3cret"}]})["score"] == 0.0


def test_it_cannot_reach_a_server_on_the_hosts_loopback(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = []

    def accept():
        server.settimeout(5)
        try:
            conn, _ = server.accept()
            received.append(conn.recv(100))
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = ("import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', %d), timeout=1)\n"
            "    s.sendall(b'hello')\n    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)"
            ) % port
    result = sandbox.run_python(code)
    assert result.status == OK and result.stdout.startswith("refused")
    assert scored(code)[0] == 0.0
    thread.join(timeout=6)
    server.close()
    assert received == []


def test_killing_its_parent_and_every_process_it_sees_leaves_the_host_alive(sandbox):
    sentinel = subprocess.Popen(["sleep", "30"])
    code = ("import os, signal\nprint('parent', os.getppid(), flush=True)\n"
            "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    if pid != os.getpid():\n        try:\n            os.kill(pid, signal.SIGKILL)\n"
            "        except OSError:\n            pass\n"
            "try:\n    os.kill(%d, signal.SIGKILL)\n    print('killed the host process')\nexcept OSError as e:\n"
            "    print('cannot', type(e).__name__)") % sentinel.pid
    try:
        result = sandbox.run_python(code)
        score, seconds = scored(code)
        assert sentinel.poll() is None  # the host's process lives on
        assert "killed the host process" not in result.stdout and score == 0.0 and seconds < BOUND_S
    finally:
        sentinel.kill()
        sentinel.wait()
    assert_host_clean()


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are megarl's own as root only")
def test_what_is_left_of_a_sandbox_uid_is_killed_and_waited_for():
    from megarl.reward.sandbox import _end_processes_of

    uid = SANDBOX_UID_BASE + 999

    def as_sandbox_uid():
        os.setgid(uid)
        os.setuid(uid)

    # a process of the uid that nothing else will end (what the kernel still tears down after bwrap)
    left = subprocess.Popen(["sleep", "60"], preexec_fn=as_sandbox_uid, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while left.pid not in sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert left.pid in sandbox_processes()
        reaper = threading.Thread(target=left.wait)  # its parent reaps it, as bwrap's init does
        reaper.start()
        _end_processes_of(uid)
        assert left.pid not in sandbox_processes()
        reaper.join(timeout=5)
        assert left.returncode == -9
    finally:
        left.kill()
        left.wait()


@pytest.mark.skipif(shutil.which("g++") is None, reason="C++ is scored where the machine has g++")
def test_cpp_compiles_once_and_a_broken_program_scores_0():
    cases = {"language": "cpp", "test_cases": [{"input": "1 2\n", "output": "3"}, {"input": "40 2\n", "output": "42"},
                                              {"input": "5 5\n", "output": "10"}]}
    good = "```cpp\n#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }\n```"
    wrong = good.replace("a + b", "(a == 5 ? 0 : a + b)")
    assert compute_score("code", good, cases)["score"] == 1.0
    assert compute_score("code", wrong, cases)["score"] == pytest.approx(2 / 3)
    assert compute_score("code", "```cpp\nint main( {\n```", cases)["score"] == 0.0
    bomb = "```cpp\n#include <unistd.h>\nint main() { while (true) fork(); }\n```"
    start = time.monotonic()
    assert compute_score("code", bomb, cases, code_wall_s=1.0)["score"] == 0.0
    assert time.monotonic() - start < 3 * BOUND_S
    assert_host_clean()


def test_a_program_that_closes_its_output_and_sleeps_is_still_timed_out(sandbox):
    start = time.monotonic()
    result = sandbox.run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)")
    assert result.status == TIMEOUT and time.monotonic() - start < BOUND_S
    assert_host_clean()


def test_it_sees_the_interpreter_and_no_other_program(sandbox):
    code = ("import os, shutil\nprint(sorted(os.listdir('/')))\n"
            "print([p for p in ('gcc', 'sh', 'bash', 'curl', 'apt-get', 'bwrap') if shutil.which(p, path='/usr/bin:/bin')])")
    result = sandbox.run_python(code)
    top, found = result.stdout.splitlines()
    assert result.status == OK and found == "[]"
    assert set(ast.literal_eval(top)) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "proc", "sandbox", "sbin", "tmp", "usr",
                              *Path(sandbox.python).parts[1:2]}  # a prefix of the interpreter outside /usr


@pytest.mark.parametrize("value, want", [("70000", 70000), ("1000", 1000), ("999", None), ("61k", None),
                                         (str(2**31 - 1000), None)])
def test_the_uid_range_moves_with_its_variable_and_a_bad_one_is_named(monkeypatch, value, want):
    from megarl.reward.sandbox import UID_BASE_ENV, _uid_base

    monkeypatch.setenv(UID_BASE_ENV, value)
    if want is None:
        with pytest.raises(ValueError, match=f"MEGARL_SANDBOX_UID_BASE={value!r}: must be an integer uid"):
            _uid_base()
    else:
        assert _uid_base() == want


def test_no_process_it_sees_holds_the_callers_environment(sandbox, monkeypatch):
    """bubblewrap itself (PID 1 in the sandbox, the parent of the program's process) starts with no
    environment of megarl's: a program reading every /proc/*/environ finds none of the caller's
    keys (the issue found MEGARL_SANDBOX_API_KEY, the retrieval key, OPENAI_API_KEY and HF_TOKEN)."""
    secrets = {"MEGARL_SANDBOX_API_KEY": "k-sandbox-61", "OPENAI_API_KEY": "k-openai-61", "HF_TOKEN": "k-hf-61"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    code = ("import os\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    try:\n        print(pid, open(f'/proc/{pid}/environ', 'rb').read().replace(b'\\0', b' ').decode())\n"
            "    except OSError as e:\n        print(pid, 'unreadable', type(e).__name__)")
    result = sandbox.run_python(code)
    assert result.status == OK and result.stdout.startswith("1 "), result
    assert not any(value in result.stdout + result.stderr for value in secrets.values()), result.stdout
    assert "PATH=/usr/bin:/bin" in result.stdout  # the program's own environment, set by bwrap, is there
