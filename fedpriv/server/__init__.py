"""The server side of a run, free of Flower: privacy plan, node-reply checks, noise, accounting.

``PrivateServer`` (``core``) keeps the step loop and owns one unit per job, each usable alone:

- ``replies``: checking node replies (every rejection kind) and bounding each node's sums;
- ``release``: calibrated noise, the exponential mechanism, the accountant and the budget guard;
- ``store``: the checkpoint file, its lock, and whether a checkpoint belongs to this run;
- ``report``: the per-step report, progress lines, the results dict and its summary.
"""

from fedpriv.server.core import PrivateServer, check_plan, check_run
from fedpriv.server.release import BudgetExceededError, Releaser, calibrate
from fedpriv.server.replies import REJECTION_KINDS, NodeReply, ReplyChecker
from fedpriv.server.report import (
    plan_lines,
    progress_line,
    results_dict,
    silent_run,
    summary_lines,
)
from fedpriv.server.store import CheckpointStore

__all__ = [
    "REJECTION_KINDS",
    "BudgetExceededError",
    "CheckpointStore",
    "NodeReply",
    "PrivateServer",
    "Releaser",
    "ReplyChecker",
    "calibrate",
    "check_plan",
    "check_run",
    "plan_lines",
    "progress_line",
    "results_dict",
    "silent_run",
    "summary_lines",
]
