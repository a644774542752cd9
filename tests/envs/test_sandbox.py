"""The sandbox against ordinary and hostile programs.

Hostile programs run with ``guard=False`` where the point is the kernel layers (the Python audit
hook would stop them first), and with the guard on where the point is the default behaviour.
Checks that need a layer this machine lacks are skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from envs import sandbox
from envs.sandbox import UID_BASE, UID_SPAN, SandboxError, SandboxLimits, isolation_layers, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

FAST = SandboxLimits(wall_s=2.0, cpu_s=2.0, memory_mb=256, max_processes=8)
ROOT = os.geteuid() == 0


def need(layer: str) -> None:
    if layer not in isolation_layers():
        pytest.skip(f"layer {layer!r} is not available here ({isolation_layers()})")


def sandbox_pids() -> list[int]:
    """Live (not zombie) processes running as a sandbox uid (meaningful when we are root)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uids, state = sandbox._proc_uids(name)
        except OSError:
            continue
        if state != "Z" and any(UID_BASE <= u < UID_BASE + UID_SPAN for u in uids):
            out.append(int(name))
    return out


def assert_no_leftovers() -> None:
    if not ROOT:
        return
    deadline = time.monotonic() + 2.0
    while sandbox_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_pids() == []


# --------------------------------------------------------------------------- ordinary programs


def test_stdout_stdin_exit_code_and_files() -> None:
    r = run_python(
        "import sys, helper\nprint(helper.twice(sys.stdin.read().strip()))\nsys.exit(3)",
        stdin="ab\n",
        files={"helper.py": "def twice(s):\n    return s * 2\n"},
    )
    assert r.stdout == "abab\n"
    assert r.exit_code == 3 and not r.ok
    assert not r.timed_out and r.killed == ""
    assert "rlimits" in r.layers


def test_success_and_traceback() -> None:
    ok = run_python("print('hi')")
    assert ok.ok and ok.stdout == "hi\n" and ok.stderr == "" and ok.exit_code == 0
    assert ok.cpu_s is not None and 0 <= ok.cpu_s < 2
    bad = run_python("def f():\n    return 1 / 0\nf()")
    assert bad.exit_code == 1 and not bad.ok and bad.killed == ""
    assert bad.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "main.py\", line 2, in f" in bad.stderr
    assert "sandbox.py" not in bad.stderr  # the bootstrap's frames are not shown


def test_large_stdin_and_sys_exit_message() -> None:
    data = "x" * 300_000
    r = run_python("import sys\nn = len(sys.stdin.read())\nprint(n)\nsys.exit('bye')", stdin=data)
    assert r.stdout == "300000\n"
    assert r.exit_code == 1 and r.stderr.strip() == "bye"


def test_runs_as_an_unprivileged_user_in_a_fresh_directory() -> None:
    r = run_python("import os\nprint(os.getuid(), os.getcwd(), sorted(os.listdir('.')))")
    uid, cwd, listing = r.stdout.split(" ", 2)
    assert listing.strip() == "['main.py']"
    assert not os.path.exists(cwd)  # removed afterwards
    if ROOT:
        assert UID_BASE <= int(uid) < UID_BASE + UID_SPAN
        assert "setuid" in r.layers


def test_concurrent_runs_are_independent() -> None:
    results: list[sandbox.SandboxResult] = []

    def go(i: int) -> None:
        results.append(run_python(f"import os\nprint({i}, os.getuid())"))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(r.stdout.split()[0]) for r in results) == [0, 1, 2, 3]
    if ROOT:
        assert len({r.stdout.split()[1] for r in results}) == 4  # one uid per run


def test_bad_arguments_and_setup_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError):
        run_python("pass", files={"../escape.py": ""})
    with pytest.raises(ValueError):
        run_python("pass", files={"/etc/x": ""})
    with pytest.raises(ValueError):
        run_python("pass", disable=("nonsense",))
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(SandboxError):
        run_python("pass")


# --------------------------------------------------------------------------- hostile programs

FORK_BOMB = """
import os, sys, time
failed = 0
for _ in range(200):
    try:
        os.fork()
    except OSError as e:
        failed += 1
        if failed == 1:
            print("fork failed:", e.strerror, flush=True)
time.sleep(30)
"""


def test_fork_bomb_is_bounded_and_cleaned_up() -> None:
    samples: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            samples.append(len(sandbox_pids()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run_python(FORK_BOMB, limits=FAST, guard=False)
    finally:
        stop.set()
        watcher.join()
    assert r.timed_out and r.killed == "wall time" and r.exit_code is None
    assert r.wall_s < FAST.wall_s + 1.5
    assert "fork failed: Resource temporarily unavailable" in r.stdout  # RLIMIT_NPROC said no
    if ROOT:
        assert 0 < max(samples) <= FAST.max_processes
    assert_no_leftovers()


def test_fork_is_refused_by_the_guard() -> None:
    r = run_python("import os\nos.fork()", limits=FAST)
    assert r.exit_code == 1 and "PermissionError: sandbox: os.fork is not allowed" in r.stderr
    r = run_python("import subprocess\nsubprocess.run(['true'])", limits=FAST)
    assert r.exit_code == 1 and "subprocess.Popen is not allowed" in r.stderr


def test_background_process_that_leaves_the_group_does_not_survive() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    r = run_python(code, limits=FAST, guard=False)
    assert r.ok and r.stdout == "parent done\n" and r.wall_s < 1.5
    assert_no_leftovers()


@pytest.mark.skipif(not ROOT, reason="the fallback reaper needs root")
def test_background_process_is_reaped_without_a_pid_namespace() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    r = run_python(code, limits=FAST, guard=False, disable=("pidns",))
    assert r.ok and "pidns" not in r.layers
    assert_no_leftovers()
    r = run_python(code + "time.sleep(60)", limits=FAST, guard=False, disable=("pidns",))
    assert r.timed_out
    assert_no_leftovers()


def test_infinite_loop_ends_by_wall_time() -> None:
    r = run_python("while True:\n    pass", limits=SandboxLimits(wall_s=1.5, cpu_s=30))
    assert r.timed_out and r.killed == "wall time" and r.exit_code is None and not r.ok
    assert 1.5 <= r.wall_s < 3.0
    r = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=1.0))
    assert r.timed_out and r.wall_s < 2.5
    assert_no_leftovers()


def test_cpu_limit() -> None:
    r = run_python("while True:\n    pass", limits=SandboxLimits(wall_s=10, cpu_s=1))
    assert r.killed == "cpu time" and not r.timed_out and r.exit_code is None
    assert r.wall_s < 5


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(4 * 1024**3)", "xs = []\nwhile True:\n    xs.append(bytearray(10 * 1024**2))"],
    ids=["one-block", "growing"],
)
def test_huge_allocation_fails(code: str) -> None:
    r = run_python(code, limits=FAST, guard=False)
    assert r.killed == "memory" and r.exit_code == 1 and not r.timed_out
    assert "MemoryError" in r.stderr


def test_network_to_a_local_listener_fails() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(0.3)
        port = srv.getsockname()[1]
        code = (
            "import socket\ns = socket.socket()\ns.settimeout(1)\n"
            f"s.connect(('127.0.0.1', {port}))\ns.sendall(b'hello')\nprint('connected')"
        )
        guarded = run_python(code, limits=FAST)
        assert "connected" not in guarded.stdout and guarded.exit_code == 1
        assert "socket.connect is not allowed" in guarded.stderr
        if "netns" in isolation_layers():
            kernel = run_python(code, limits=FAST, guard=False)
            assert "connected" not in kernel.stdout and kernel.exit_code == 1
            assert "Network is unreachable" in kernel.stderr
        with pytest.raises(TimeoutError):
            srv.accept()  # nothing ever reached the listener


@pytest.mark.parametrize("guard", [True, False])
def test_network_to_the_outside_fails(guard: bool) -> None:
    if not guard:
        need("netns")
    code = (
        "import socket\n"
        "for target in [('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(target, timeout=1)\n"
        "        print('connected', target)\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80)\n"
        "    print('resolved')\n"
        "except OSError as e:\n"
        "    print('no dns')\n"
    )
    r = run_python(code, limits=FAST, guard=guard)
    assert r.ok, r.stderr
    assert "connected" not in r.stdout and "resolved" not in r.stdout
    assert r.stdout.count("refused") == 2


def _write_attempts(targets: list[str]) -> str:
    return (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, e.strerror or e)\n"
        "os.symlink(%r, 'link')\n"
        "try:\n"
        "    open('link', 'w').write('pwned')\n"
        "    print('wrote through link')\n"
        "except OSError as e:\n"
        "    print('refused link', e)\n"
    )


@pytest.mark.parametrize("guard", [True, False])
def test_writing_outside_its_directory_fails(tmp_path: Path, guard: bool) -> None:
    tag = uuid.uuid4().hex
    owned = tmp_path / f"owned-{tag}.txt"  # a directory the test owns
    world = Path(f"/tmp/rollstream-sbx-escape-{tag}.txt")  # world-writable /tmp
    shm = Path(f"/dev/shm/rollstream-sbx-escape-{tag}")
    link_target = Path(f"/tmp/rollstream-sbx-link-{tag}.txt")
    if not guard and "readonly-fs" not in isolation_layers():
        pytest.skip("without a read-only mount namespace only the guard protects world-writable /tmp")
    code = _write_attempts([str(owned), str(world), str(shm)]) % str(link_target)
    try:
        r = run_python(code, limits=FAST, guard=guard)
        assert "wrote" not in r.stdout, r.stdout
        assert r.stdout.count("refused") == 4, (r.stdout, r.stderr)
        for p in (owned, world, shm, link_target):
            assert not p.exists()
    finally:
        for p in (world, shm, link_target):
            p.unlink(missing_ok=True)


def test_writing_inside_its_directory_works() -> None:
    r = run_python("import os\nos.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('x' * 1000)\n"
                   "print(os.path.getsize('a/b/f.txt'))", limits=FAST)
    assert r.ok and r.stdout == "1000\n"


def test_file_size_limit() -> None:
    code = "with open('big.bin', 'wb') as f:\n    for _ in range(100):\n        f.write(b'x' * 2**20)\nprint('done')"
    r = run_python(code, limits=SandboxLimits(wall_s=5, file_size_mb=4), guard=False)
    assert "done" not in r.stdout
    assert r.killed == "file size" and r.exit_code == 1
    assert "File too large" in r.stderr


def test_output_is_capped() -> None:
    limits = SandboxLimits(wall_s=5, max_output_bytes=10_000)
    r = run_python("while True:\n    print('y' * 1000)", limits=limits)
    assert r.killed == "output limit" and not r.timed_out and r.exit_code is None
    assert len(r.stdout) == 10_000 and r.wall_s < 2
    r = run_python("import sys\nwhile True:\n    sys.stderr.write('e' * 1000)", limits=limits)
    assert r.killed == "output limit" and len(r.stderr) == 10_000


def test_host_processes_are_invisible_and_unkillable() -> None:
    need("pidns")
    code = f"import os\ntry:\n    os.kill({os.getpid()}, 9)\n    print('killed')\nexcept OSError as e:\n    print('no', e.strerror)"
    r = run_python(code, limits=FAST, guard=False)
    assert r.stdout.startswith("no ")


def test_ctypes_is_refused_by_the_guard() -> None:
    r = run_python("import ctypes\nctypes.CDLL(None).getpid()", limits=FAST)
    assert r.exit_code == 1 and "ctypes" in r.stderr and "not allowed" in r.stderr


@pytest.mark.skipif(not ROOT, reason="needs root to switch to an unprivileged caller")
def test_works_for_an_unprivileged_caller() -> None:
    """The non-root path (user namespaces, no setuid), with a system Python nobody can run."""
    python = Path("/usr/bin/python3")
    if not python.exists():
        pytest.skip("no /usr/bin/python3 to run as nobody")
    with tempfile.TemporaryDirectory() as tmp:  # pytest's tmp_path is private to root
        Path(tmp).chmod(0o755)
        out = _run_as_nobody(python, Path(tmp) / "probe.py")
    uid, code, refused, *layers = out.stdout.split()
    assert uid == "65534" and code == "1" and refused == "True"
    assert "setuid" not in layers and "rlimits" in layers
    assert not Path("/tmp/x-nonroot-probe").exists()


def _run_as_nobody(python: Path, script: Path) -> subprocess.CompletedProcess[str]:
    # a copy of the module beside the script: the checkout itself may be private to root (mktemp -d)
    module = script.with_name("sandbox_copy.py")
    module.write_text(Path(sandbox.__file__).read_text())
    module.chmod(0o644)
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sb', {str(module)!r})\n"
        "sb = importlib.util.module_from_spec(spec); sys.modules['sb'] = sb; spec.loader.exec_module(sb)\n"
        "lim = sb.SandboxLimits(wall_s=3, max_processes=8, memory_mb=256)\n"
        "r = sb.run_python('import os\\nprint(os.getuid())\\nopen(\"/tmp/x-nonroot-probe\", \"w\")', limits=lim,"
        " guard=False)\n"
        "print(r.stdout.strip(), r.exit_code, 'Read-only' in r.stderr or 'Permission' in r.stderr, *r.layers)\n"
    )
    script.chmod(0o644)
    try:
        out = subprocess.run([str(python), str(script)], user=65534, group=65534, extra_groups=[],
                             capture_output=True, text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot run {python} as nobody: {e}")
    if out.returncode != 0 and "SyntaxError" in out.stderr:
        pytest.skip(f"{python} is too old for the sandbox module")
    assert out.returncode == 0, out.stderr
    return out
