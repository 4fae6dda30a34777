"""Running untrusted programs (the code the policy writes) in a bubblewrap sandbox.

Why bubblewrap: it is the smallest of the three isolation tools Debian packages (bubblewrap,
nsjail, firejail), a single binary with no configuration language and no daemon, it builds the
sandbox from nothing (every path the program may see is bound in explicitly, read-only), and it
runs without root through unprivileged user namespaces, as on most cluster nodes (Flatpak's
sandbox is built on it). nsjail adds cgroups and seccomp policies but is not packaged for
Debian 12; firejail starts from the host's file system and hides parts of it by profile, and
is setuid root.

Each program runs in a fresh sandbox:
- namespaces of its own: no network (an empty network namespace: not even the host's
  127.0.0.1), its own process ids (it cannot see or signal the host's processes, and all it
  started dies with it), IPC, UTS and user namespaces;
- the file system: the interpreter, its standard library and the shared libraries read-only
  (no other program of the system: a compilation alone sees all of /usr), a private /proc and
  /dev, a size-limited tmpfs /tmp as its only writable place (gone when it ends), its program
  read-only in /sandbox; no home, no checkpoints, no data;
- limits: wall time (the sandbox is killed, and with it every process in it), CPU time,
  address space, processes, file size and the output read (more is a failure, and the program
  is killed);
- as root, megarl runs the sandbox under an unprivileged uid of its own (so the process limit
  counts only the sandbox's processes; root's would not be limited at all).

Main entry points: `LocalSandbox`, `Limits`, `RunResult`.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

# what a program's run ends as
OK, FAILED, TIMEOUT, OUTPUT_LIMIT = "ok", "failed", "timeout", "output_limit"
UID_BASE_ENV = "MEGARL_SANDBOX_UID_BASE"


def _uid_base() -> int:
    """As root, the sandbox's uid is one of 1000 from here: 61000, or $MEGARL_SANDBOX_UID_BASE
    where those uids belong to someone (or another job on the node should have its own)."""
    value = os.environ.get(UID_BASE_ENV, "61000")
    try:
        base = int(value)
    except ValueError:
        base = -1
    if not 1000 <= base <= 2**31 - 1001:
        raise ValueError(f"{UID_BASE_ENV}={value!r}: must be an integer uid from 1000 to {2**31 - 1001} "
                         "(the first of the 1000 uids the sandbox runs under as root)")
    return base


SANDBOX_UID_BASE = _uid_base()
BWRAP_ENV = {"PATH": "/usr/bin:/bin"}  # bubblewrap's own environment: nothing of the caller's
_counter = itertools.count()
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """The limits of one run of a program (one test case)."""

    wall_s: float = 5.0  # the sandbox is killed after this
    cpu_s: int = 4  # CPU seconds of each process (RLIMIT_CPU)
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    processes: int = 32  # processes and threads at once (RLIMIT_NPROC of the sandbox's uid)
    output_bytes: int = 1 << 20  # stdout read; more ends the run as output_limit
    file_mb: int = 16  # the size of /tmp, and of any one file written (RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"sandbox limit {name}={value} must be > 0")


@dataclass
class RunResult:
    status: str  # ok (exit 0) | failed (another exit or a signal) | timeout | output_limit
    stdout: str
    stderr: str  # its last 4 KiB
    exit_code: int | None
    wall_s: float


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create a sandbox on this machine."""


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: `make setup` installs it on Debian/Ubuntu as "
                                 "root (apt-get install bubblewrap); elsewhere install your distribution's package")
    return path


def default_python() -> str:
    """The interpreter programs run with: the system's python3, else the base interpreter of this one."""
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else getattr(sys, "_base_executable", sys.executable)


@cache
def runtime_paths(python: str) -> list[str]:
    """What a program needs at run time: the interpreter and its standard library (a whole
    prefix when it is not under /usr), and the directories of shared libraries."""
    prefix = Path(python).parent.parent
    if str(prefix) != "/usr":
        paths = [str(prefix)]
    else:
        stdlib = subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        paths = [python, stdlib]
    libs = Path("/usr/lib")
    paths += sorted(str(d) for d in libs.iterdir() if d.is_dir() and d.name.endswith(("-linux-gnu", "-linux-gnueabihf")))
    paths += [d for d in ("/usr/lib64", "/usr/lib32") if Path(d).is_dir() and not Path(d).is_symlink()]
    return paths


class LocalSandbox:
    """Runs programs in bubblewrap sandboxes on this machine (see the module docstring)."""

    def __init__(self, limits: Limits = Limits(), *, python: str | None = None, bwrap: str | None = None):
        self.limits = limits
        self.bwrap = bwrap or find_bwrap()
        self.python = os.path.realpath(python or default_python())
        self._checked = False

    def check(self) -> None:
        """Raise SandboxUnavailable unless a sandbox can be made here (once per instance)."""
        if self._checked:
            return
        result = self._run([self.python, "-I", "-c", "print('ok')"], "", None, None, self.limits)
        if result.stdout.strip() != "ok":
            raise SandboxUnavailable(f"bubblewrap cannot create a sandbox on this machine ({result.status}, exit "
                                     f"{result.exit_code}): {result.stderr.strip()[-500:]}")
        self._checked = True

    def binds(self, full: bool = False) -> list[str]:
        """bwrap's arguments for the read-only system a program sees: the interpreter, its
        standard library and the shared libraries (`full`: all of /usr, for a compiler), with the
        top-level links into /usr."""
        args = []
        for path in (["/usr"] if full else runtime_paths(self.python)):
            args += ["--ro-bind", path, path]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            path = Path(top)
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), top]
            elif path.is_dir():
                args += ["--ro-bind", top, top]
        for extra in ("/etc/ld.so.cache", "/etc/alternatives") if full else ("/etc/ld.so.cache",):
            if Path(extra).exists():
                args += ["--ro-bind", extra, extra]
        return args

    def command(self, argv: list[str], program_dir: Path | None, writable_dir: Path | None = None) -> list[str]:
        """The bwrap command line; a run with a writable directory (a compilation) sees all of /usr."""
        limits = self.limits
        cmd = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", *self.binds(writable_dir is not None),
               "--proc", "/proc", "--dev", "/dev", "--size", str(limits.file_mb << 20), "--tmpfs", "/tmp",
               "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
               "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        if program_dir is not None:
            cmd += ["--ro-bind", str(program_dir), "/sandbox"]
        if writable_dir is not None:  # a compiler's output
            cmd += ["--bind", str(writable_dir), "/build"]
        # the sandbox's own root (where bwrap made /usr and the other mount points) read-only too:
        # /tmp, of a bounded size, stays the only place to write
        return [*cmd, "--remount-ro", "/", "--", *argv]

    def run(self, argv: list[str], stdin: str = "", program_dir: Path | None = None, *,
            writable_dir: Path | None = None, limits: Limits | None = None) -> RunResult:
        """Run `argv` (paths as the sandbox sees them: /sandbox is `program_dir`, read-only)."""
        self.check()
        return self._run(argv, stdin, program_dir, writable_dir, limits or self.limits)

    def _run(self, argv, stdin, program_dir, writable_dir, limits: Limits) -> RunResult:
        sandbox = self if limits == self.limits else LocalSandbox(limits, python=self.python, bwrap=self.bwrap)
        uid = SANDBOX_UID_BASE + (os.getpid() * 7 + next(_counter)) % 1000 if os.geteuid() == 0 else None
        for path in (program_dir, writable_dir):
            if path is not None and uid is not None:
                _readable_by(path, uid, writable=path == writable_dir)
        # the user's own processes count toward RLIMIT_NPROC when megarl is not root: room for this many more
        processes = limits.processes + (0 if uid is not None else _processes_of(os.getuid()))
        start = time.monotonic()
        try:
            # bwrap gets no environment of megarl's: it is PID 1 in the sandbox, and --clearenv clears
            # only its child's, so the program could read the run's keys in /proc/1/environ
            proc = subprocess.Popen(sandbox.command(argv, program_dir, writable_dir), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env=BWRAP_ENV, preexec_fn=lambda: _enter_limits(limits, uid, processes))
        except OSError as e:
            raise SandboxUnavailable(f"cannot start bubblewrap: {e}") from e
        feeder = threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True)
        feeder.start()
        deadline = start + limits.wall_s
        out, err, status = _collect(proc, deadline, limits.output_bytes)
        if status is None:  # its output closed; it may still run (a program that closed its stdout and sleeps)
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = TIMEOUT
        if status is not None:
            _kill(proc)
        code = proc.wait()
        if uid is not None:
            _end_processes_of(uid)
        feeder.join(timeout=1)
        if status is None:
            status = OK if code == 0 else FAILED
        return RunResult(status, out.decode(errors="replace"), err[-4096:].decode(errors="replace"),
                         None if status in (TIMEOUT, OUTPUT_LIMIT) else code, time.monotonic() - start)

    def run_python(self, source: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
        """A Python program, isolated from site-packages and the environment (python -I)."""
        with program(source, "main.py") as directory:
            return self.run([self.python, "-I", "/sandbox/main.py"], stdin, directory, limits=limits)


@contextmanager
def program(text: str, name: str) -> Iterator[Path]:
    """A temporary host directory holding one file, `name` with `text`, removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="megarl-sandbox-"))
    try:
        (directory / name).write_text(text)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _readable_by(path: Path, uid: int, writable: bool) -> None:
    """Let the sandbox's uid into `path` (a megarl temporary directory): owned by it when the
    sandbox writes there, else readable by all."""
    if writable:
        os.chown(path, uid, uid)
    else:
        os.chmod(path, 0o755)
        for child in path.iterdir():
            os.chmod(child, 0o755 if child.is_dir() or os.access(child, os.X_OK) else 0o644)


def _enter_limits(limits: Limits, uid: int | None, processes: int) -> None:
    """In the child before bubblewrap starts (inherited by everything in the sandbox); system
    calls only (the parent may have threads)."""
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def _pids_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                pass  # it ended while we looked
    return pids


def _processes_of(uid: int) -> int:
    count = 0
    for pid in _pids_of(uid):
        try:
            count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count


def _running(pid: int) -> bool:
    """Not a zombie (a zombie has ended: it waits for its parent, or the system's init once
    orphaned, to reap it, which may take seconds; nothing can kill it sooner)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # the state, after the command name in parentheses


def _end_processes_of(uid: int, wait_s: float = 10.0) -> None:
    """Once bubblewrap has exited, its namespace's processes are still being torn down by the
    kernel (a fork bomb's many take a while on a busy machine): kill what still runs under the
    sandbox's uid and wait until nothing does, so that no process outlives its case. (The
    namespace's init, orphaned when bubblewrap exits, stays a zombie until the system's init
    reaps it: nothing is waited for that.)"""
    end = time.monotonic() + wait_s
    while pids := [pid for pid in _pids_of(uid) if _running(pid)]:
        if time.monotonic() > end:
            log.warning("sandbox uid %d: %d processes still there %.0f s after their sandbox was killed (pids %s)",
                        uid, len(pids), wait_s, pids[:10])
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the program stopped reading: its output says what it did
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _collect(proc: subprocess.Popen, deadline: float, output_bytes: int) -> tuple[bytes, bytes, str | None]:
    """stdout and stderr until both close; status TIMEOUT past `deadline`, OUTPUT_LIMIT past
    `output_bytes` of stdout (None: neither)."""
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), TIMEOUT
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if key.data is out and len(out) > output_bytes:
                    return bytes(out[:output_bytes]), bytes(err), OUTPUT_LIMIT
                if key.data is err and len(err) > 1 << 16:
                    del err[: len(err) - (1 << 15)]
    return bytes(out), bytes(err), None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bubblewrap's session: its init dies, and with it every process in the sandbox."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass



LANGUAGES = ("python", "cpp")
COMPILE_LIMITS = Limits(wall_s=60.0, cpu_s=60, memory_mb=2048, processes=32, output_bytes=1 << 16, file_mb=64)


def run_cases(sandbox: LocalSandbox, language: str, source: str, inputs: list[str],
              limits: Limits | None = None) -> list[RunResult]:
    """Run one program on each input, each in a fresh sandbox: Python as it is, C++ compiled
    once (g++ -O2, in a sandbox of its own) when the machine has a compiler. A program that does
    not compile fails every case with the compiler's message."""
    if language not in LANGUAGES:
        raise ValueError(f"language {language!r}: the sandbox runs {list(LANGUAGES)}")
    if language == "python":
        with program(source, "main.py") as directory:
            return [sandbox.run([sandbox.python, "-I", "/sandbox/main.py"], stdin, directory, limits=limits)
                    for stdin in inputs]
    compiler = shutil.which("g++")
    if compiler is None or not compiler.startswith("/usr/"):
        raise SandboxUnavailable("C++ needs g++ under /usr (Debian: apt-get install g++)")
    with program(source, "main.cpp") as directory, tempfile.TemporaryDirectory(prefix="megarl-build-") as build:
        built = sandbox.run([compiler, "-O2", "-std=c++17", "-o", "/build/main", "/sandbox/main.cpp"], "", directory,
                            writable_dir=Path(build), limits=COMPILE_LIMITS)
        if built.status != OK:
            failed = RunResult(FAILED, "", "compilation failed: " + built.stderr[-2000:], built.exit_code, built.wall_s)
            return [failed for _ in inputs]
        return [sandbox.run(["/sandbox/main"], stdin, Path(build), limits=limits) for stdin in inputs]
