"""Start islands on this machine: a coordinator and each island's processes, in the environment
``torch.distributed.run`` gives its workers (under its agent only where the island may restart).

Used by ``lightning-islands run`` (any script) and by the Hydra app. Each island's output is
streamed with an ``[island i]`` prefix (and kept in ``island{i}.log`` when a log folder is given);
attached to a terminal, one live line per island (step, loss, outer round, bytes exchanged) replaces
the interleaved progress bars. If an island fails, the others are stopped and the failure is
reported with the island's index and exit code (an island that outlives its SIGTERM by
``TERMINATE_GRACE_S`` is killed). With a ``link`` each island runs in its own
network namespace behind a shaped link (:mod:`lightning_islands.app.netns`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lightning_islands.app.gpus import place_islands
from lightning_islands.app.netns import LinkSpec, ShapedLink, run_in_namespace, shaped_link
from lightning_islands.link.coordinator import (
    ENV_COORDINATOR,
    ENV_ISLAND,
    ENV_LINK_IFNAME,
    ENV_NUM_ISLANDS,
    ENV_RUN_ID,
    Coordinator,
    RemoteCoordinator,
)

ENV_PROGRESS = "LI_PROGRESS_BAR"
# How often the launcher looks for islands that ended, and how often it redraws the live status lines.
POLL_S = 0.05
STATUS_PERIOD_S = 0.5
TERMINATE_GRACE_S = 30.0  # an island told to stop is killed after this long (torchrun's agent waits as long)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source port (0: unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range where
    it can be: connections take their source ports from that range, so none of them can take the
    port between this check and its server binding it (the island's rendezvous)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different ports as :func:`free_port` picks them (all held until all are picked, so
    that two servers started together never get the same one)."""
    low, held, pick = _ephemeral_low(), [], random.SystemRandom()  # not the caller's seeded `random`
    try:
        for _ in range(count):
            for _ in range(64 if low > 11024 else 0):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind(("127.0.0.1", pick.randrange(low - 10000, low)))
                except OSError:
                    s.close()
                    continue
                held.append(s)
                break
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", 0))
                held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


ISLANDS_FORM = "processes per island, comma-separated, each at least 1, e.g. 2,1 (two islands: 2 processes and 1)"


def parse_islands(spec: str | Sequence[int]) -> list[int]:
    """``"2,1"`` -> ``[2, 1]``: processes per island; a ValueError names the value and the form."""
    if isinstance(spec, str):
        parts = [x.strip() for x in spec.split(",") if x.strip()]
        bad = next((x for x in parts if not x.isdigit()), None)
        if bad is not None:
            raise ValueError(f"--islands {spec!r}: {bad!r} is not a whole number; give {ISLANDS_FORM}")
        sizes = [int(x) for x in parts]
    else:
        sizes = [int(x) for x in spec]
    if not sizes:
        raise ValueError(f"--islands {spec!r} names no island; give {ISLANDS_FORM}")
    empty = [i for i, n in enumerate(sizes) if n < 1]
    if empty:
        raise ValueError(f"--islands {spec!r}: island {empty[0]} has {sizes[empty[0]]} processes; give {ISLANDS_FORM}")
    return sizes


def check_log_dir(path: str | os.PathLike) -> None:
    """Raise a ValueError naming ``path`` and the fix unless this process can make (or has) the log
    folder ``path`` and write in it. Creates nothing."""
    folder = Path(os.path.abspath(path))
    nearest = next(p for p in (folder, *folder.parents) if os.path.lexists(p))  # "/" exists
    if not nearest.is_dir():
        where = "it is" if nearest == folder else f"{nearest} is"
        what = "a file, not" if nearest.is_file() else "a link to nothing, not" if nearest.is_symlink() else "not"
        raise ValueError(f"log folder {str(path)!r} cannot be made: {where} {what} a folder; give a folder path "
                         "that is not a file or under one")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"log folder {str(path)!r} cannot be written: {nearest} does not let this user write in it; "
                         f"give a folder you can write to, or allow it (e.g. chmod u+w {nearest})")


def port_in_use(port: int, host: str = "") -> bool:
    """Whether a process on this machine listens on TCP ``port`` at ``host`` (a test bind there, as a
    server with ``SO_REUSEADDR`` binds: a listener makes it fail, connections in TIME_WAIT do not;
    ``""`` or ``0.0.0.0``: every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host == "0.0.0.0" else host, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def torchrun_command(nproc: int, command: Sequence[str], master_port: int, max_restarts: int = 0) -> list[str]:
    """The ``torch.distributed.run`` invocation for one island running ``command``; it restarts the
    island's processes up to ``max_restarts`` times when one of them dies.

    ``python script.py ...``/``python -m mod ...``/``script.py ...`` run under this interpreter;
    anything else runs as a plain executable (``--no-python``).
    """
    cmd = list(command)
    if not cmd:
        raise ValueError("no command given to run in each island; put it after --, e.g. -- python train.py")
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={master_port}", f"--max-restarts={max_restarts}"]
    head = os.path.basename(cmd[0])
    if head.startswith("python"):
        cmd = cmd[1:]
        if cmd and cmd[0] == "-m":
            return base + ["-m"] + cmd[1:]
        return base + cmd
    if cmd[0].endswith(".py"):
        return base + cmd
    return base + ["--no-python"] + cmd


def island_command(nproc: int, command: Sequence[str], master_port: int,
                   max_restarts: int = 0) -> tuple[list[str], list[dict[str, str]]]:
    """How to start one island running ``command``: the command line and, per process to start,
    the environment to add. An island that may be restarted runs under ``torch.distributed.run``
    (:func:`torchrun_command`: one process, the agent); one that is never restarted runs its
    ``nproc`` processes directly, each with the environment torchrun would give it (an agent
    process, and its seconds of importing torch, less per island; :class:`IslandProcesses` stops
    the island's other processes when one fails, as the agent does)."""
    if max_restarts:
        return torchrun_command(nproc, command, master_port, max_restarts), [{}]
    cmd = list(command)
    if not cmd:
        raise ValueError("no command given to run in each island; put it after --, e.g. -- python train.py")
    if os.path.basename(cmd[0]).startswith("python"):
        cmd = [sys.executable, *cmd[1:]]
    elif cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    return cmd, [{"RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                  "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                  "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                  # one process: its store listens where the kernel says (port 0), so no port picked
                  # ahead can be taken meanwhile by another process (EADDRINUSE)
                  "MASTER_PORT": str(master_port if nproc > 1 else 0), "TORCHELASTIC_RESTART_COUNT": "0",
                  "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                  "TORCHELASTIC_USE_AGENT_STORE": "False"}  # no agent: rank 0 serves the island's store
                 for r in range(nproc)]


class IslandProcesses:
    """An island's processes (its directly started ranks, or its torchrun agent) seen as one
    process (``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``, ``pid``): it ends when all
    of them have; when one fails the others are told to stop; processes told to stop (SIGTERM) are
    killed when they outlive :data:`TERMINATE_GRACE_S`, as torchrun's agent does with its workers.
    The island's exit code is the first failure's."""

    def __init__(self, procs: Sequence[subprocess.Popen]) -> None:
        self.procs = list(procs)
        self.returncode: int | None = None
        self._failed: int | None = None
        self._stopping_since = math.inf

    @property
    def pid(self) -> int:
        """The first process's (rank 0's) pid."""
        return self.procs[0].pid

    def poll(self) -> int | None:
        """The island's exit code once every process has ended, else None (and stop the others of a
        failed island)."""
        codes = [p.poll() for p in self.procs]
        if self._failed is None:
            self._failed = next((c for c in codes if c not in (None, 0)), None)
            if self._failed is not None:
                self.terminate()
        if any(c is None for c in codes):
            if time.monotonic() - self._stopping_since > TERMINATE_GRACE_S:
                self.kill()
            return None
        self.returncode = self._failed if self._failed is not None else 0
        return self.returncode

    def terminate(self) -> None:
        """SIGTERM every process still running."""
        self._stopping_since = min(self._stopping_since, time.monotonic())
        for p in self.procs:
            if p.poll() is None:
                p.terminate()

    def kill(self) -> None:
        """SIGKILL every process still running."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every process (``timeout`` for all of them together)."""
        end = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(None if end is None else max(0.0, end - time.monotonic()))
        code = self.poll()
        assert code is not None
        return code


@dataclass
class IslandResult:
    """How one island's process ended."""

    island: int
    returncode: int
    log_tail: list[str] = field(default_factory=list)
    stopped: bool = False  # terminated by the launcher because another island failed


def _pump(stream: IO[str], island: int, sink: IO[str] | None, log: IO[str] | None, tail: list[str],
          lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        del tail[:-400]
        with lock:  # an island's processes share its log
            if log is not None:
                log.write(line)
                log.flush()
            if sink is not None:
                sink.write(f"[island {island}] {line}")
                sink.flush()
    stream.close()


def _status_line(island: int, status: Mapping | None, rc: int | None) -> str:
    if rc is not None:
        return f"island {island}: {'done' if rc == 0 else f'FAILED (exit {rc})'}"
    if not status:
        return f"island {island}: starting"
    loss = status.get("loss")
    loss_s = f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"
    return (f"island {island}: step {status.get('step', 0):>6}  loss {loss_s}  round {status.get('round', 0):>4}  "
            f"exchanged {status.get('bytes', 0) / 1e6:8.2f} MB")


def cpu_threads_per_process(total_processes: int) -> int:
    """Intra-op CPU threads for each of ``total_processes`` processes sharing this machine (>= 1).

    Islands launched together on one machine must split its cores: with more threads than cores,
    OpenMP threads spin at barriers while their partners wait to be scheduled, and a process can run
    10x slower than it would with one thread.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, total_processes))


def run_islands(
    islands: Sequence[int],
    command: Sequence[str],
    log_dir: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    island_env: Sequence[Mapping[str, str]] | None = None,
    run_id: str | None = None,
    live: bool | None = None,
    out: IO[str] | None = None,
    coordinator_host: str = "127.0.0.1",
    link: str | LinkSpec | None = None,
    max_restarts: int = 0,
    coordinator: str | None = None,
    accelerators: str | Sequence[str] | None = None,
    gpus: str = "own",
) -> list[IslandResult]:
    """Run ``command`` as ``len(islands)`` islands of ``islands[i]`` processes each; wait for all.

    Returns one :class:`IslandResult` per island. When one island fails, the others are terminated
    (they would otherwise wait for it until their timeout). Unless the environment sets
    ``OMP_NUM_THREADS`` (to something other than an empty string), every process gets an equal
    share of this machine's cores
    (:func:`cpu_threads_per_process`).

    ``link`` (``"RATE[,RTT][,tuned][,I=RATE]"``, e.g. ``"1gbit,100ms,3=200mbit"``; ``None``: none)
    runs each island in its own network namespace behind a shaped veth
    (:mod:`lightning_islands.app.netns`; needs root and iproute2): the coordinator then listens at
    the hub's address (``coordinator_host`` is not used), each island's lanes bind to its veth
    (``LI_LINK_IFNAME``) and its own process group to ``lo`` (``GLOO_SOCKET_IFNAME=lo``), so only
    traffic between islands crosses the shaped link. The link in effect is printed first and, with
    ``log_dir``, written to ``link.json`` there; the namespaces are removed when the run ends,
    however it ends.

    ``max_restarts``: an island whose process dies is restarted (all of its processes, by
    ``torch.distributed.run``) up to this many times, while the others train on; it rejoins them
    (``TORCHELASTIC_RESTART_COUNT`` tells it that it restarted).

    ``coordinator``: the address of a coordinator that serves already (``etcd://h1:2379,...``, or
    ``HOST:PORT``); the islands meet there instead of at a TCPStore started for the run (not with
    ``link``: the namespaces reach only the hub).

    ``accelerators`` (``"gpu,cpu"``, one for all, or ``None``: ``auto``) and ``gpus`` (``"own"`` or
    ``"shared"``) say which GPUs each island sees (:mod:`lightning_islands.app.gpus`); an island
    set that needs more GPUs than the machine shows is refused before anything starts.
    """
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    out = out or sys.stdout
    placed = place_islands(islands, accelerators, gpus)
    if placed.warning:
        out.write(f"lightning-islands: {placed.warning}\n")
    island_env = [{**placed.env[i], **(island_env[i] if island_env is not None else {})} for i in range(len(islands))]
    if coordinator is not None:
        if link is not None:
            raise ValueError("a coordinator of your own and a shaped link together: the islands' namespaces reach "
                             "only the coordinator the launcher starts at the hub; drop --coordinator or --link")
        return _launch(islands, command, RemoteCoordinator(coordinator), [[]] * len(islands), [{}] * len(islands),
                       log_dir, env, island_env, run_id, live, out, max_restarts)
    if link is None:
        return _launch(islands, command, Coordinator(coordinator_host, 0), [[]] * len(islands), [{}] * len(islands),
                       log_dir, env, island_env, run_id, live, out, max_restarts)
    with shaped_link(link, len(islands)) as shaped:
        out.write(f"lightning-islands: {shaped.describe()}\n")
        out.flush()
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "link.json").write_text(json.dumps(link_record(shaped), indent=2))
        coordinator = run_in_namespace(shaped.hub_namespace, lambda: Coordinator(shaped.hub_address, 0))
        link_env = [{ENV_LINK_IFNAME: port.interface, "GLOO_SOCKET_IFNAME": "lo"} for port in shaped.islands]
        prefixes = [shaped.exec_prefix(i) for i in range(len(islands))]
        return _launch(islands, command, coordinator, prefixes, link_env, log_dir, env, island_env, run_id, live,
                       out, max_restarts)


def link_record(shaped: ShapedLink) -> dict[str, Any]:
    """What a run records about its shaped link (``link.json``; the summary shows ``describe``)."""
    return {"spec": str(shaped.spec), "rate_bps": shaped.spec.rate_bps, "rtt_s_asked": shaped.spec.rtt_s,
            "island_rate_bps": [shaped.spec.rate_of(p.island) for p in shaped.islands],
            "rtt_s": shaped.rtt_s, "netem": shaped.netem, "delay": shaped.delay, "tcp": shaped.spec.tcp,
            "describe": shaped.describe(),
            "hub": shaped.hub_address, "islands": [p.address for p in shaped.islands]}


def _launch(islands: Sequence[int], command: Sequence[str], coordinator: Coordinator | RemoteCoordinator,
            prefixes: Sequence[list[str]],
            link_env: Sequence[Mapping[str, str]], log_dir: str | os.PathLike | None, env: Mapping[str, str] | None,
            island_env: Sequence[Mapping[str, str]] | None, run_id: str | None, live: bool | None,
            out: IO[str], max_restarts: int = 0) -> list[IslandResult]:
    """:func:`run_islands` once the coordinator serves: island ``i`` runs under ``prefixes[i]``
    with ``link_env[i]`` added to its environment."""
    live = out.isatty() if live is None else live
    run_id = run_id or uuid.uuid4().hex[:12]
    logs_path = Path(log_dir) if log_dir is not None else None
    if logs_path is not None:
        logs_path.mkdir(parents=True, exist_ok=True)
    procs, threads, tails, files = [], [], [], []
    lock = threading.Lock()
    threads_each = cpu_threads_per_process(sum(islands))
    ports = free_ports(len(islands))  # one per island's own store, all different
    for i, nproc in enumerate(islands):
        child_env = dict(os.environ)
        child_env.update(env or {})
        if not child_env.get("OMP_NUM_THREADS", "").strip():  # unset, or empty (which libgomp rejects)
            child_env["OMP_NUM_THREADS"] = str(threads_each)
        child_env.update({ENV_ISLAND: str(i), ENV_NUM_ISLANDS: str(len(islands)),
                          ENV_COORDINATOR: coordinator.address, ENV_RUN_ID: run_id,
                          "PYTHONUNBUFFERED": "1", **link_env[i]})
        if len(islands) > 1 or not live:
            child_env.setdefault(ENV_PROGRESS, "0")
        started, worker_envs = island_command(nproc, command, ports[i], max_restarts)
        cmd = list(prefixes[i]) + started
        single_interactive = len(islands) == 1 and live
        tail: list[str] = []
        tails.append(tail)
        log = open(logs_path / f"island{i}.log", "w") if logs_path is not None and not single_interactive else None
        files.append(log)
        island_procs = []
        for worker_env in worker_envs:
            proc_env = {**child_env, **worker_env, **(island_env[i] if island_env is not None else {})}
            proc = subprocess.Popen(
                cmd, env=proc_env, text=True, bufsize=1,
                stdout=None if single_interactive else subprocess.PIPE,
                stderr=None if single_interactive else subprocess.STDOUT,
            )
            island_procs.append(proc)
            if proc.stdout is not None:
                t = threading.Thread(target=_pump, args=(proc.stdout, i, None if live else out, log, tail, lock),
                                     daemon=True)
                t.start()
                threads.append(t)
        procs.append(IslandProcesses(island_procs))

    codes: list[int | None] = [None] * len(procs)
    stopped: set[int] = set()
    shown, next_status = 0, 0.0
    previous = _raise_on_sigterm()
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode != 0 and i not in stopped:
                        for j, other in enumerate(procs):
                            if codes[j] is None and j not in stopped:
                                stopped.add(j)
                                other.terminate()
            if live and len(islands) > 1 and (time.monotonic() >= next_status or all(c is not None for c in codes)):
                next_status = time.monotonic() + STATUS_PERIOD_S
                lines = [_status_line(i, s, codes[i]) for i, s in enumerate(coordinator.status(len(islands), run_id))]
                if shown:
                    out.write(f"\x1b[{shown}F")
                out.write("".join(f"\x1b[2K{line}\n" for line in lines))
                out.flush()
                shown = len(lines)
            time.sleep(POLL_S)
    except (KeyboardInterrupt, SystemExit):
        for p in procs:
            p.terminate()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for p in procs:
            with_timeout_kill(p)
        for t in threads:
            t.join(timeout=5)
        for f in files:
            if f is not None:
                f.close()
    results = [IslandResult(i, int(c if c is not None else -1), tails[i], i in stopped)
               for i, c in enumerate(codes)]
    return results


def _raise_on_sigterm() -> Any:
    """Turn SIGTERM into SystemExit so a terminated launcher stops its islands (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def with_timeout_kill(proc: IslandProcesses, timeout: float = 20.0) -> None:
    """Wait for ``proc``; kill it if it does not end within ``timeout`` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def error_excerpt(lines: Sequence[str], context: int = 12) -> list[str]:
    """The first Python error in an island's output with the traceback lines before it (torchrun's
    own ``ChildFailedError`` report is skipped); the last lines when there is no such error."""
    for i, line in enumerate(lines):
        text = line.split("]: ", 1)[-1] if line.startswith("[rank") else line
        head = text.split(":", 1)[0].strip()
        if ("Error" in head or "Exception" in head) and "ChildFailedError" not in head and " " not in head:
            return list(lines[max(0, i - context) : i + 1])
    return list(lines[-15:])


def report_failures(results: Sequence[IslandResult], out: IO[str] | None = None) -> int:
    """Print which islands failed (first failure first, with its last log lines); return an exit code."""
    out = out or sys.stderr
    failed = sorted((r for r in results if r.returncode != 0), key=lambda r: r.stopped)
    if not failed:
        return 0
    first = failed[0]
    out.write(f"lightning-islands: island {first.island} failed with exit code {first.returncode}\n")
    for line in error_excerpt(first.log_tail):
        out.write(f"  [island {first.island}] {line}\n")
    others = [r.island for r in failed[1:]]
    if others:
        out.write(f"lightning-islands: islands {others} were stopped or failed after it\n")
    return first.returncode if first.returncode > 0 else 1
