"""``fedpriv`` command line, the top of the package: it imports the commands, nothing imports it.

    fedpriv run CONFIG.toml [--set key=value ...] [--out results.json] [--engine flower|inprocess]
                [--resume] [--overwrite] [--keep-superlink] [--ray-address HOST:PORT]
    fedpriv sweep SWEEP.toml [--set key=value ...] [--out DIR] [--jobs N] [--plot PNG]
                [--engine inprocess|flower]
    fedpriv tune CONFIG.toml [--set key=value ...] [--out DIR] [--engine inprocess|flower]
    fedpriv audit [CONFIG.toml] [--set key=value ...] [--trials N] [--alpha A] [--noise-scale S]
    fedpriv audit CONFIG.toml --neighbours [--user ID] [--releases N] [--nodes N] [--copy]
    fedpriv algorithms [NAME] [--verbose | --markdown | --flwr-config]
    fedpriv deploy certs|compose|commands|health|register|submit|setup ...

``run`` goes through Flower's simulation engine (``fedpriv.launcher``) or in-process
(``fedpriv.engine``); run configs are read by ``fedpriv.config_files``; the ``deploy``
sub-commands (a real SuperLink + SuperNodes deployment, docker-compose) are installed by
``fedpriv.deploy.cli``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fedpriv import allocator
from fedpriv.config import ConfigError
from fedpriv.config_files import load_run_config, parse_overrides
from fedpriv.configure import parse_config
from fedpriv.deploy import cli as deploy_cli
from fedpriv.run_command import cmd_run, start_clock


def cmd_sweep(args: argparse.Namespace) -> int:
    from fedpriv import sweep

    try:
        overrides = parse_overrides(args.set or [])
        print(f"fedpriv sweep: validating {args.config} (every run config; every privacy plan "
              "calibrated)", flush=True)
        spec = sweep.load_sweep(args.config, overrides)
    except ConfigError as err:
        print(f"fedpriv: invalid sweep: {err}", file=sys.stderr)
        return 2
    from fedpriv.outputs import FOLDER_CLAIM, OutputTaken, claim_folder, unclaim

    out = Path(args.out or Path("results") / "sweeps" / spec.name).expanduser().resolve()
    try:  # finished runs in it are reused, never rewritten; two sweeps never share it
        out = claim_folder(out, None, named=bool(args.out))
    except OutputTaken as err:
        print(f"fedpriv: sweep not started: {err}", file=sys.stderr)
        return 2
    try:
        return _sweep_claimed(args, spec, out)
    finally:
        unclaim(out / FOLDER_CLAIM)


def _sweep_claimed(args: argparse.Namespace, spec: Any, out: Path) -> int:
    from fedpriv import sweep, sweep_figure

    jobs = args.jobs if args.jobs > 0 else (os.cpu_count() or 1)
    try:
        rows = sweep.run_sweep(spec, out, jobs=1 if args.engine == "flower" else jobs,
                               engine=args.engine, log=lambda line: print(line, flush=True))
    except ConfigError as err:  # what only a run can show (a metric the runs do not report)
        print(f"fedpriv: sweep stopped: {err}", file=sys.stderr)
        return 2
    csv_path, json_path = sweep.write_table(rows, out)
    figure = sweep_figure.plot(spec, rows, out / "figure.png")
    curves = sweep_figure.plot_curves(spec, out / "runs", out / "curves.png")
    if curves is None:
        (out / "curves.png").unlink(missing_ok=True)  # never a stale one beside this table
    print(sweep.markdown_table(rows, spec))
    print(f"fedpriv: table {csv_path} and {json_path}; figure {figure}")
    if curves is not None:
        print(f"fedpriv: learning curves (the runs' eval steps; exact, operator only) {curves}")
    if args.plot:
        target = Path(args.plot).expanduser().resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(figure.read_bytes())
        print(f"fedpriv: figure copied to {target}")
        if curves is not None:
            curves_target = target.with_name(f"{target.stem}_curves{target.suffix}")
            curves_target.write_bytes(curves.read_bytes())
            print(f"fedpriv: learning curves copied to {curves_target}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from fedpriv.outputs import FOLDER_CLAIM, OutputTaken, claim_folder, unclaim
    from fedpriv.privacy.accounting import InfeasiblePlanError
    from fedpriv.tuning.run import run_tuning, table_lines
    from fedpriv.tuning.spec import load_tune

    try:
        print(f"fedpriv tune: validating {args.config} (every point of the space; the budget "
              "calibrated)", flush=True)
        spec = load_tune(args.config, args.set or [])
        out = Path(args.out or Path("results") / "tune" / spec.name).expanduser().resolve()
        out = claim_folder(out, "tuning-report.json", named=bool(args.out),
                           replace=args.overwrite)
    except OutputTaken as err:
        print(f"fedpriv: tuning not started: {err}; name another folder with --out, or pass "
              "--overwrite to replace it", file=sys.stderr)
        return 2
    except (ConfigError, InfeasiblePlanError) as err:
        print(f"fedpriv: invalid tuning: {err}", file=sys.stderr)
        return 2
    try:
        report = run_tuning(spec, out, engine=args.engine,
                            log=lambda line: print(line, flush=True))
    except (ConfigError, InfeasiblePlanError) as err:
        print(f"fedpriv: invalid tuning: {err}", file=sys.stderr)
        return 2
    finally:
        unclaim(out / FOLDER_CLAIM)
    print("\n".join(table_lines(report, spec.score, spec.maximize)))
    t = report["tuning"]
    print(f"fedpriv tune {spec.name}: {report['candidates_run']} candidates; the whole tuning "
          f"spent (epsilon {t['epsilon']:.4g}, delta {t['delta']:g}); each candidate "
          f"(epsilon {t['candidate_target_epsilon']:.4g})")
    winner = report["winner"]
    if winner is None:
        print("fedpriv tune: no candidate ran (K = 0); nothing is released")
        return 0
    print(f"fedpriv tune: selected candidate {winner['candidate']}: {winner['point']}")
    print(f"fedpriv: operator report {out / 'tuning-report.json'} (NOT private: every "
          f"candidate); winner {winner['report']}; release {winner['release']}")
    print(f"fedpriv: rerun the winner with: {winner['rerun']}")
    return 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    from fedpriv import keys

    if args.markdown:
        print(keys.markdown_tables())
    elif args.flwr_config:
        print(keys.app_config_toml())
    else:
        try:
            print("\n".join(keys.algorithm_lines(args.name, verbose=args.verbose or
                                                  bool(args.name))))
        except KeyError as err:
            print(f"fedpriv: {err.args[0]}", file=sys.stderr)
            return 2
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from fedpriv.audit import run_audit
    from fedpriv.privacy.accounting import InfeasiblePlanError
    from fedpriv.server import check_plan

    if args.neighbours:
        return cmd_neighbours(args)
    try:
        config = parse_config(load_run_config(args.config, args.set or []), strict=True)
        check_plan(config)
        for bad, message in ((args.trials < 100, f"--trials: {args.trials}; at least 100"),
                             (not 0 < args.alpha < 1, f"--alpha: {args.alpha}; in (0, 1)"),
                             (not args.noise_scale > 0,
                              f"--noise-scale: {args.noise_scale}; above 0")):
            if bad:
                raise ConfigError(message)
    except (ConfigError, InfeasiblePlanError) as err:
        print(f"fedpriv: invalid audit: {err}", file=sys.stderr)
        return 2
    print(f"fedpriv audit: {config.algorithm}, {args.trials} trials per population ...",
          flush=True)
    try:
        result = run_audit(config, trials=args.trials, alpha=args.alpha,
                           noise_scale=args.noise_scale)
    except ValueError as err:
        print(f"fedpriv: cannot audit: {err}", file=sys.stderr)
        return 2
    print("\n".join(result.lines()))
    return 1 if result.violation else 0


def cmd_neighbours(args: argparse.Namespace) -> int:
    """``fedpriv audit --neighbours``: the run's releases on its data file and on neighbours
    that differ in one user, each at most the stated sensitivity apart, and nothing else the
    server sees or publishes different (``fedpriv.neighbours``)."""
    import tempfile

    from fedpriv.algorithms.deep.params import FILE_SOURCES, DataKeys
    from fedpriv.neighbour_data import file_neighbours
    from fedpriv.neighbours import check_neighbour, table
    from fedpriv.privacy.accounting import InfeasiblePlanError
    from fedpriv.registry import get_algorithm
    from fedpriv.server import check_plan

    try:
        config = parse_config(load_run_config(args.config, args.set or []), strict=True)
        # the deep family's data keys: the command rewrites the run's data file
        if not isinstance(config, DataKeys) or config.dataset not in FILE_SOURCES:
            raise ConfigError("--neighbours: builds neighbours of your data file (dataset = "
                              "npz, csv or parquet); the synthetic problems and the built-in "
                              "datasets are covered by the project's tests "
                              "(tests/test_neighbours.py)")
        for bad, message in ((args.releases is not None and args.releases < 1,
                              f"--releases: {args.releases}; at least 1"),
                             (args.nodes < 1, f"--nodes: {args.nodes}; at least 1")):
            if bad:
                raise ConfigError(message)
        check_plan(config)
        get_algorithm(config.algorithm).check_inputs(config)
    except (ConfigError, InfeasiblePlanError) as err:
        print(f"fedpriv: invalid audit: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fedpriv-neighbours-",
                                     dir=args.work) as folder:
        try:
            base, neighbours = file_neighbours(config, Path(folder), args.user)
        except ValueError as err:
            print(f"fedpriv: cannot audit: {err}", file=sys.stderr)
            return 2
        which = ("every release" if args.releases is None
                 else f"the first {args.releases} releases")
        print(f"fedpriv audit --neighbours: {config.algorithm} on {config.data_file}: "
              f"{len(neighbours)} neighbours, {which} each ({args.nodes} nodes, in-process, "
              "the nodes' and the server's noise repeated on each neighbour)", flush=True)
        checks = []
        for i, neighbour in enumerate(neighbours, 1):
            found = check_neighbour(base, neighbour, args.nodes, args.releases,
                                    "float32" if config.algorithm.startswith(("deep-", "fewshot-"))
                                    else "float64", ("own", "copy") if args.copy else ("own",))
            checks += found
            worst = max((c.ratio for c in found), default=0.0)
            print(f"  [{i}/{len(neighbours)}] {neighbour.name}: worst distance / bound "
                  f"{worst:.3f}", flush=True)
    print("\n".join(table(checks)))
    released = [c for c in checks if not c.compared]
    failed = [c for c in released if not c.ok]
    compared = [c for c in checks if c.compared]
    differ = [c for c in compared if not c.ok]
    print(f"fedpriv audit --neighbours: {len(released) - len(failed)} of {len(released)} "
          "releases within the stated sensitivity"
          + ("" if not failed else f"; {len(failed)} EXCEED it"))
    print(f"fedpriv audit --neighbours: {len(compared) - len(differ)} of {len(compared)} "
          "comparisons of the server's view, broadcast, ledger and release document identical"
          + ("" if not differ else f"; {len(differ)} DIFFER"))
    return 1 if failed or differ or not released else 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fedpriv`` parser: every sub-command, each with its ``func``."""
    parser = argparse.ArgumentParser(prog="fedpriv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment config")
    run.add_argument("config", nargs="?", help="run-config TOML (flat kebab-case keys)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    run.add_argument("--out", help="results JSON path (default: the config's results-path)")
    run.add_argument("--engine", choices=("flower", "inprocess"), default="flower",
                     help="flower: Flower simulation engine (default); inprocess: no Flower")
    run.add_argument("--resume", action="store_true",
                     help="continue an interrupted run from its checkpoint (same config)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the results already at --out (default: refused; a run "
                          "never writes over another run's results)")
    run.add_argument("--keep-superlink", action="store_true",
                     help="leave the run's local SuperLink running (its port and PID are "
                          "printed)")
    run.add_argument("--ray-address", metavar="HOST:PORT",
                     default=os.environ.get("FEDPRIV_RAY_ADDRESS") or None,
                     help="run the simulation on this existing Ray cluster (its head's GCS "
                          "address, as `ray start --head` prints) instead of a Ray instance of "
                          "its own; default $FEDPRIV_RAY_ADDRESS")
    run.set_defaults(func=cmd_run)
    sw = sub.add_parser("sweep", help="run a grid of algorithms x epsilon x seeds; table + plot")
    sw.add_argument("config", help="sweep TOML ([sweep], [base], [[series]]; see configs/)")
    sw.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a run-config key of every run (e.g. num-users=2000)")
    sw.add_argument("--out", help="output folder (default: results/sweeps/<name>)")
    sw.add_argument("--jobs", type=int, default=0,
                    help="runs in parallel (in-process engine; default: one per CPU)")
    sw.add_argument("--engine", choices=("inprocess", "flower"), default="inprocess",
                    help="inprocess (default): the same core and server without Flower's "
                         "start-up cost; flower: every run through the simulation engine")
    sw.add_argument("--plot", metavar="PNG", help="also copy the figure to this path")
    sw.set_defaults(func=cmd_sweep)
    tu = sub.add_parser("tune", help="private hyperparameter selection, its cost counted in "
                        "epsilon (Papernot & Steinke random stopping, or composed)")
    tu.add_argument("config", help="run-config TOML with a [tune] table (see configs/tune_*)")
    tu.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a base key, or a [tune] key as tune.KEY=VALUE")
    tu.add_argument("--out", help="output folder (default: results/tune/<name>)")
    tu.add_argument("--overwrite", action="store_true",
                    help="replace an earlier tuning's results in --out (default: refused)")
    tu.add_argument("--engine", choices=("inprocess", "flower"), default="inprocess",
                    help="inprocess (default) or flower (one SuperLink and Ray instance for "
                         "every candidate)")
    tu.set_defaults(func=cmd_tune)
    au = sub.add_parser("audit", help="empirical lower bound on the epsilon of one release")
    au.add_argument("config", nargs="?", help="run-config TOML (flat kebab-case keys)")
    au.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    au.add_argument("--trials", type=int, default=20000,
                    help="trials per population (default 20000, at least 100)")
    au.add_argument("--alpha", type=float, default=0.05,
                    help="1 - confidence of the lower bound (default 0.05)")
    au.add_argument("--noise-scale", type=float, default=1.0,
                    help="multiply the calibrated noise (below 1: a deliberately broken "
                         "release, to see the audit catch it)")
    au.add_argument("--neighbours", action="store_true",
                    help="instead: run the releases on your data file and on copies "
                         "that differ in one user (removed, added, renamed, huge/nan "
                         "features, few rows, a bad label), the same seeds and noise, and "
                         "check each release moved at most the stated sensitivity and "
                         "nothing else the server sees or publishes differs")
    au.add_argument("--user", help="--neighbours: the user changed (its id; default: the "
                                   "middle one)")
    au.add_argument("--releases", type=int, default=None,
                    help="--neighbours: compare only the first N releases per neighbour "
                         "(default: every release, the private evaluation's included)")
    au.add_argument("--nodes", type=int, default=2,
                    help="--neighbours: nodes the users are spread over (default 2)")
    au.add_argument("--copy", action="store_true",
                    help="--neighbours: also judge each release on a copy of D's server (the "
                         "earlier, weaker judgement; blind to state the server keeps)")
    au.add_argument("--work", help="--neighbours: folder for the neighbour files (default: "
                                   "a temporary folder, removed after)")
    au.set_defaults(func=cmd_audit)
    algos = sub.add_parser("algorithms", help="list registered algorithms with their own keys")
    algos.add_argument("name", nargs="?", help="one algorithm, with each key's meaning")
    algos.add_argument("--verbose", action="store_true", help="each key's meaning and range")
    algos.add_argument("--markdown", action="store_true",
                       help="the key tables of docs/reference/keys.md (built-in algorithms)")
    algos.add_argument("--flwr-config", action="store_true",
                       help="the Flower app's [tool.flwr.app.config] table")
    algos.set_defaults(func=cmd_algorithms)
    deploy_cli.add_parser(sub)
    return parser


GUARDED = ("run", "sweep", "tune", "submit")
"""Commands that start processes: each runs inside a ``fedpriv.stopping.RunGuard``."""


def main(argv: list[str] | None = None) -> int:
    from fedpriv.stopping import Interrupted, RunGuard

    start_clock(from_process_start=argv is None)
    allocator.tune()  # keep freed memory: a compute step reuses its pages (fedpriv.allocator)
    args = build_parser().parse_args(argv)
    if args.command not in GUARDED and getattr(args, "deploy_command", None) not in GUARDED:
        return int(args.func(args))
    try:
        with RunGuard():
            return int(args.func(args))
    except Interrupted as signalled:  # stopped by the guard on its way out
        kept = {"sweep": "; the runs finished so far are kept, and the same command reuses "
                         "them"}.get(args.command, "")
        print(f"fedpriv: {args.command} stopped by {signalled.args[0]}; every process it "
              f"started is stopped{kept}", file=sys.stderr)
        return 128 + signalled.signum


if __name__ == "__main__":
    raise SystemExit(main())
