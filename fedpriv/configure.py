"""Parse a run-config mapping into the chosen algorithm's typed config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpriv.config import RunConfig


def parse_config(values: Mapping[str, Any], strict: bool = False) -> RunConfig:
    return RunConfig.from_mapping(values, strict)
