"""Run untrusted Python in a sandbox: CPU, memory, file-size, process and time limits, no network.

Shared by the ``code_tests`` verifier (:mod:`envs.code`) and the ``tool_use`` environment's
``python`` tool. API: :func:`run_python` (with :class:`SandboxLimits`, returning a
:class:`SandboxResult`) and :func:`isolation_layers` (the layers this machine provides).

Each run is a fresh child interpreter (``-I -S -B``, a minimal environment, its own process group,
output read with a size cap, a wall-clock deadline the parent enforces) in a temporary working
directory; this file run as a script is its *bootstrap*, which sets the sandbox up and forks an
*init* that forks the *worker* running the user code. The kernel layers, outer to inner: a new
network namespace (no interface up: every ``connect`` fails), a PID namespace (everything left is
killed with the run), a mount namespace in which every mount is read-only but the working
directory (and ``/proc`` and IPC private), a per-run unprivileged uid when run as root (else a
user namespace, capabilities dropped), ``no_new_privs``, and rlimits (CPU, address space, file
size, processes, open files; per process). An audit hook (``guard``) refuses network, process
creation, ``ctypes`` and writes outside the working directory with clear messages; it is a
tripwire, **not a security boundary**. A namespace the kernel refuses is skipped and
``SandboxResult.layers`` says so; a setup failure that would leave the code with more privilege
than intended raises :class:`SandboxError`, while the program's own failures never raise.

The full account (each layer, the fallbacks, what is not limited, measured costs) is in
docs/rewards.md, "The sandbox".
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

__all__ = [
    "UID_BASE",
    "UID_SPAN",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "isolation_layers",
    "run_python",
]

UID_BASE = 1_900_000_000
"""First uid (and gid) of the range per-run sandbox users are drawn from when running as root."""
UID_SPAN = 100_000_000
"""Size of that range."""
_NOBODY = 65534

MAIN = "main.py"
"""Name of the user program in the working directory."""

_EXIT_SETUP = 121  # the bootstrap could not set the sandbox up (details on the control pipe)

# Linux constants (stable ABI).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
_SYS_MOUNT_SETATTR = 442  # same number on x86_64 and the asm-generic architectures (aarch64, riscv)
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_LAYERS_NS = {"netns": _CLONE_NEWNET, "pidns": _CLONE_NEWPID, "mountns": _CLONE_NEWNS, "ipcns": _CLONE_NEWIPC}


class SandboxError(RuntimeError):
    """The sandbox could not be set up (never raised for anything the program does)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run. Kernel limits are per process (see the module doc)."""

    wall_s: float = 5.0
    """Wall-clock seconds for the whole run, enforced by the parent (kills every process)."""
    cpu_s: float = 5.0
    """CPU seconds per process (``RLIMIT_CPU``, rounded up to whole seconds): SIGXCPU, then SIGKILL."""
    memory_mb: int = 512
    """Address space per process in MiB (``RLIMIT_AS``); Python raises ``MemoryError`` beyond it."""
    file_size_mb: int = 8
    """Largest file a process may write, in MiB (``RLIMIT_FSIZE``); bigger writes fail (EFBIG)."""
    max_processes: int = 32
    """Processes *and threads* of the sandbox user at once (``RLIMIT_NPROC``), the worker included."""
    max_open_files: int = 256
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    max_output_bytes: int = 65536
    """Bytes kept of stdout and of stderr each; the run is killed when either overflows."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "max_processes", "max_open_files",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r} must be > 0")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb} is too small for Python (>= 64)")
        if self.max_open_files < 16:
            raise ValueError(f"SandboxLimits.max_open_files={self.max_open_files} must be >= 16")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The worker's exit status; ``None`` when a signal or the parent ended it."""
    timed_out: bool
    """The wall-clock limit was reached (then ``killed == "wall time"``)."""
    killed: str
    """Which limit ended or broke the run: ``""`` (none), ``"wall time"``, ``"cpu time"``,
    ``"memory"`` (``MemoryError``), ``"file size"``, ``"output limit"``, or ``"signal SIGSEGV"`` etc.
    ``"memory"`` and ``"file size"`` are read from the end of stderr (best effort)."""
    wall_s: float
    """Seconds from start to end of the run (sandbox setup included)."""
    cpu_s: float | None = None
    """CPU seconds (user + system) of the worker and its waited-for children, when known."""
    layers: tuple[str, ...] = ()
    """Isolation layers that were active (see the module doc)."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Why layers that were tried are missing."""

    @property
    def ok(self) -> bool:
        """The program exited with status 0 within every limit."""
        return self.exit_code == 0 and not self.killed and not self.timed_out


# =========================================================================== parent side


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    files: dict[str, str] | None = None,
    guard: bool = True,
    disable: tuple[str, ...] = (),
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandbox and return what happened.

    ``stdin`` is fed to the program; ``files`` (relative path -> text) are written to its working
    directory first (importable: the directory is on ``sys.path``). ``guard`` installs the Python
    audit-hook guard. ``disable`` names layers to leave out (``"netns"``, ``"pidns"``,
    ``"mountns"``, ``"ipcns"``, ``"setuid"``), for tests and debugging only (without ``"setuid"``
    a root caller runs the program as root: never do that with untrusted code). Never raises for the
    program's behaviour; raises :class:`SandboxError` when the sandbox cannot be set up and
    ``ValueError`` for bad arguments.
    """
    import shutil
    import tempfile
    import time

    limits = limits or SandboxLimits()
    unknown = sorted(set(disable) - {*_LAYERS_NS, "setuid"})
    if unknown:
        raise ValueError(f"run_python: unknown layers in disable={unknown}")
    if not sys.executable or not os.path.exists(sys.executable):
        raise SandboxError(f"no Python interpreter to run (sys.executable={sys.executable!r})")
    t0 = time.monotonic()
    try:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="rollstream-sbx-"))
    except OSError as e:
        raise SandboxError(f"cannot create the sandbox directory: {e}") from e
    try:
        uid = _pick_uid() if os.geteuid() == 0 and "setuid" not in disable else None
        _write_files(workdir, code, files or {}, uid)
        return _run(workdir, uid, stdin, limits, guard, disable, t0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_layers_cache: tuple[str, ...] | None = None


def isolation_layers() -> tuple[str, ...]:
    """The isolation layers this machine provides (one ``print(1)`` run, cached per process)."""
    global _layers_cache
    if _layers_cache is None:
        _layers_cache = run_python("print(1)", limits=SandboxLimits(wall_s=30.0)).layers
    return _layers_cache


def _pick_uid() -> int:
    """A random uid of the sandbox range that this (root) process can switch to, else nobody."""
    import random

    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        ranges = [(0, 0, 2**32 - 1)]

    def mapped(lo: int, n: int) -> bool:
        return any(start <= lo and lo + n <= start + count for start, _, count in ranges)

    if mapped(UID_BASE, UID_SPAN):
        return UID_BASE + random.SystemRandom().randrange(UID_SPAN)
    if mapped(_NOBODY, 1):
        return _NOBODY
    raise SandboxError("running as root but neither the sandbox uid range nor nobody (65534) is mapped")


def _write_files(workdir: str, code: str, files: dict[str, str], uid: int | None) -> None:
    entries = {MAIN: code}
    for name, text in files.items():
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm.startswith("..") or norm in (".", MAIN):
            raise ValueError(f"run_python: bad file name {name!r} (relative, inside the directory, not {MAIN})")
        entries[norm] = text
    for name, text in entries.items():
        path = os.path.join(workdir, name)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if uid is not None:
        for root, dirs, names in os.walk(workdir):
            for n in [*dirs, *names]:
                os.chown(os.path.join(root, n), uid, uid)
        os.chown(workdir, uid, uid)


def _site_dirs() -> list[str]:
    """The caller's site-packages directories (the sandbox starts with ``-S`` and gets these)."""
    import site

    try:
        dirs = list(site.getsitepackages())
    except AttributeError:  # some virtualenv-patched site modules
        dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [d for d in dirs if os.path.isdir(d)]


def _run(
    workdir: str, uid: int | None, stdin: str, limits: SandboxLimits, guard: bool,
    disable: tuple[str, ...], t0: float,
) -> SandboxResult:
    import selectors
    import subprocess
    import time

    ctl_r, ctl_w = os.pipe()
    cfg = {
        "workdir": workdir, "uid": uid, "parent_pid": os.getpid(), "ctl_fd": ctl_w, "guard": guard,
        "disable": list(disable), "site": _site_dirs(), "limits": {
            "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_size_mb": limits.file_size_mb,
            "max_processes": limits.max_processes, "max_open_files": limits.max_open_files},
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8"}
    argv = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(cfg)]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=workdir, env=env, start_new_session=True, pass_fds=(ctl_w,))
    except OSError as e:
        os.close(ctl_r)
        raise SandboxError(f"cannot start the sandbox interpreter {sys.executable}: {e}") from e
    finally:
        os.close(ctl_w)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = t0 + limits.wall_s
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray()}
    pending = memoryview(stdin.encode("utf-8"))
    killed = ""
    sel = selectors.DefaultSelector()
    in_fd = proc.stdin.fileno()
    try:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while sel.get_map() and not killed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "wall time"
                break
            for key, _ in sel.select(remaining):
                fd = int(key.fd)
                if fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BlockingIOError):
                            continue
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                buf += data
                if len(buf) > limits.max_output_bytes:
                    del buf[limits.max_output_bytes:]
                    killed = "output limit"
        if not killed:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                killed = "wall time"
    finally:
        if killed or proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        wall = time.monotonic() - t0
        messages = _read_messages(ctl_r)
        os.close(ctl_r)
        layers_msg = next((m for m in messages if "layers" in m), {})
        layers = (*layers_msg.get("layers", ()), *(m["layer"] for m in messages if "layer" in m))
        notes = (*layers_msg.get("notes", ()), *(m["note"] for m in messages if "note" in m))
        if uid is not None and "pidns" not in layers:
            _kill_uid(uid)  # init may have been killed before it could clean up
        # After a kill, the PID namespace dies asynchronously: wait (briefly) until every process
        # holding the output pipes is gone, so no sandbox process outlives this call.
        if in_fd in sel.get_map():
            sel.unregister(in_fd)
        end = time.monotonic() + 2.0
        while sel.get_map() and (left := end - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                try:
                    if not os.read(int(key.fd), 65536):
                        sel.unregister(key.fd)
                except OSError:
                    sel.unregister(key.fd)
        sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()

    errors = [m["error"] for m in messages if "error" in m]
    if errors and not killed:
        raise SandboxError(f"sandbox setup failed: {errors[0]}")
    status = next((m for m in messages if "status" in m), None)
    stdout = bytes(bufs[out_fd]).decode("utf-8", "replace")
    stderr = bytes(bufs[err_fd]).decode("utf-8", "replace")
    exit_code: int | None = None
    cpu_s: float | None = None
    sig = 0
    if status is not None:
        cpu_s = float(status.get("cpu_s", 0.0))
        if "exit" in status:
            exit_code = int(status["exit"])
        else:
            sig = int(status.get("signal", 0))
    elif not killed and proc.returncode is not None and proc.returncode < 0:
        sig = -proc.returncode
    if status is None and not killed and not sig:
        # Only possible where the program can reach its init (no PID namespace, not root): not a
        # setup failure, so report it rather than raise.
        killed = f"lost (the sandbox exited with status {proc.returncode} without reporting)"
    if not killed:
        killed = _classify(sig, cpu_s, stderr, limits)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code,
                         timed_out=killed == "wall time", killed=killed, wall_s=wall, cpu_s=cpu_s, layers=layers,
                         notes=notes)


def _read_messages(fd: int) -> list[dict[str, Any]]:
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
    out = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict):
                out.append(msg)
    return out


def _classify(sig: int, cpu_s: float | None, stderr: str, limits: SandboxLimits) -> str:
    tail = [line for line in stderr[-2000:].splitlines() if line.strip()][-1:]
    last = tail[0] if tail else ""
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s is not None and cpu_s >= math.ceil(limits.cpu_s)):
        return "cpu time"
    if sig == signal.SIGXFSZ or (not sig and "[Errno 27] File too large" in last):
        return "file size"
    if not sig and (last.startswith("MemoryError") or last.endswith("MemoryError")):
        return "memory"
    if sig:
        try:
            return f"signal {signal.Signals(sig).name}"
        except ValueError:
            return f"signal {sig}"
    return ""


def _proc_uids(pid: str) -> tuple[set[int], str]:
    uids: set[int] = set()
    state = ""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                uids = {int(x) for x in line.split()[1:]}
            elif line.startswith("State:"):
                state = line.split()[1]
    return uids, state


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process of ``uid`` (race-free via pidfds); used as root without a PID
    namespace, where a wall-clock kill may leave processes that left the process group."""
    import time

    for _ in range(100):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                uids, state = _proc_uids(name)
                if uid not in uids or state == "Z":
                    continue
                pidfd = os.pidfd_open(int(name))
            except OSError:
                continue
            try:
                uids, state = _proc_uids(name)  # the pid may have been reused before pidfd_open
                if uid in uids and state != "Z":
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    found = True
            except OSError:
                pass
            finally:
                os.close(pidfd)
        if not found:
            return
        time.sleep(0.01)


# =========================================================================== sandbox side
# Everything below runs in the child: ``python -I -B envs/sandbox.py CONFIG``.


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(libc: Any, option: int, arg: int) -> None:
    _check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _mount(libc: Any, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _mount_setattr(libc: Any, path: str, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    _check(libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE, ctypes.byref(attr),
                        ctypes.sizeof(attr)), f"mount_setattr {path}")


def _mountinfo() -> list[tuple[str, int]]:
    """(mount point, MS_* flags to keep) of every mount, parents first."""
    keep = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": _MS_NOATIME,
            "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME}
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point = parts[4].encode().decode("unicode_escape")
            flags = sum(keep.get(o, 0) for o in parts[5].split(","))
            out.append((point, flags))
    return out


def _make_readonly(libc: Any, workdir: str) -> str:
    """Every mount read-only except the working directory's bind mount. Returns how."""
    try:
        _mount_setattr(libc, "/", _MOUNT_ATTR_RDONLY, 0)
        _mount_setattr(libc, workdir, 0, _MOUNT_ATTR_RDONLY)
        return "mount_setattr"
    except OSError as e:
        if e.errno not in (38, 22):  # ENOSYS (kernel < 5.12), EINVAL
            raise
    failed = 0
    for point, flags in _mountinfo():
        if point == workdir or point.startswith(workdir + "/"):
            continue
        try:
            _mount(libc, None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
        except OSError:
            failed += 1
    if failed:
        raise OSError(f"{failed} mounts could not be remounted read-only")
    return "remount"


def _closed_ancestor(path: str) -> str | None:
    """The topmost ancestor of ``path`` that others cannot traverse, if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        anc = "/" + "/".join(parts[:i])
        try:
            if not os.stat(anc).st_mode & 0o001:
                return anc
        except OSError:
            return None
    return None


def _python_dirs() -> list[str]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable)), *(p for p in sys.path if p)}
    real = sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})
    return [d for d in real if not any(d != o and d.startswith(o + "/") for o in real)]


def _expose(libc: Any, paths: list[str]) -> list[str]:
    """Make ``paths`` reachable for an unprivileged uid: a tmpfs over each closed ancestor with
    bind mounts of the paths under it (done in the private mount namespace only)."""
    by_anc: dict[str, list[str]] = {}
    for p in paths:
        anc = _closed_ancestor(p)
        if anc is not None:
            by_anc.setdefault(anc, []).append(p)
    exposed = []
    for anc, under in by_anc.items():
        fds = {p: os.open(p, os.O_PATH) for p in under}
        _mount(libc, "tmpfs", anc, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for p, fd in fds.items():
            os.makedirs(p, mode=0o755, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
            os.close(fd)
            exposed.append(p)
    return exposed


def _setup_namespaces(libc: Any, cfg: dict[str, Any], layers: list[str], notes: list[str]) -> None:
    disable = set(cfg["disable"])
    wanted = {name: flag for name, flag in _LAYERS_NS.items() if name not in disable}
    if not wanted:
        return
    flags = sum(wanted.values())
    if os.geteuid() == 0:
        if libc.unshare(flags) == 0:
            layers.extend(wanted)
        else:  # find out which ones this kernel/container allows
            for name, flag in wanted.items():
                if libc.unshare(flag) == 0:
                    layers.append(name)
                else:
                    notes.append(f"{name}: {os.strerror(ctypes.get_errno())}")
        return
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags | _CLONE_NEWUSER) != 0:
        notes.append(f"userns: {os.strerror(ctypes.get_errno())} (no namespaces without root)")
        return
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    layers.extend(["userns", *wanted])


def _setup_mounts(libc: Any, cfg: dict[str, Any], layers: list[str], notes: list[str]) -> None:
    workdir = cfg["workdir"]
    try:
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
        if cfg["uid"] is not None:
            _expose(libc, _python_dirs())
        _mount(libc, workdir, workdir, None, _MS_BIND | _MS_REC)
        _make_readonly(libc, workdir)
        layers.append("readonly-fs")
    except OSError as e:
        notes.append(f"readonly-fs: {e}")


def _set_rlimits(lim: dict[str, Any]) -> None:
    cpu = max(1, math.ceil(lim["cpu_s"]))
    mem = int(lim["memory_mb"]) * 2**20
    fsize = int(lim["file_size_mb"]) * 2**20
    for res, soft, hard in (
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, int(lim["max_open_files"]), int(lim["max_open_files"])),
        (resource.RLIMIT_NPROC, int(lim["max_processes"]), int(lim["max_processes"])),
        (resource.RLIMIT_AS, mem, mem),
    ):
        _, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(res, (soft, hard))


def _send(fd: int, msg: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _drop_caps(libc: Any) -> None:
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


def _boot_main() -> NoReturn:
    """Entry point of the bootstrap (this file run as a script)."""
    cfg = json.loads(sys.argv[1])
    ctl = int(cfg["ctl_fd"])
    sys.path.extend(d for d in cfg["site"] if d not in sys.path)
    layers: list[str] = []
    notes: list[str] = []
    try:
        libc = _libc()
        _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != cfg["parent_pid"]:
            os._exit(_EXIT_SETUP)
        _setup_namespaces(libc, cfg, layers, notes)
        _prctl(libc, _PR_SET_DUMPABLE, 0)  # after writing our uid_map (needs /proc/self to be ours)
        if "mountns" in layers:
            _setup_mounts(libc, cfg, layers, notes)
        _set_rlimits(cfg["limits"])
        layers.append("rlimits")
    except Exception as e:
        _send(ctl, {"error": f"{type(e).__name__}: {e}"})
        os._exit(_EXIT_SETUP)
    _send(ctl, {"layers": [*layers, *(["setuid"] if cfg["uid"] is not None else []),
                           "no-new-privs", *(["guard"] if cfg["guard"] else [])], "notes": notes})
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _init(libc, cfg, ctl, layers)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _init(libc: Any, cfg: dict[str, Any], ctl: int, layers: list[str]) -> NoReturn:
    """PID 1 of the sandbox (when there is a PID namespace): start the worker, reap, report."""
    try:
        _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(libc, _PR_SET_CHILD_SUBREAPER, 1)
    except OSError as e:
        _send(ctl, {"error": f"init: {e}"})
        os._exit(_EXIT_SETUP)
    if "pidns" in layers and "mountns" in layers:
        try:
            _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY)
            _send(ctl, {"layer": "private-proc"})
        except OSError as e:
            _send(ctl, {"note": f"private-proc: {e}"})
    worker = os.fork()
    if worker == 0:
        _worker(libc, cfg, ctl, layers)
    status = None
    while True:
        try:
            pid, st, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == worker:
            status = (st, ru.ru_utime + ru.ru_stime)
            break
    if "pidns" not in layers:
        _reap_leftovers(cfg)
    if status is None:
        _send(ctl, {"error": "init: lost the worker"})
        os._exit(_EXIT_SETUP)
    st, cpu = status
    if os.WIFEXITED(st):
        _send(ctl, {"status": True, "exit": os.WEXITSTATUS(st), "cpu_s": cpu})
        os._exit(os.WEXITSTATUS(st))
    _send(ctl, {"status": True, "signal": os.WTERMSIG(st), "cpu_s": cpu})
    os._exit(128 + os.WTERMSIG(st))


def _reap_leftovers(cfg: dict[str, Any]) -> None:
    """Without a PID namespace: kill what the worker left behind (background processes)."""
    uid = cfg["uid"]
    if uid is not None:  # as root: kill(-1) from the sandbox uid reaches exactly its processes
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                for _ in range(3):  # atomic over the process list; forks racing it are aborted
                    os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)
        os.waitpid(pid, 0)
    while True:  # reap; without root, kill the orphans reparented to us (we are their subreaper)
        children: set[int] = set()
        with contextlib.suppress(OSError):
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/children") as f:
                    children.update(int(c) for c in f.read().split())
        for c in children:
            with contextlib.suppress(OSError):
                os.kill(c, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _worker(libc: Any, cfg: dict[str, Any], ctl: int, layers: list[str]) -> NoReturn:
    workdir = cfg["workdir"]
    uid = cfg["uid"]
    try:
        needed = _python_dirs()  # while we can still see them all
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise OSError(f"still uid {os.geteuid()} after setuid({uid})")
        elif "userns" in layers:
            _drop_caps(libc)
        _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
        os.chdir(workdir)
        if uid is not None:
            for d in needed:
                if not os.access(d, os.R_OK | os.X_OK):
                    raise OSError(f"the sandbox uid cannot read the Python installation at {d} (make it "
                                  "world-readable or allow mount namespaces)")
    except Exception as e:
        _send(ctl, {"error": f"worker: {type(e).__name__}: {e}"})
        os._exit(_EXIT_SETUP)
    os.close(ctl)
    if cfg["guard"]:
        _install_guard(workdir)
    _run_main(os.path.join(workdir, MAIN))


def _install_guard(workdir: str) -> None:
    """The Python audit-hook tripwire (see the module doc; not a security boundary)."""
    root = os.path.realpath(workdir)
    allowed_files = {"/dev/null", "/dev/stdout", "/dev/stderr"}
    blocked = frozenset({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
        "pty.spawn", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "ctypes.dlopen",
        "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer", "sys.remote_exec",
    })
    # event -> which arguments are paths that must be inside (a symlink's target may be anywhere)
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
                   "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                   "os.chflags": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "shutil.rmtree": (0,)}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fspath, join, getcwd = os.path.realpath, os.fspath, os.path.join, os.getcwd

    def inside(p: Any) -> bool:
        if isinstance(p, int):
            return True
        try:
            s = fspath(p)
            s = s.decode() if isinstance(s, bytes) else s
            if s in allowed_files:
                return True
            real = realpath(join(getcwd(), s))
        except Exception:
            return False
        return real == root or real.startswith(root + "/")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = (*args, None, None, None)[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
        elif event in path_events:
            for i in path_events[event]:
                if i < len(args) and not inside(args[i]):
                    p = args[i]
                    raise PermissionError(f"sandbox: {event} on {p!r} outside the working directory is not allowed")

    sys.addaudithook(hook)


def _run_main(path: str) -> NoReturn:
    import builtins
    import traceback
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            with contextlib.suppress(Exception):
                print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        try:
            traceback.print_exception(type(e), e, tb)
        except BaseException:
            with contextlib.suppress(BaseException):
                os.write(2, f"{type(e).__name__}\n".encode())
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    _boot_main()
