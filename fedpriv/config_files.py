"""Run-config files and ``--set key=value`` overrides: reading them, and writing TOML values.

Every command that takes a run config (``fedpriv run``, ``sweep``, ``audit``, ``deploy submit``)
reads it through ``load_run_config``, and every place that writes a run-config value back out
(the launcher's run-config file, ``flwr run --run-config``, the compose file) encodes it with
``toml_value``. This module sits below all of them and imports nothing of fedpriv but the
keys (``fedpriv.config``, ``fedpriv.configure``), so the commands and launchers can share it
without importing each other.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedpriv.config import PLUGIN_CONFIG, ConfigError, default_mapping
from fedpriv.configure import select_keys


def parse_value(text: str) -> Any:
    """A TOML literal (``2.0``, ``true``, ``"x"``) as its value; a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def split_override(item: str) -> tuple[str, Any]:
    """``"key=value"`` (one ``--set``) as ``(key, value)``."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, text = item.split("=", 1)
    return key.strip(), parse_value(text.strip())


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Several ``--set`` items as one mapping (a later item wins)."""
    return dict(split_override(item) for item in items)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The keys a run-config TOML file sets, as written (no defaults)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with p.open("rb") as fh:
        try:
            return tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(toml_error(path, err)) from None


_WHERE = re.compile(r"^(?P<what>.*?)\s*\(at line (?P<line>\d+), column (?P<column>\d+)\)$",
                    re.DOTALL)


def toml_error(path: str | os.PathLike[str], err: tomllib.TOMLDecodeError) -> str:
    """A TOML syntax error as ``FILE:LINE:COLUMN: not valid TOML: WHAT`` (the form editors and
    terminals link to), from tomllib's ``WHAT (at line L, column C)``; an error at the end of
    the document keeps tomllib's own words for where."""
    found = _WHERE.match(str(err))
    if found is None:
        return f"{path}: not valid TOML: {err}"
    return f"{path}:{found['line']}:{found['column']}: not valid TOML: {found['what']}"


def load_run_config(path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The defaults, updated by the file at ``path`` (if any), then by the ``--set`` items.

    A ``--set algorithm=...`` that switches the file to another algorithm keeps, of the file,
    only the keys that algorithm reads (the file is then a base, like a sweep's ``[base]``) and
    says on stderr which keys it left out; everything set with ``--set`` stays strict."""
    values = default_mapping()
    sets = parse_overrides(overrides)
    if path:
        given = read_config_file(path)
        for table, command in (("sweep", "sweep"), ("series", "sweep"), ("tune", "tune")):
            if isinstance(given.get(table), (dict, list)):
                raise ConfigError(f"{path} is a {command} file (it has a [{table}] table), not "
                                  f"a run config: run it with `fedpriv {command} {path}`")
        if "algorithm" in sets and sets["algorithm"] != given.get("algorithm",
                                                                  values["algorithm"]):
            kept = select_keys({**given, "algorithm": sets["algorithm"]})
            dropped = sorted(set(given) - set(kept) - {"algorithm"})
            if dropped:
                print(f"fedpriv: {path}: {sets['algorithm']} does not read {dropped}; left out",
                      file=sys.stderr)
            given = {k: v for k, v in given.items() if k in kept or k == "algorithm"}
        values.update(given)
    values.update(sets)
    return values


def toml_value(value: Any) -> str:
    """A TOML literal of a run-config value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def _inner_value(key: str, value: Any) -> str:
    """A value inside ``plugin-config``: strings as TOML literal strings ('x'), because Flower's
    ``--run-config key="..."`` parser ends a double-quoted value at the first inner quote."""
    if isinstance(value, str):
        if "'" in value or '"' in value or "\n" in value:
            raise ConfigError(f"{key}: a plug-in key's string value cannot hold quotes or line "
                              f"breaks through Flower's run-config, got {value!r}")
        return f"'{value}'"
    return toml_value(value)


def app_config_keys(app_dir: str | Path) -> set[str] | None:
    """The keys a Flower app's ``[tool.flwr.app.config]`` lists (Flower refuses run-config
    overrides of any other key); None if the app's pyproject.toml cannot be read."""
    try:
        with (Path(app_dir) / "pyproject.toml").open("rb") as fh:
            return set(tomllib.load(fh)["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None


def for_flower(values: dict[str, Any], app_keys: set[str] | None) -> dict[str, Any]:
    """``values`` as a Flower run-config for an app listing ``app_keys``: the keys the app does
    not list (a plug-in algorithm's own) move into the core key ``plugin-config``, a TOML inline
    table that ``fedpriv.configure.parse_config`` unpacks and checks strictly."""
    if app_keys is None:
        return dict(values)
    extra = {k: v for k, v in values.items() if k not in app_keys}
    if not extra:
        return dict(values)
    if values.get(PLUGIN_CONFIG):
        raise ConfigError(f"{PLUGIN_CONFIG}: give the plug-in's keys either in it or directly, "
                          f"not both ({sorted(extra)})")
    table = "{ " + ", ".join(f"{k} = {_inner_value(k, v)}" for k, v in extra.items()) + " }"
    return {**{k: v for k, v in values.items() if k in app_keys}, PLUGIN_CONFIG: table}
