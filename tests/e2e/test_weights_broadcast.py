"""End to end: a rollout worker on "another node" gets every weight version over torch.distributed
(``train.weights_broadcast: gloo``) during a real ``rollstream run`` through the real broker.

The other node is this machine seen through Linux namespaces (``unshare``): the extra worker has a
host name of its own and a ``/dev/shm`` of its own (a private tmpfs), so the trainer's segments
are not there and the worker must receive them; it shares the network, the run folder and the
broker, as a node of a cluster would. It joins the run's ``tasks`` consumer group beside the run's
own rollout worker; in a second run the trainer is killed (``kill -9``) meanwhile. Needs root
(namespaces): skipped without it, except under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import SHORT, RunProc, assert_accounted, sql

pytestmark = pytest.mark.slow

NODE = "rs-other-node"
STEPS = 12


def namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    res = subprocess.run(["unshare", "--uts", "--mount", "--fork", "true"], capture_output=True)
    return res.returncode == 0


def stop(other: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker (``unshare --fork`` does not pass signals on: its child is the worker),
    then ``unshare``; SIGKILL after 60 s."""
    res = subprocess.run(["pgrep", "-P", str(other.pid)], capture_output=True, text=True)
    for pid in [int(p) for p in res.stdout.split()]:
        os.kill(pid, signal.SIGTERM)
    try:
        other.wait(60)
    except subprocess.TimeoutExpired:
        other.kill()
        other.wait(30)


@pytest.mark.parametrize("kill_trainer", [False, True], ids=["steady", "trainer-killed"])
def test_a_worker_on_another_node_receives_every_version_over_gloo(tmp_path: Path, bootstrap: str, repo_root: Path,
                                                                    kill_trainer: bool) -> None:
    """``trainer-killed``: ``kill -9`` of the trainer once the other node has received a version;
    the supervisor restarts it, it resumes from its checkpoint and serves at a new port, and the
    other node receives from that one on (a version announced by the dead trainer may go by disk)."""
    if not namespaces_work():
        if os.environ.get("CI") == "true":
            pytest.fail("unshare --uts --mount does not work here (needs root): this test must run in CI")
        pytest.skip("unshare --uts --mount needs root")
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-bcast-{uuid.uuid4().hex[:6]}"
    steps = 60 if kill_trainer else STEPS
    run = RunProc(runs, run_id, [*SHORT, f"train.steps={steps}", f"train.checkpoint_every={5 if kill_trainer else 0}",
                                 "train.weights_handoff=memory", "train.weights_broadcast=gloo"], env)
    deadline = time.monotonic() + 120
    while not (runs / run_id / "config.yaml").exists():  # the run exists: its services can start
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output()
        time.sleep(0.2)
    script = ('hostname "$0" && mount -t tmpfs -o size=256m tmpfs /dev/shm && '
              'exec "$1" -m cli service rollout --run "$2" --runs-dir "$3"')
    log = tmp_path / "other-node.log"
    with log.open("wb") as fh:
        other = subprocess.Popen(["unshare", "--uts", "--mount", "--fork", "--kill-child=SIGTERM", "sh", "-c", script,
                                  NODE, sys.executable, run_id, str(runs)], env=env, cwd=repo_root, stdout=fh,
                                 stderr=subprocess.STDOUT)
        try:
            if kill_trainer:
                while "received from gloo://" not in log.read_text(errors="replace"):
                    assert run.proc.poll() is None and time.monotonic() < deadline + 120, run.output()
                    time.sleep(0.2)
                time.sleep(1.0)
                run.kill_service("trainer")
            assert run.wait(600) == 0, run.output()
        finally:
            stop(other)
    text = log.read_text(errors="replace")
    received = re.findall(r"now at policy version (\d+) \(from shared memory, received from (gloo://[^)]+)\)", text)
    assert len({v for v, _ in received}) >= 2, text[-4000:]  # several versions, each received whole over gloo
    if kill_trainer:  # from both trainers, the restarted one at its own port
        assert len({url for _, url in received}) == 2 and "restarted trainer" in run.output(), text[-4000:]
    else:
        assert "from disk" not in text, text[-4000:]
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == steps
    assert_accounted(summary["samples"])
    rows = sql("SELECT countIf(worker_id LIKE '" + NODE + "-%') AS there, count() AS n FROM sample_generations",
               runs, run_id, env)
    # both nodes generated (on failure: what the run and both workers said, to tell a late or dead worker)
    here = (runs / run_id / "logs" / "rollout.log").read_text(errors="replace")
    assert rows[0]["there"] > 0 and rows[0]["there"] < rows[0]["n"], (rows, run.output()[-2000:], here[-3000:],
                                                                       text[-3000:])
