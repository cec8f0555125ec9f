"""``lightning-islands``: ``train`` (the Hydra app), ``run`` (islands for any script), ``coordinator``,
``report`` (a table and plots from finished runs), ``plan`` (predicted utilization for a link),
``export`` (a run's trained model as one file); ``--version``."""

from __future__ import annotations

import argparse
import signal
import sys
import time

USAGE = """usage: lightning-islands COMMAND ...
       lightning-islands --version

commands:
  train [hydra overrides...]     compose the Hydra config and run the job (see README)
  run --islands 2,1 -- CMD ...   run CMD as one torch.distributed.run per island, with a coordinator
        [--link 1gbit,100ms]     ... each island in a network namespace behind a tc-shaped link
                                 ... RATE in bits per second (1gbit, 200mbit, 25G); 25gbps is refused
        [--max-restarts N]       ... restart an island that died; it rejoins the others
  coordinator --port P           serve a coordinator for islands started elsewhere
  coordinator --etcd N           a local etcd cluster of N members, supervised (prints its etcd:// address)
  report RUNS_DIR [--out DIR]    tabulate and plot every finished run under RUNS_DIR
  export RUN_DIR --out FILE      the trained model as one file (.safetensors or .pt)
  plan [overrides...] --link-bps 25gbit --rtt-ms 100 --step-seconds 0.5,0.8
                                 predict utilization and the link a target needs (docs/PLANNING.md)

options:
  -V, --version                  print the installed version: lightning-islands X.Y.Z
  -h, --help                     print this message
"""


def _run_parser() -> argparse.ArgumentParser:
    """The options of ``lightning-islands run`` (the command follows ``--``)."""
    parser = argparse.ArgumentParser(prog="lightning-islands run",
                                     description="Run a training script as several islands on this machine.")
    parser.add_argument("--islands", required=True, help="processes per island, e.g. 2,1")
    parser.add_argument("--log-dir", default=None, help="keep each island's output in LOG_DIR/island{i}.log")
    parser.add_argument("--run-id", default=None, help="namespace of this run on the coordinator")
    parser.add_argument("--live", choices=["auto", "on", "off"], default="auto",
                        help="one live status line per island (default: when attached to a terminal)")
    parser.add_argument("--link", default=None, metavar="RATE[,RTT][,tuned][,I=RATE]",
                        help="put each island in its own network namespace behind a link shaped by tc, e.g. "
                             "1gbit,100ms (RATE in bits per second: 1gbit, 200mbit, 25G; byte units such as 25gbps "
                             "are refused; the RTT: netem, else a TUN delay line; ',tuned': the islands' TCP tuned "
                             "for a long-fat link; ',3=200mbit': island 3 behind a rate of its own, both ways); "
                             "needs root and iproute2")
    parser.add_argument("--accelerators", default=None, metavar="gpu|cpu|auto[,...]",
                        help="what each island runs on, one for all or one per island (default auto: gpu where this "
                             "machine has GPUs); each island sees its accelerator in LI_ACCELERATOR")
    parser.add_argument("--gpus", choices=["own", "shared"], default="own",
                        help="own (default): each GPU island sees GPUs of its own (CUDA_VISIBLE_DEVICES), refused "
                             "when the machine has too few; shared: every GPU island sees every GPU")
    parser.add_argument("--coordinator", default=None, metavar="ADDRESS",
                        help="meet at a coordinator that serves already: etcd://h1:2379,h2:2379,h3:2379 (an etcd "
                             "cluster; `lightning-islands coordinator --etcd 3` starts one) or HOST:PORT (default: a "
                             "TCPStore started for the run)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart an island whose process died up to N times (as torchrun does) while the others "
                             "train on; it rejoins them (default 0: a failed island ends the run)")
    return parser


def _checked_islands(parser: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]) -> list[int]:
    """The processes per island, once every option of ``run`` but ``--link`` is known good; anything
    wrong ends the command here with ``parser.error`` (exit code 2), before anything starts."""
    from lightning_islands.app.launch import check_log_dir, parse_islands

    try:
        islands = parse_islands(args.islands)
    except ValueError as err:
        parser.error(str(err))
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.coordinator is not None:
        from lightning_islands.link.coordinator import check_address

        try:
            check_address(args.coordinator)
        except ValueError as err:
            parser.error(f"--coordinator: {err}")
        if args.link is not None:
            parser.error("--coordinator and --link together: the islands' namespaces reach only the coordinator the "
                         "launcher starts at the hub; drop one of them")
    if not command:
        parser.error("give the command after --, e.g. lightning-islands run --islands 2,1 -- python train.py")
    if args.log_dir is not None:
        try:
            check_log_dir(args.log_dir)
        except ValueError as err:
            parser.error(f"--log-dir: {err}")
    return islands


def _run(argv: list[str]) -> int:
    from lightning_islands.app.gpus import place_islands
    from lightning_islands.app.launch import report_failures, run_islands

    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    parser = _run_parser()
    args = parser.parse_args(own)
    islands = _checked_islands(parser, args, command)
    link = None
    if args.link is not None:
        from lightning_islands.app.netns import LinkUnavailable, check_link_support, parse_link

        try:
            link = parse_link(args.link)
            check_link_support()
        except ValueError as err:
            parser.error(f"--link: {err}")
        except LinkUnavailable as err:
            print(f"lightning-islands run: {err}", file=sys.stderr)
            return 2
    live = {"auto": None, "on": True, "off": False}[args.live]
    try:  # before anything starts (run_islands checks again, for its other callers)
        place_islands(islands, args.accelerators, args.gpus)
    except ValueError as err:
        parser.error(str(err))
    results = run_islands(islands, command, log_dir=args.log_dir, run_id=args.run_id, live=live,
                          link=link, max_restarts=args.max_restarts, coordinator=args.coordinator,
                          accelerators=args.accelerators, gpus=args.gpus)
    return report_failures(results)


def _listen_problem(host: str, port: int, err: Exception | None = None) -> str:
    """The one line that says why the coordinator cannot listen on ``host:port``, and the fix."""
    if err is None or "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
        return (f"lightning-islands coordinator: port {port} is already in use on this machine; choose another "
                f"--port (--port 0 picks a free one) or stop the process holding it (ss -ltnp 'sport = :{port}' "
                "names it)")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"lightning-islands coordinator: cannot listen on {host}:{port}: {first}; check that --host is an "
            "address of this machine (0.0.0.0: all) and that --port is free and allowed (below 1024 needs root)")


def _coordinator(argv: list[str]) -> int:
    from lightning_islands.app.launch import port_in_use

    parser = argparse.ArgumentParser(prog="lightning-islands coordinator")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--etcd", type=int, default=None, metavar="N",
                        help="start an etcd cluster of N members on this machine instead (tests, demos, one site): "
                             "print its etcd:// address, restart a member that dies, stop them on exit")
    parser.add_argument("--data-dir", default=None, help="with --etcd: the members' data folder (default: temporary)")
    parser.add_argument("--tls", action="store_true",
                        help="with --etcd: members serve TLS and refuse clients without a certificate of their CA "
                             "(made in DATA_DIR/tls); prints the LI_ETCD_CA, LI_ETCD_CERT and LI_ETCD_KEY islands need")
    parser.add_argument("--run-user", action="append", default=[], metavar="RUN_ID",
                        help="with --etcd --tls: an etcd user and role limited to the keys of run RUN_ID (give "
                             "the run --run-id RUN_ID), its password in DATA_DIR/RUN_ID.password; turns etcd's "
                             "authentication on (repeatable)")
    parser.add_argument("--port", type=int, default=29400, help="port to listen on (0: a free one; default 29400)")
    args = parser.parse_args(argv)
    if args.etcd is not None:
        return _etcd_cluster(parser, args)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is not a TCP port; give one from 0 to 65535 (0: a free one)")
    if args.port and port_in_use(args.port, args.host):
        print(_listen_problem(args.host, args.port), file=sys.stderr)
        return 1
    from lightning_islands.link.coordinator import Coordinator

    try:
        coordinator = Coordinator(args.host, args.port)
    except (OSError, RuntimeError) as err:  # torch's DistNetworkError is a RuntimeError
        print(_listen_problem(args.host, args.port, err), file=sys.stderr)
        return 1
    print(f"lightning-islands coordinator listening on {args.host}:{coordinator.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def version() -> str:
    """The installed package's version (its metadata), else the one in ``lightning_islands.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("lightning-islands")
    except PackageNotFoundError:
        from lightning_islands import __version__

        return __version__


def _etcd_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``coordinator --etcd N``: a supervised local etcd cluster until SIGTERM or Ctrl-C."""
    from lightning_islands.app.etcd_cluster import EtcdUnavailable, LocalEtcdCluster

    if args.etcd < 1:
        parser.error(f"--etcd {args.etcd}: give the number of members, e.g. --etcd 3 (a majority must stay up)")
    if args.run_user and not args.tls:
        parser.error("--run-user needs --tls: a run user's password must not cross the network in the clear")
    host = "127.0.0.1" if args.host == "0.0.0.0" else args.host  # members advertise the address they listen on
    try:
        cluster = LocalEtcdCluster(args.etcd, host=host, data_dir=args.data_dir, tls=args.tls).start()
    except (EtcdUnavailable, RuntimeError) as err:
        print(f"lightning-islands coordinator: {err}", file=sys.stderr)
        return 1
    print(f"lightning-islands coordinator: etcd cluster of {args.etcd} members at {cluster.address}", flush=True)
    if args.tls:
        for run_id in args.run_user:
            creds = cluster.add_run_user(run_id, cluster.root / f"{run_id}.password")
            print(f"lightning-islands coordinator: run {run_id}: LI_ETCD_USER={creds.user} "
                  f"LI_ETCD_PASSWORD_FILE={creds.password_file}", flush=True)
        creds = cluster.credentials
        print(f"lightning-islands coordinator: TLS: LI_ETCD_CA={creds.ca_file} LI_ETCD_CERT={creds.cert_file} "
              f"LI_ETCD_KEY={creds.key_file}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a sub-command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"lightning-islands {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from lightning_islands.app import train

        sys.argv = [f"{sys.argv[0]} train", *rest]
        train.main()
        return 0
    if command == "run":
        return _run(rest)
    if command == "coordinator":
        return _coordinator(rest)
    if command == "report":
        from lightning_islands.app.report import main as report_main

        return report_main(rest)
    if command == "export":
        from lightning_islands.app.export import main as export_main

        return export_main(rest)
    if command == "plan":
        from lightning_islands.app.plan import main as plan_main

        return plan_main(rest)
    print(f"lightning-islands: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
