"""``fedpriv deploy``: the sub-commands of a real Flower deployment (SuperLink + SuperNodes).

    fedpriv deploy certs DIR [--nodes N] [--host NAME ...]                  TLS + SuperNode keys
    fedpriv deploy compose [--nodes N] [--insecure] [--set K=V ...]         > compose file
    fedpriv deploy commands (--certs DIR | --insecure) [--nodes N]          plain processes
    fedpriv deploy health --superlink HOST:PORT (--root-certificates CA | --insecure)
    fedpriv deploy register --superlink HOST:PORT --root-certificates CA KEY.pub ...
    fedpriv deploy submit --superlink HOST:PORT (...) --app DIR --results PATH
                          [--config TOML] [--set K=V ...]
    fedpriv deploy setup --results DIR [--certs DIR --nodes N] [--owner UID:GID]

``add_parser`` installs them into the ``fedpriv`` command line (``fedpriv.cli``); this module
never imports it (nor flwr: it runs the ``flwr`` CLI as a subprocess). ``register``, ``submit``,
``health`` and ``setup`` are what the compose services and the integration tests run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fedpriv.config_files import (
    app_config_keys,
    for_flower,
    load_run_config,
    parse_overrides,
    read_config_file,
)
from fedpriv.deploy.certs import chown_tree, generate_certs
from fedpriv.deploy.commands import (
    CONNECTION,
    DEFAULT_HOSTS,
    NODE_PORT,
    RESULTS_FILE,
    Deployment,
    check_health,
    connection_toml,
    register_argv,
    register_command,
    submit_argv,
    submit_command,
    superlink_command,
    supernode_command,
    write_connection,
)
from fedpriv.deploy.compose import compose_yaml
from fedpriv.executables import tool_path
from fedpriv.outputs import release_path


def _run(argv: Sequence[str], *, capture: bool = False,
         timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Flower command, found beside this interpreter first (``launcher.tool_path``);
    ``capture``: keep its output (text) instead of passing it through."""
    print("fedpriv: $ " + shlex.join(argv), flush=True)
    env = tool_path(dict(os.environ))
    return subprocess.run(list(argv), check=False, env=env, capture_output=capture, text=True,
                          timeout=timeout)


def _tls(args: argparse.Namespace) -> str | None:
    if args.insecure == bool(args.root_certificates):
        raise SystemExit("fedpriv: give either --root-certificates CA (TLS) or --insecure")
    if args.root_certificates:
        ca = Path(args.root_certificates).expanduser().resolve()
        if not ca.is_file():
            raise SystemExit(f"fedpriv: CA certificate {ca} does not exist (generate it with "
                             "`fedpriv deploy certs DIR`)")
        return str(ca)
    return None


def cmd_health(args: argparse.Namespace) -> int:
    ca = _tls(args)
    deadline = time.monotonic() + args.wait
    while True:
        if check_health(args.superlink, ca):
            print(f"fedpriv: SuperLink at {args.superlink} is up", flush=True)
            return 0
        if time.monotonic() >= deadline:
            print(f"fedpriv: SuperLink at {args.superlink} does not answer", file=sys.stderr)
            return 1
        time.sleep(0.5)


def cmd_register(args: argparse.Namespace) -> int:
    ca = _tls(args)
    if ca is None:
        raise SystemExit("fedpriv: SuperNode registration needs TLS (--root-certificates)")
    write_connection(connection_toml(args.superlink, ca, args.connection))
    for key in args.public_keys:
        proc = _run(register_argv(str(Path(key).expanduser().resolve()), args.connection),
                    capture=True)
        output = proc.stdout + proc.stderr
        print(output.strip(), flush=True)
        if proc.returncode != 0:
            if "already in use" in output:  # registered by an earlier `register`: fine
                continue
            print(f"fedpriv: could not register {key} (exit {proc.returncode})",
                  file=sys.stderr)
            return 1
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from fedpriv.config import ConfigError
    from fedpriv.configure import parse_config
    from fedpriv.privacy.accounting import InfeasiblePlanError
    from fedpriv.server import check_run

    ca = _tls(args)
    if not Path(args.results).is_absolute():
        raise SystemExit("fedpriv: --results must be an absolute path: the ServerApp writes it "
                         "on the SuperLink's machine, relative to a directory you do not know")
    sets = list(args.set or [])
    try:
        values = {**load_run_config(args.config, sets), "results-path": args.results}
        # size, plan and budget, first; a resumed run's checkpoint and the memory the run
        # needs are on the SuperLink's machine, where the ServerApp checks them
        check_run(parse_config({**values, "resume": False}, strict=True), here=False)
        # only what differs from the app's defaults goes on the command line
        explicit = read_config_file(args.config) if args.config else {}
        overrides = for_flower({**explicit, **parse_overrides(sets), "results-path":
                                args.results}, app_config_keys(args.app))
    except (ConfigError, InfeasiblePlanError) as err:
        print(f"fedpriv: invalid config: {err}", file=sys.stderr)
        return 2
    write_connection(connection_toml(args.superlink, ca, args.connection))
    results = Path(args.results)
    started = time.time()
    proc = _submit(submit_argv(args.app, overrides, args.connection), args.connection,
                   args.timeout)
    if proc.returncode != 0:
        print(f"fedpriv: `flwr run` failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    if args.no_check:
        return 0
    deadline = time.monotonic() + 30.0  # the log stream may end just before the file lands
    while time.monotonic() < deadline:
        if results.is_file() and results.stat().st_mtime >= started - 1.0:
            print(f"fedpriv: results of this run in {results} (operator report, not private) "
                  f"and {release_path(results)} (the release)", flush=True)
            from fedpriv.server import silent_run

            silent = silent_run(json.loads(results.read_text()))
            if silent is not None:
                print(f"fedpriv: {silent}", file=sys.stderr)
                return 1
            return 0
        time.sleep(0.5)
    print(f"fedpriv: the run ended but {results} was not written by it (see the SuperLink's "
          "log; --no-check when the SuperLink's files are not visible here)", file=sys.stderr)
    return 1


def _submit(argv: Sequence[str], connection: str,
            timeout: float | None) -> subprocess.CompletedProcess[str]:
    """``flwr run`` of a deployment, its stream passed through; the run's ID read from it, so
    that Ctrl-C, SIGTERM or ``--timeout`` stop the run on the SuperLink too (``flwr stop``):
    a run left going there would go on spending the users' privacy budget."""
    from fedpriv.stopping import Interrupted

    print("fedpriv: $ " + shlex.join(argv), flush=True)
    proc = subprocess.Popen(list(argv), env=tool_path(dict(os.environ)), text=True,
                            errors="replace", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    run_id: list[str] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    stopped = "the --timeout"
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            found = re.search(r"started run (\d+)", line)
            if found and not run_id:
                run_id.append(found.group(1))
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(list(argv), timeout or 0.0)
        return subprocess.CompletedProcess(list(argv), proc.wait())
    except (Interrupted, subprocess.TimeoutExpired) as err:
        stopped = str(err.args[0]) if isinstance(err, Interrupted) else stopped
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if run_id:  # the run itself, on the SuperLink
                done = _run(["flwr", "stop", run_id[0], connection], capture=True, timeout=60)
                state = ("stopped on the SuperLink" if done.returncode == 0 else "NOT stopped "
                         f"on the SuperLink: {(done.stdout + done.stderr).strip()[-300:]}")
                print(f"fedpriv: stopped by {stopped}: run {run_id[0]} {state}",
                      file=sys.stderr, flush=True)


def cmd_setup(args: argparse.Namespace) -> int:
    if args.certs:
        generate_certs(args.certs, args.nodes)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    if args.owner:
        for folder in filter(None, (args.certs, args.results)):
            chown_tree(Path(folder), args.owner)
    print("fedpriv: setup done", flush=True)
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    # the defaults stay: the SuperLink's own ServerApp runner connects to 127.0.0.1
    hosts = tuple(dict.fromkeys([*DEFAULT_HOSTS, *(args.host or [])]))
    root = generate_certs(args.directory, args.nodes, hosts=hosts, days=args.days,
                          force=args.force)
    print(f"fedpriv: certificates and SuperNode keys in {root} (keep ca/ and every *.key "
          "private; never commit them)")
    return 0


def cmd_compose(args: argparse.Namespace) -> int:
    settings = parse_overrides(args.set or [])
    sys.stdout.write(compose_yaml(args.nodes, secure=not args.insecure, settings=settings))
    return 0


def cmd_commands(args: argparse.Namespace) -> int:
    if not args.insecure and not args.certs:
        raise SystemExit("fedpriv: give --certs DIR (made by `fedpriv deploy certs DIR`) or "
                         "--insecure")
    d = Deployment(num_nodes=args.nodes, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                   node_ports=tuple(NODE_PORT + i for i in range(args.nodes)),
                   certs=None if args.insecure else str(Path(args.certs).resolve()),
                   mounted=False, app_dir=str(Path(args.app).resolve()),
                   node_data=args.node_data)
    results = str(Path(args.results).expanduser().resolve())
    mode = "TLS + SuperNode authentication" if d.secure else "INSECURE: no TLS, no node auth"
    print(f"# fedpriv deployment as plain processes on 127.0.0.1 ({mode}), in this order;")
    print("# the long-running ones each in a terminal of its own (or with ' &')")
    print("# 1. the SuperLink")
    print(shlex.join(superlink_command(d)))
    if d.secure:
        print("# 2. register the SuperNodes' public keys (once the SuperLink is up)")
        print(shlex.join(register_command(d)))
    print(f"# {3 if d.secure else 2}. one SuperNode per partition")
    for i in range(d.num_nodes):
        print(shlex.join(supernode_command(d, i)))
    print(f"# {4 if d.secure else 3}. submit the run; it ends when the results file is written")
    print(shlex.join(submit_command(d, results, parse_overrides(args.set or []))))
    return 0


def _reporting_errors(func: Callable[[argparse.Namespace], int]
                      ) -> Callable[[argparse.Namespace], int]:
    """A bad value (a ``ValueError``, ``ConfigError`` included) ends the command with exit 2
    and a one-line message instead of a traceback."""
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except ValueError as err:
            print(f"fedpriv: {err}", file=sys.stderr)
            return 2
    return run


def add_parser(
        subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Install ``deploy`` and its sub-commands into ``subparsers`` (the ``fedpriv`` parser's)."""
    parser = subparsers.add_parser(
        "deploy", help="a real deployment: certificates, compose file, process commands",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="deploy_command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int],
                summary: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=summary)
        p.set_defaults(func=_reporting_errors(func))
        return p

    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--superlink", required=True, help="SuperLink address HOST:PORT")
        p.add_argument("--root-certificates", help="CA certificate (TLS)")
        p.add_argument("--insecure", action="store_true", help="no TLS (insecure SuperLink)")
        p.add_argument("--connection", default=CONNECTION,
                       help=f"connection name in $FLWR_HOME/config.toml (default {CONNECTION})")

    p = command("certs", cmd_certs, "generate the CA, SuperLink certificate, SuperNode keys")
    p.add_argument("directory")
    p.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs (default 3)")
    p.add_argument("--host", action="append",
                   help="add a name or address of the SuperLink to its certificate "
                        f"(repeat; always valid for {', '.join(DEFAULT_HOSTS)})")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--force", action="store_true", help="replace existing files")

    p = command("compose", cmd_compose, "print the docker-compose file")
    p.add_argument("--nodes", type=int, default=3, help="SuperNodes (default 3)")
    p.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode auth")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="run-config override of the submitted run")

    p = command("commands", cmd_commands, "print the same deployment as plain processes")
    p.add_argument("--certs", help="certificate folder made by `fedpriv deploy certs`")
    p.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode auth")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--app", default=".", help="the Flower app (this project's folder)")
    p.add_argument("--results", default=f"results/{RESULTS_FILE}")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--node-data", default="", metavar="PATH",
                   help="each SuperNode's own copy of a csv/parquet data file ({partition} is "
                        "its partition id): the node reads only its own users' rows")

    p = command("health", cmd_health, "exit 0 once the SuperLink answers")
    connection(p)
    p.add_argument("--wait", type=float, default=0.0, help="keep trying for this many seconds")

    p = command("register", cmd_register,
                "register SuperNode public keys (flwr supernode register)")
    connection(p)
    p.add_argument("public_keys", nargs="+", metavar="KEY.pub")

    p = command("submit", cmd_submit, "submit the run (flwr run), check its results file")
    connection(p)
    p.add_argument("--app", required=True, help="the Flower app folder (pyproject.toml)")
    p.add_argument("--results", required=True,
                   help="absolute results path, on the SuperLink's machine")
    p.add_argument("--config", help="run-config TOML (as for `fedpriv run`)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--timeout", type=float, default=None, help="give up after S seconds")
    p.add_argument("--no-check", action="store_true",
                   help="do not wait for the results file (SuperLink on another machine)")

    p = command("setup", cmd_setup, "(compose) certificates + folder ownership, one-shot")
    p.add_argument("--certs", help="certificate folder to create or complete")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--results", required=True, help="results folder to create")
    p.add_argument("--owner", help="UID:GID to hand the folders to")
    return parser
