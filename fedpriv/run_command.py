"""``fedpriv run``: one run, through Flower's simulation engine or in-process.

The run's output names are claimed before anything runs (``fedpriv.outputs.claim``: a run never
writes over another run's results); a signal stops every process of the run
(``fedpriv.stopping``: the command runs inside a ``RunGuard``) and says how to resume; the
wall time printed is the command's own (``command_seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fedpriv.config import ConfigError, RunConfig
from fedpriv.config_files import load_run_config
from fedpriv.configure import parse_config
from fedpriv.launcher import early_ray_head, run_flower
from fedpriv.ray_head import RayHead


def cmd_run(args: argparse.Namespace) -> int:
    from fedpriv.outputs import OutputTaken, claim, claim_free, unclaim

    try:
        if args.ray_address and args.engine != "flower":
            raise ConfigError("--ray-address attaches Flower's simulation engine to a Ray "
                              "cluster: it needs --engine flower")
        values = load_run_config(args.config, args.set or [])
        if args.resume:
            values["resume"] = True
        if args.out:
            values["results-path"] = args.out
        # --out names this run's files; a config's results-path is a name that is numbered
        # where taken (a config is run again and again, with overrides)
        named = bool(args.out) or args.resume
        out = Path(values["results-path"]).expanduser().resolve()
        # the run's output names, claimed before anything runs (fedpriv.outputs.claim)
        if named:
            claim(out, replace=args.overwrite)
        else:
            chosen = claim_free(out)
            if chosen != out:
                print(f"fedpriv: {out.parent} holds an earlier run's results; this run writes "
                      f"{chosen.name} (name it with --out)", file=sys.stderr)
            out = chosen
    except OutputTaken as err:
        print(f"fedpriv: results not overwritten: {err}; name another path with --out, or "
              "pass --overwrite to replace them", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"fedpriv: invalid config: {err}", file=sys.stderr)
        return 2
    try:
        return _run_claimed(args, values, out)
    finally:
        unclaim(out)


def _run_claimed(args: argparse.Namespace, values: dict[str, object], out: Path) -> int:
    """``fedpriv run`` once its output names are claimed: check, run, write, report."""
    from fedpriv import checkpoint
    from fedpriv.privacy.accounting import InfeasiblePlanError

    ckpt = head = None
    try:
        # absolute paths: the Flower ServerApp resolves relative ones against its own cwd
        values["results-path"] = str(out)
        config = parse_config(values, strict=True)
        ckpt = checkpoint.checkpoint_path(config) if config.checkpoint else None
        values.update({"results-path": str(out), "checkpoint-path": str(ckpt or "")})
        config = parse_config(values, strict=True)
        if args.engine == "flower":  # Ray starts while the plan is checked and Flower starts
            head = early_ray_head(config, args.keep_superlink, args.ray_address)
        return _checked_run(args, values, out, config, ckpt, head)
    except (ConfigError, InfeasiblePlanError, checkpoint.CheckpointError) as err:
        print(f"fedpriv: invalid config: {err}", file=sys.stderr)
        return 2
    finally:
        if head is not None:
            head.stop()


def _checked_run(args: argparse.Namespace, values: dict[str, object], out: Path,
                 config: RunConfig, ckpt: Path | None, head: RayHead | None) -> int:
    """``fedpriv run`` once its config parses: check the plan and inputs, run, write, report."""
    from fedpriv import checkpoint
    from fedpriv.cost import estimate_line
    from fedpriv.engine import run_in_process
    from fedpriv.outputs import output_lines, release_path, run_files, write_outputs
    from fedpriv.privacy.accounting import InfeasiblePlanError
    from fedpriv.registry import get_algorithm
    from fedpriv.server import check_run, silent_run, summary_lines
    from fedpriv.stopping import Interrupted, stop_started

    try:
        check_run(config, ckpt)  # plan, budget ceiling, and on resume the checkpoint
        get_algorithm(config.algorithm).check_inputs(config)  # e.g. every cell of a data file
    except (ConfigError, InfeasiblePlanError, checkpoint.CheckpointError) as err:
        print(f"fedpriv: invalid config: {err}", file=sys.stderr)
        return 2
    for note in get_algorithm(config.algorithm).input_notes(config):
        print(f"fedpriv: {note}", file=sys.stderr)
    estimate = estimate_line(config)  # a long run says so before it starts
    if estimate:
        print(estimate, flush=True)
    for old in run_files(out):
        old.unlink(missing_ok=True)  # only with --overwrite: the claim refused them otherwise
    try:
        if args.engine == "inprocess":
            from fedpriv.data.sources import DatasetError

            try:
                results = run_in_process(config, checkpoint_path=ckpt)
            except (ConfigError, DatasetError) as err:  # found once the users' data is read
                print(f"fedpriv: the run stopped: {err}", file=sys.stderr)
                if ckpt is not None and ckpt.exists():
                    print(f"fedpriv: a checkpoint is at {ckpt} ({checkpoint.describe(ckpt)})",
                          file=sys.stderr)
                return 2
            report, release = write_outputs(results, out)
            if ckpt is not None:
                checkpoint.remove(ckpt)  # the results file is now the record of the run
            print("\n".join(summary_lines(results)))
            print("\n".join(output_lines(report, release, results)))
            print(f"fedpriv: done in {command_seconds():.1f} s (the whole command)")
            return _silent(silent_run(results))
        code = run_flower(config, values, out, args.keep_superlink,
                          ray_address=args.ray_address, head=head)
    except Interrupted as signalled:
        stop_started()  # frozen, then stopped: no step completes after the signal
        print(_stopped_line(signalled, ckpt, _resume_command(args, out)), file=sys.stderr,
              flush=True)
        return 128 + signalled.signum
    if code == 0 and not release_path(out).is_file():
        print(f"fedpriv: the run wrote {out} but no release beside it", file=sys.stderr)
        code = 1
    if code == 0:
        code = _silent(silent_run(json.loads(out.read_text())))
        print(f"fedpriv: done in {command_seconds():.1f} s (the whole command: start-up, the "
              "run, shutdown)")
    if code != 0 and ckpt is not None and ckpt.exists():
        print(f"fedpriv: a checkpoint is at {ckpt} ({checkpoint.describe(ckpt)}); continue "
              f"with: fedpriv run ... --resume --out {out}", file=sys.stderr)
    return code


def _resume_command(args: argparse.Namespace, out: Path) -> str:
    import shlex

    argv = ["fedpriv", "run", *([args.config] if args.config else [])]
    for item in args.set or []:
        argv += ["--set", item]
    return shlex.join([*argv, "--engine", args.engine, "--resume", "--out", str(out)])


def _stopped_line(signalled: BaseException, ckpt: Path | None, resume: str) -> str:
    """The one line a run stopped by a signal prints: what is kept, how to go on."""
    from fedpriv import checkpoint

    what = "Ctrl-C" if getattr(signalled, "signum", None) == 2 else "SIGTERM"
    if ckpt is not None and ckpt.exists():
        return (f"fedpriv: stopped by {what}; every process of the run is stopped, nothing "
                f"released; the checkpoint keeps {checkpoint.describe(ckpt)}; continue with: "
                f"{resume}")
    return (f"fedpriv: stopped by {what} before a step was checkpointed; every process of "
            "the run is stopped, nothing released, no budget recorded")


_STARTED: list[float] = [time.monotonic(), 1.0]


def start_clock(from_process_start: bool) -> None:
    """Where ``command_seconds`` counts from: the process's start (a command line), or now
    (a command run from Python, ``fedpriv.cli.main(argv)``)."""
    _STARTED[:] = [time.monotonic(), 1.0 if from_process_start else 0.0]


def command_seconds() -> float:
    """Seconds since this process started (Linux /proc; else since the CLI was imported):
    the wall time a user measures, start-up and shutdown included. A command run from
    Python (``main(argv)``) counts from its call."""
    if _STARTED[1] == 0.0:
        return time.monotonic() - _STARTED[0]
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(stat[19]) / ticks
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _STARTED[0]


def _silent(message: str | None) -> int:
    """Exit status 1, with the message, for a run that no node answered; else 0."""
    if message is None:
        return 0
    print(f"fedpriv: {message}", file=sys.stderr)
    return 1
