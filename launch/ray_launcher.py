"""``rollstream run --launcher ray``: the run's services as Ray actors, placed by ``placement``.

1. :func:`connect` imports Ray (one line naming ``pip install 'rollstream[ray]'`` when it is
   missing), joins the cluster at ``--address`` or starts a local instance, checks that every
   process's bundle fits the cluster's nodes under ``placement.strategy`` (:func:`check_fit`: one
   line naming the service and what no node has; Ray itself would wait forever) and reserves one
   placement group for the run: one bundle per service process (:func:`bundles`), in the order of
   :func:`launch.supervisor.run_labels`. All of it before anything of the run starts.
2. :class:`RaySupervisor` is the local :class:`~launch.supervisor.Supervisor` (progress,
   healing, stop/drain, summary) whose processes are :class:`RayProcess` handles: each is a Ray
   actor (:class:`ServiceHost`) in its bundle that runs the same ``rollstream service NAME --run
   ID`` command as the local launcher, as its child, with the same environment variables, logging to
   ``runs/<run_id>/logs/<label>.log`` (the run directory must be on storage every node sees at the
   same path). SIGTERM and SIGKILL reach that child through the actor; the child ends with its actor
   (``PR_SET_PDEATHSIG`` sends it SIGTERM; Ray may SIGKILL it first), which then counts as killed by
   SIGKILL. A restart is a new actor in the same bundle.
3. :meth:`RayCluster.close` kills what is left, removes the placement group and disconnects (which
   stops the local instance when this run started it).

Ray is imported only here, and only when ``--launcher ray`` is used.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from launch.healing import ServiceSlot, service_of
from launch.prepare import RunError
from launch.supervisor import LABEL_ENV, Supervisor, run_labels, service_command
from schemas.config import ConfigError, PlacementConfig, RunConfig
from schemas.errors import one_line
from schemas.services import SERVICES, value_at

RAY_MISSING = "--launcher ray needs Ray, which is not installed: pip install 'rollstream[ray]'"
EPS = 1e-6
"""Slack in resource comparisons (Ray keeps amounts to 1e-4)."""
POLL_TIMEOUT_S = 10.0
"""How long one poll or signal of a service's actor may take before it counts as busy, seconds."""
CHILD_ENV = ("PYTHONUNBUFFERED", "PYTHONHASHSEED")
"""Variables of the supervisor's service environment passed to every child besides ``ROLLSTREAM_*``."""


def require_ray() -> Any:
    """The ``ray`` module, or :class:`RunError` with the one line that says how to install it."""
    try:
        import ray
    except ImportError:
        raise RunError(RAY_MISSING) from None
    return ray


# --------------------------------------------------------------------------- placement (pure)


def bundle_of(p: PlacementConfig, service: str) -> dict[str, float]:
    """The Ray bundle of one process of ``service`` (its section of ``placement``, ``p``):
    ``{"CPU": cpus, "GPU": gpus, **resources}`` without zero amounts."""
    s = getattr(p, service)
    out = {"CPU": float(s.cpus), "GPU": float(s.gpus), **{k: float(v) for k, v in s.resources.items()}}
    return {k: v for k, v in out.items() if v > 0}


def bundles(cfg: RunConfig, labels: Sequence[str]) -> list[tuple[str, dict[str, float]]]:
    """``(label, bundle)`` per service process of the run, in ``labels`` order."""
    return [(label, bundle_of(cfg.placement, service_of(label))) for label in labels]


def check_reserves(cfg: RunConfig, labels: Sequence[str]) -> None:
    """Every process reserves something (Ray refuses an empty bundle), and a service whose device is
    an explicit ``cuda`` reserves a GPU (without one its process sees none): :class:`ConfigError`."""
    for label, b in bundles(cfg, labels):
        service = service_of(label)
        if not b:
            raise ConfigError(f"config: placement.{service} reserves nothing (cpus 0, gpus 0, no resources); "
                              f"a Ray bundle needs an amount > 0: set placement.{service}.cpus > 0")
    placed = {service_of(label) for label in labels}
    for spec in SERVICES.values():
        key, device, where = spec.device_key, spec.device(cfg), spec.placement_key
        if spec.name in placed and device.startswith("cuda") and not value_at(cfg, where).gpus > 0:
            raise ConfigError(f"config: {key}={device!r} but {where}.gpus=0 under --launcher ray "
                              f"(its process would see no GPU); set {where}.gpus, or {key}: auto")
    gpus, ranks = cfg.placement.trainer.gpus, cfg.train.ranks
    if "trainer" in placed and 0 < gpus < ranks:
        raise ConfigError(f"config: placement.trainer.gpus={gpus:g} but train.ranks={ranks}: on GPUs each rank needs its "
                          f"own (all ranks run in the trainer's bundle); set placement.trainer.gpus={ranks}")


def _amounts(b: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(b.items())) or "nothing"


def _fits(need: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in need.items())


def _total(bs: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bs:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _pack(needs: list[dict[str, float]], free: list[dict[str, float]], budget: list[int]) -> bool:
    """Whether ``needs`` (largest first) can be spread over the nodes' ``free`` amounts (backtracking;
    gives up, answering True, after ``budget[0]`` steps: Ray then has the last word)."""
    if not needs:
        return True
    budget[0] -= 1
    if budget[0] < 0:
        return True
    need, rest = needs[0], needs[1:]
    seen: list[dict[str, float]] = []
    for node in free:
        if node in seen or not _fits(need, node):
            continue
        seen.append(dict(node))
        for k, v in need.items():
            node[k] -= v
        ok = _pack(rest, free, budget)
        for k, v in need.items():
            node[k] += v
        if ok:
            return True
    return False


def _spread(needs: list[dict[str, float]], free: list[dict[str, float]]) -> bool:
    """Whether each of ``needs`` gets a node of its own (bipartite matching)."""
    owner: dict[int, int] = {}

    def place(i: int, tried: set[int]) -> bool:
        for n, node in enumerate(free):
            if n in tried or not _fits(needs[i], node):
                continue
            tried.add(n)
            if n not in owner or place(owner[n], tried):
                owner[n] = i
                return True
        return False

    return all(place(i, set()) for i in range(len(needs)))


def check_fit(wanted: Sequence[tuple[str, dict[str, float]]], nodes: Sequence[tuple[str, dict[str, float]]],
              strategy: str) -> None:
    """:class:`ConfigError` with one line unless the processes' bundles (``wanted``: ``(label,
    bundle)``) can be placed on ``nodes`` (``(name, total resources)``) under ``strategy``."""
    if not nodes:
        raise ConfigError("the Ray cluster has no alive node")
    asked = sorted({"CPU"} | {k for _, b in wanted for k in b})
    where = "; ".join(f"{name}: {_amounts({k: r.get(k, 0.0) for k in asked})}" for name, r in nodes)
    for label, b in wanted:
        if not any(_fits(b, r) for _, r in nodes):
            service = service_of(label)
            short = {k: v for k, v in b.items() if not any(r.get(k, 0.0) + EPS >= v for _, r in nodes)}
            what = f"no node has {_amounts(short)}" if short else f"no single node has {_amounts(b)} together"
            raise ConfigError(f"config: placement.{service}: {label} needs {_amounts(b)} but {what} "
                              f"(nodes: {where}); lower placement.{service}.* or add such a node")
    needs = sorted((dict(b) for _, b in wanted), key=lambda b: -sum(b.values()))  # largest first
    total = _total(needs)
    if strategy == "strict_pack":
        if not any(_fits(total, r) for _, r in nodes):
            raise ConfigError(f"config: placement.strategy=strict_pack puts all {len(needs)} processes on one node: "
                              f"they need {_amounts(total)} but no node has it (nodes: {where}); use pack")
        return
    if strategy == "strict_spread":
        if not _spread(needs, [dict(r) for _, r in nodes]):
            raise ConfigError(f"config: placement.strategy=strict_spread puts each of the {len(needs)} processes on a "
                              f"node of its own but the cluster has {len(nodes)} node(s) that cannot hold them so "
                              f"(nodes: {where}); use spread or pack")
        return
    cluster = _total([r for _, r in nodes])
    short = {k: v for k, v in total.items() if cluster.get(k, 0.0) + EPS < v}
    if short:
        have = _amounts({k: cluster.get(k, 0.0) for k in short})
        raise ConfigError(f"config: placement: the run's {len(needs)} processes need {_amounts(short)} in all "
                          f"({_by_service(wanted, short)}) but the Ray cluster has {have}; lower placement.*.cpus/"
                          "gpus/resources, fewer workers, or a bigger cluster")
    if not _pack(needs, [dict(r) for _, r in nodes], [100_000]):
        raise ConfigError(f"config: placement: the run's {len(needs)} processes ({_amounts(total)} in all) cannot be "
                          f"split over the cluster's nodes (nodes: {where}); lower placement.*")


_KEYS = ("CPU", "GPU")


def _by_service(wanted: Sequence[tuple[str, dict[str, float]]], keys: dict[str, float]) -> str:
    per: dict[str, dict[str, float]] = {}
    for label, b in wanted:
        d = per.setdefault(service_of(label), {})
        for k in keys:
            if k in b:
                d[k] = d.get(k, 0.0) + b[k]
    return ", ".join(f"{s} {_amounts(d)}" for s, d in per.items() if d)


def cluster_nodes(ray: Any) -> list[tuple[str, dict[str, float]]]:
    """``(address, total resources)`` of the cluster's alive nodes."""
    return [(str(n.get("NodeManagerAddress") or n.get("NodeID", "?")), {k: float(v) for k, v in n["Resources"].items()})
            for n in ray.nodes() if n.get("Alive")]


# --------------------------------------------------------------------------- the actor and its handle


class ServiceHost:
    """A Ray actor's body: runs one service process as its child and relays signals to it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, args: list[str], env: dict[str, str], log_path: str, cwd: str,
              visible_gpus: bool, omp_threads: str) -> tuple[int, str]:
        """Start ``python ARGS`` (this actor's Python) in ``cwd`` with this actor's environment plus
        ``env``, output appended to ``log_path``; ``(pid, host)``. Without a reserved GPU (``visible_gpus`` false) the child sees none;
        ``OMP_NUM_THREADS`` is ``omp_threads`` (``run.torch_threads``: :meth:`Supervisor.threads_env`)."""
        full = {**os.environ, **env}
        full.pop("OMP_NUM_THREADS", None)
        if omp_threads:
            full["OMP_NUM_THREADS"] = omp_threads
        if not visible_gpus:
            full["CUDA_VISIBLE_DEVICES"] = ""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as fh:
            self.proc = subprocess.Popen([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT, env=full, cwd=cwd,
                                         start_new_session=True, preexec_fn=_term_with_parent)
        return self.proc.pid, socket.gethostname()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM it when the actor's process dies (Linux ``PR_SET_PDEATHSIG``);
    unblock SIGINT (a local Ray instance's processes have it blocked: :func:`connect`)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))
        except OSError:
            pass


class RayProcess:
    """A ``subprocess.Popen``-like handle (``pid``, ``returncode``, ``poll``, ``send_signal``,
    ``wait``, ``kill``) on the service process a :class:`ServiceHost` actor runs."""

    def __init__(self, ray: Any, actor: Any, label: str, log_path: Path, pid: int, host: str) -> None:
        self.ray, self.actor, self.label, self.log_path = ray, actor, label, log_path
        self.pid, self.host = pid, host
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the process ended (its actor is then released), else None. A dead
        actor counts as ``-SIGKILL``, with a line naming it in the service's log."""
        if self.returncode is not None:
            return self.returncode
        try:
            code = self.ray.get(self.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            return None
        except self.ray.exceptions.RayError as e:
            self._note(f"error: the Ray actor of {self.label} on {self.host} died: {one_line(e)[:200]}")
            code = -int(signal.SIGKILL)
        if code is not None:
            self.returncode = int(code)
            self.release()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self.ray.get(self.actor.signal.remote(int(sig)), timeout=POLL_TIMEOUT_S)
            except self.ray.exceptions.RayError:
                pass  # a dead actor's child got SIGTERM already; poll() tells

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.label, timeout or 0.0)
            time.sleep(0.1)
        return int(self.returncode or 0)

    def release(self) -> None:
        """Kill the actor (frees its bundle for a restart)."""
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass

    def _note(self, line: str) -> None:
        try:
            with open(self.log_path, "a") as fh:
                fh.write(line + "\n")
        except OSError:
            pass


# --------------------------------------------------------------------------- the run on a cluster


@dataclass
class RayCluster:
    """The Ray connection and the run's placement group (:func:`connect`)."""

    ray: Any
    cfg: RunConfig
    labels: list[str]
    placement_group: Any
    started_local: bool
    """Whether this run started the Ray instance (then :meth:`close` stops it)."""
    connected_here: bool = True
    """Whether :func:`connect` called ``ray.init`` (then :meth:`close` disconnects)."""
    supervisors: list[RaySupervisor] = field(default_factory=list)

    def supervisor(self, cfg: RunConfig, run_id: str, bootstrap: str, console: Console) -> RaySupervisor:
        """The run's supervisor (``make_supervisor`` of :func:`~launch.supervisor.run_supervised`)."""
        sup = RaySupervisor(cfg, run_id, bootstrap, console, cluster=self)
        self.supervisors.append(sup)
        return sup

    def close(self) -> None:
        """Kill every actor left, remove the placement group, disconnect from Ray."""
        for sup in self.supervisors:
            for proc in sup.procs.values():
                if isinstance(proc, RayProcess):
                    proc.release()
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        except Exception:  # the cluster went away: nothing to remove
            pass
        if self.connected_here:
            self.ray.shutdown()


class RaySupervisor(Supervisor):
    """The supervisor whose service processes are Ray actors in the run's placement group."""

    ray = True

    def __init__(self, cfg: RunConfig, run_id: str, bootstrap: str, console: Console, *, cluster: RayCluster) -> None:
        super().__init__(cfg, run_id, bootstrap, console)
        self.cluster = cluster

    def labels(self) -> list[str]:
        return list(self.cluster.labels)  # the placement group's bundles are in this order

    def host_of(self, slot: ServiceSlot) -> str:
        proc = self.procs.get(slot.label)
        return proc.host if isinstance(proc, RayProcess) else super().host_of(slot)

    def _spawn(self, slot: ServiceSlot) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, index = self.cluster.ray, self.cluster.labels.index(slot.label)
        b = bundle_of(self.cfg.placement, slot.service)
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.cluster.placement_group,
                                                    placement_group_bundle_index=index)
        actor = ray.remote(ServiceHost).options(
            num_cpus=b.get("CPU", 0.0), num_gpus=b.get("GPU", 0.0),
            resources={k: v for k, v in b.items() if k not in _KEYS}, scheduling_strategy=strategy,
            max_restarts=0).remote()
        env = {k: v for k, v in self._env.items() if k.startswith("ROLLSTREAM_") or k in CHILD_ENV}
        threads = self.threads_env(slot.label)
        env[LABEL_ENV] = threads[LABEL_ENV]
        # the command after its interpreter: the actor runs it with its own (the node's) Python
        args = service_command(slot.service, self.run_id, self.cfg.run.runs_dir)[1:]
        timeout_s = self.cfg.placement.ready_timeout_s
        try:
            pid, host = ray.get(actor.start.remote(
                args, env, str(slot.log_path.resolve()), os.getcwd(), b.get("GPU", 0.0) > 0,
                threads.get("OMP_NUM_THREADS", self._env.get("OMP_NUM_THREADS", ""))), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RunError(f"the Ray actor of {slot.label} did not start within placement.ready_timeout_s="
                           f"{timeout_s:g} s") from None
        self.procs[slot.label] = RayProcess(ray, actor, slot.label, slot.log_path, int(pid), str(host))
        slot.pid, slot.state, slot.started_at = int(pid), "running", time.time()


def check_address(address: str, timeout_s: float = 10.0) -> None:
    """``address`` (``host:port`` or ``ray://host:port``; ``auto`` is left to Ray) accepts a TCP
    connection: Ray itself retries an unreachable one for minutes. :class:`RunError` otherwise."""
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise RunError(f"--address {address!r} is not host:port or ray://host:port (nor auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RunError(f"no Ray cluster answers at {address} ({e.strerror or type(e).__name__}); start one "
                       "(`ray start --head` on its head node) or fix --address / $RAY_ADDRESS") from None


def connect(cfg: RunConfig, address: str = "", *, console: Console | None = None) -> RayCluster:
    """Join the Ray cluster at ``address`` (empty: this process's Ray connection when it has one, else
    ``$RAY_ADDRESS``, else a new local instance with this machine's resources), check that the run's
    placement fits it and reserve its placement group. :class:`ConfigError` / :class:`RunError` with
    one line; nothing of the run has started then."""
    ray = require_ray()
    labels = run_labels(cfg)
    check_reserves(cfg, labels)
    started_local = connected_here = False
    if not ray.is_initialized():
        import logging

        connected_here = True
        address = address or os.environ.get("RAY_ADDRESS", "")
        started_local = not address
        if address:
            check_address(address)
        # a local instance's processes inherit a blocked SIGINT: Ctrl-C in the terminal (sent to the
        # whole process group) reaches this supervisor, which stops the services through them
        blocked = {signal.SIGINT} if started_local else set()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RunError(f"cannot connect to the Ray cluster at {address or 'a new local instance'}: "
                           f"{one_line(e)[:300]}") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    try:
        wanted = bundles(cfg, labels)
        check_fit(wanted, cluster_nodes(ray), cfg.placement.strategy)
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group([b for _, b in wanted], strategy=cfg.placement.strategy.upper())
        try:
            ray.get(pg.ready(), timeout=cfg.placement.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RunError(f"the Ray cluster did not reserve the run's {len(wanted)} bundles "
                           f"({_amounts(_total([b for _, b in wanted]))} in all) within placement.ready_timeout_s="
                           f"{cfg.placement.ready_timeout_s:g} s: other jobs hold those resources") from None
    except BaseException:
        if connected_here:
            ray.shutdown()
        raise
    if console is not None:
        where = "a local Ray instance" if started_local else f"the Ray cluster at {address or 'this process'}"
        console.print(f"ray: {len(labels)} service processes placed on {where} "
                      f"({_amounts(_total([b for _, b in wanted]))}, strategy {cfg.placement.strategy})")
    return RayCluster(ray, cfg, labels, pg, started_local, connected_here=connected_here)


__all__ = ["RAY_MISSING", "RayCluster", "RayProcess", "RaySupervisor", "ServiceHost",
           "bundle_of", "bundles", "check_address", "check_fit", "check_reserves", "connect", "require_ray"]
