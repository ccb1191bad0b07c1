"""Where fedpriv finds the commands it runs as processes (``flwr``, ``ray``, ``flower-superlink``,
``flower-supernode``): beside the interpreter that runs fedpriv first, then on PATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def tool_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this interpreter's scripts folder first on PATH: ``flwr``, ``ray`` and the
    ``flower-superlink`` of a run are found beside the interpreter that runs
    fedpriv, so an environment works without being activated (a cron job, an IDE, a script
    calling /path/to/venv/bin/fedpriv)."""
    scripts = str(Path(sys.executable).parent)
    parts = env.get("PATH", "").split(os.pathsep)
    return {**env, "PATH": os.pathsep.join([scripts, *[p for p in parts if p != scripts]])}
