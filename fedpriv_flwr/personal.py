"""Personalization for any Flower ClientApp: one node is one user, its personal layers stay on it.

Two pieces, used together::

    app = ClientApp(mods=[personalize(r"^fc3\\.", schedule="fedrep")])

    @app.train()
    def train(msg, context):
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        fit_personal(model, context, trainloader)  # fedrep: the head fitted, then frozen
        fit(model, epochs=local_epochs)  # the handler's own training: the body
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), ...}), reply_to=msg)

(``fit_personal`` fits a head that is one ``torch.nn.Linear``; for other personal layers, loop
over ``personal_phases(model, context)``: each phase freezes what it does not train.)

``personalize(pattern, schedule)`` is a client mod. The layers whose names match ``pattern``
(``re.search``) are the node's *personal* layers, the others are *shared*.

* ``schedule="fedrep"`` (FedRep): the node keeps its personal layers. On every incoming
  ``train``/``evaluate`` message (also ``train.<action>``/``evaluate.<action>``) the mod puts the
  node's own values of the personal keys into the incoming ArrayRecord(s) (first round: the
  server's initial values are kept); on the reply to ``train`` it stores the reply's personal
  arrays and removes them from every ArrayRecord of the reply: they never leave the node, and
  the server (e.g. plain ``FedAvg``, which averages the keys the replies hold) only ever sees
  and updates the shared layers. The stored layers live in ``context.state`` and, when the
  node config sets ``personal-state-dir`` (``state_dir_key``), also in the file
  ``personal-run<run_id>-node<node_id>.npz`` of that folder (numpy, atomic writes), from which a
  restarted SuperNode (empty ``context.state``) reloads them. A SuperNode keeps its node id
  across restarts only with SuperNode authentication (a registered key); an insecure SuperNode
  gets a new node id at every start, and so does not find its file again.
* ``schedule="finetune"`` (FedAvg, then fine-tuning): training sends the whole model; before
  evaluating, the node fine-tunes the global personal layers on its own data.

In both schedules the personal keys are removed from any ArrayRecord of an ``evaluate`` reply.
A message from ``PrivateStrategy`` carries the server's personal-layer pattern
(``PERSONAL_CONFIG``): the mod answers one that is not its own (``fedrep``: the same pattern;
``finetune``: none) with an error reply, before any training (``fedpriv_flwr.agreement``).
The mod records the message kind, pattern and schedule in ``context.state`` (a ConfigRecord
under ``STATE_KEY``), which ``personal_phases(model, context)`` reads to tell the handler
which parameters to train in which order: ``train`` + fedrep: ``[personal, shared]``;
``train`` + finetune: ``[all]``; ``evaluate``: ``[personal]`` (refit the node's head on the
current shared layers, or fine-tune the global head) before the handler evaluates.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import suppress
from logging import ERROR
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import log
from flwr.common.constant import ErrorCode

if TYPE_CHECKING:
    import torch

__all__ = ["PERSONAL_CONFIG", "SCHEDULES", "STATE_KEY", "Phase", "fit_personal", "personal_keys",
           "personal_phases", "personalize", "state_file"]

SCHEDULES = ("fedrep", "finetune")
PERSONAL_CONFIG = "fedpriv-personal-layers"
"""Config key of the server's personal-layer pattern (``PrivateStrategy`` sends it with every
train/evaluate message; ``""``: none): the mod refuses a message whose pattern is not its own
(``fedrep``: the same; ``finetune``: none), before any training."""
STATE_KEY = "fedpriv.personal"
"""Key of the mod's ConfigRecord in ``context.state`` (pattern, schedule, kind, source)."""
_ARRAYS_KEY = STATE_KEY + ".arrays."
"""Prefix of the node's stored personal arrays in ``context.state`` (+ the ArrayRecord's name)."""
_FILE_FORMAT = 1


class PersonalizationError(ValueError):
    """A precondition of the personalization mod failed (the reply is an error message)."""


# -- the personal keys ----------------------------------------------------------------------------
def personal_keys(pattern: str, keys: Iterable[str]) -> list[str]:
    """The names among ``keys`` that the regular expression ``pattern`` matches (``re.search``).

    Raises ValueError, naming the pattern and some of the keys, when it matches none of them or
    all of them (then nothing would be shared).
    """
    keys = list(keys)
    regex = _compile(pattern)
    matched = [k for k in keys if regex.search(k)]
    if not matched:
        raise ValueError(f"the personal-layer pattern {pattern!r} matches none of the "
                         f"{len(keys)} keys {_some(keys)}")
    if len(matched) == len(keys):
        raise ValueError(f"the personal-layer pattern {pattern!r} matches every key "
                         f"{_some(keys)}: nothing would be shared")
    return matched


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"the personal-layer pattern {pattern!r} is not a regular "
                         f"expression: {err}") from None


def _some(keys: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}]"


# -- the client mod -------------------------------------------------------------------------------
def personalize(pattern: str, schedule: str = "fedrep",
                state_dir_key: str = "personal-state-dir") -> Mod:
    """A Flower client mod that keeps the layers matching ``pattern`` personal (module doc)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    regex = _compile(pattern)

    def personalize_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        kind = msg.metadata.message_type.split(".", 1)[0]
        if kind not in ("train", "evaluate") or not msg.has_content():
            return call_next(msg, context)
        expected = _server_pattern(msg)
        mine = pattern if schedule == "fedrep" else ""
        if expected is not None and expected != mine:
            return _error_reply(msg, _mismatch(expected, pattern, schedule))
        directory = context.node_config.get(state_dir_key)
        store = _Store(context, pattern, str(directory) if directory else None)
        try:
            source = _prepare(msg, store, regex, schedule)
        except PersonalizationError as err:
            return _error_reply(msg, str(err))
        context.state[STATE_KEY] = ConfigRecord({
            "pattern": pattern, "schedule": schedule, "kind": kind,
            "message-type": msg.metadata.message_type, "source": source})
        reply = call_next(msg, context)
        if reply.has_error() or not reply.has_content():
            return reply
        kept = _strip(reply, regex, keep=schedule == "finetune" and kind == "train")
        if schedule == "fedrep" and kind == "train" and kept:
            store.save(kept)
        return reply

    personalize_mod.__name__ = f"personalize({pattern!r}, {schedule!r})"
    return personalize_mod


def _server_pattern(msg: Message) -> str | None:
    """The personal-layer pattern the server sent (``PERSONAL_CONFIG``; ``""``: none), or None
    from a server that sends none (a strategy other than ``PrivateStrategy``)."""
    for record in msg.content.config_records.values():
        if PERSONAL_CONFIG in record:
            return str(record[PERSONAL_CONFIG])
    return None


def _mismatch(expected: str, pattern: str, schedule: str) -> str:
    server = (f"PrivateStrategy(personal_layers={expected!r})" if expected
              else "PrivateStrategy without personal_layers")
    need = (f"personal_layers={pattern!r} on the server" if schedule == "fedrep"
            else "no personal_layers on the server, or schedule='fedrep' here")
    return (f"schedule mismatch: the server runs {server}, this node's mod "
            f"personalize({pattern!r}, schedule={schedule!r}) needs {need}")


def _prepare(msg: Message, store: _Store, regex: re.Pattern[str], schedule: str) -> str:
    """Check the incoming ArrayRecords and, under fedrep, put the node's personal values in;
    returns where the personal values come from: "server", "state" or "file"."""
    records = dict(msg.content.array_records)
    stored = store.load() if schedule == "fedrep" else {}
    for name, record in records.items():
        keys = list(record.keys())
        if any(regex.search(k) for k in keys):
            store.order[name] = keys  # the full model: remember its key order
        mine = stored.get(name)
        if mine is None:
            try:
                personal_keys(store.pattern, keys)
            except ValueError as err:
                hint = ""
                if schedule == "fedrep" and not any(regex.search(k) for k in keys):
                    hint = (f"; the incoming ArrayRecord {name!r} lacks the personal layers "
                            f"and node {store.context.node_id} has none stored "
                            f"({store.where()})")
                raise PersonalizationError(str(err) + hint) from None
            continue
        shared = [k for k in keys if not regex.search(k)]
        if not shared:
            raise PersonalizationError(f"the incoming ArrayRecord {name!r} holds only personal "
                                       f"keys (pattern {store.pattern!r}): {_some(keys)}")
        unknown = [k for k in keys if regex.search(k) and k not in mine]
        if unknown:
            raise PersonalizationError(
                f"the incoming ArrayRecord {name!r} has personal keys {_some(unknown)} that "
                f"node {store.context.node_id} has not stored ({store.where()})")
        for key, array in mine.items():
            if key in record and tuple(record[key].shape) != tuple(array.shape):
                raise PersonalizationError(
                    f"personal key {key!r}: the node stored shape {tuple(array.shape)}, the "
                    f"incoming arrays have {tuple(record[key].shape)} ({store.where()})")
        order = store.order.get(name) or keys
        merged = [k for k in order if k in record or k in mine]
        merged += [k for k in [*keys, *mine] if k not in merged]
        msg.content[name] = ArrayRecord({k: mine[k] if k in mine else record[k] for k in merged})
    return store.source if any(name in stored for name in records) else "server"


def _strip(reply: Message, regex: re.Pattern[str], keep: bool) -> dict[str, ArrayRecord]:
    """The personal arrays of the reply, per ArrayRecord name; unless ``keep``, they are removed
    from the reply."""
    found: dict[str, ArrayRecord] = {}
    for name, record in list(reply.content.array_records.items()):
        personal = [k for k in record.keys() if regex.search(k)]
        if not personal:
            continue
        found[name] = ArrayRecord({k: record[k] for k in personal})
        if not keep:
            reply.content[name] = ArrayRecord(
                {k: v for k, v in record.items() if k not in found[name]})
    return found


def _error_reply(msg: Message, reason: str) -> Message:
    reason = f"personalize: {reason}"
    log(ERROR, reason)
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


# -- the node's stored personal layers ------------------------------------------------------------
def state_file(directory: str | os.PathLike[str], run_id: int, node_id: int) -> Path:
    """The file in which node ``node_id`` keeps its personal layers of run ``run_id``."""
    return Path(directory) / f"personal-run{run_id}-node{node_id}.npz"


class _Store:
    """The node's personal arrays: ``context.state`` first, else the file of the state dir."""

    def __init__(self, context: Context, pattern: str, directory: str | None) -> None:
        self.context, self.pattern, self.directory = context, pattern, directory
        self.source = "state"
        self.order: dict[str, list[str]] = {}  # full key order of each ArrayRecord, when known

    @property
    def path(self) -> Path | None:
        if self.directory is None:
            return None
        return state_file(self.directory, self.context.run_id, self.context.node_id)

    def where(self) -> str:
        path = self.path
        if path is None:
            return "no personal-state-dir in the node config: the layers live in context.state"
        return f"state file {path}"

    def load(self) -> dict[str, ArrayRecord]:
        state = self.context.state
        stored = {key[len(_ARRAYS_KEY):]: state.array_records[key]
                  for key in state.array_records if key.startswith(_ARRAYS_KEY)}
        order = state.config_records.get(_ARRAYS_KEY + "order")
        if order is not None:
            self.order = {k: list(v) for k, v in order.items()  # type: ignore[arg-type]
                          if isinstance(v, list)}
        path = self.path
        if stored or path is None or not path.is_file():
            self.source = "state"
            return stored
        self.source = "file"
        stored, self.order = _read(path, self.pattern)
        self._keep(stored)
        return stored

    def save(self, personal: dict[str, ArrayRecord]) -> None:
        self._keep(personal)
        path = self.path
        if path is not None:
            _write(path, personal, {"pattern": self.pattern, "run_id": self.context.run_id,
                                    "node_id": self.context.node_id, "order": self.order})

    def _keep(self, personal: dict[str, ArrayRecord]) -> None:
        for name, record in personal.items():
            self.context.state[_ARRAYS_KEY + name] = record
        if self.order:
            self.context.state[_ARRAYS_KEY + "order"] = ConfigRecord(
                {k: list(v) for k, v in self.order.items()})


def _write(path: Path, personal: dict[str, ArrayRecord], meta: dict[str, Any]) -> None:
    """Write the personal arrays atomically (a temporary file in the folder, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [(name, key) for name, record in personal.items() for key in record]
    arrays = {f"a{i}": personal[name][key].numpy() for i, (name, key) in enumerate(entries)}
    meta = {**meta, "format": _FILE_FORMAT, "entries": entries}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(out, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _read(path: Path, pattern: str) -> tuple[dict[str, ArrayRecord], dict[str, list[str]]]:
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != _FILE_FORMAT:
                raise PersonalizationError(f"{path}: unknown format {meta.get('format')!r}")
            if meta["pattern"] != pattern:
                raise PersonalizationError(
                    f"{path} holds the personal layers of pattern {meta['pattern']!r}, not "
                    f"{pattern!r}; remove the file to start these layers afresh")
            stored: dict[str, ArrayRecord] = {}
            for i, (name, key) in enumerate(meta["entries"]):
                stored.setdefault(name, ArrayRecord())[key] = Array(np.asarray(data[f"a{i}"]))
    except (OSError, ValueError, KeyError) as err:
        if isinstance(err, PersonalizationError):
            raise
        raise PersonalizationError(f"cannot read the personal layers in {path}: {err}") from None
    return stored, {k: list(v) for k, v in meta.get("order", {}).items()}


# -- the hook of the train/evaluate handlers ------------------------------------------------------
class Phase:
    """One training phase: a context manager that freezes (``requires_grad=False``) the
    parameters it does not train, and restores their previous flags on exit.

    ``name`` is "personal", "shared" or "all"; ``trains`` the names of the parameters it trains.
    Build the optimizer inside the ``with`` block (or zero the gradients with
    ``set_to_none=True``) so that frozen parameters receive no update.
    """

    def __init__(self, name: str, trains: Iterable[str], model: torch.nn.Module) -> None:
        self.name = name
        self.trains: tuple[str, ...] = tuple(trains)
        self._model = model
        self._saved: dict[str, bool] | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def fit_head(self, data: object, steps: int = 100, lr: float = 1.0) -> float:
        """Fit this phase's personal head as fedpriv's deep FedRep fits each user's head
        (``fedpriv_flwr.heads.fit_head``: one ``torch.nn.Linear``, ``steps`` full-batch steps
        of size ``lr / L`` from its smoothness bound) on ``data`` (a DataLoader of (inputs,
        labels), or an (inputs, labels) pair); returns the fitted head's mean cross-entropy."""
        from fedpriv_flwr.heads import fit_head

        return fit_head(self._model, self.trains, data, steps, lr)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters this phase trains (e.g. for the optimizer)."""
        wanted = set(self.trains)
        return (p for n, p in self._model.named_parameters() if n in wanted)

    def __enter__(self) -> Phase:
        if self._saved is not None:
            raise RuntimeError(f"phase {self.name!r} is already entered")
        wanted = set(self.trains)
        self._saved = {}
        for name, param in self._model.named_parameters():
            self._saved[name] = param.requires_grad
            if name not in wanted:
                param.requires_grad_(False)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        saved, self._saved = self._saved or {}, None
        for name, param in self._model.named_parameters():
            if name in saved:
                param.requires_grad_(saved[name])

    def __repr__(self) -> str:
        return f"Phase({self.name!r}, trains={len(self.trains)} parameters)"


def personal_phases(model: torch.nn.Module, context: Context) -> list[Phase]:
    """The phases the train/evaluate handler runs, in order, for the message being handled.

    train: fedrep -> [personal, shared] (fit the personal layers with the shared ones frozen,
    then the shared ones with the personal frozen); finetune -> [all]. evaluate: [personal]
    (fedrep: refit the node's head on the current shared layers; finetune: fine-tune the global
    head on the node's data) before the handler evaluates.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"personal_phases expects a torch.nn.Module, got {type(model).__name__}")
    record = context.state.config_records.get(STATE_KEY)
    if record is None:
        raise RuntimeError("personal_phases: no personalization record in context.state; add "
                           "`personalize(pattern, schedule)` to the ClientApp's mods, e.g. "
                           "ClientApp(mods=[personalize(r'^fc3\\.')])")
    pattern, schedule, kind = (str(record[k]) for k in ("pattern", "schedule", "kind"))
    names = [name for name, _ in model.named_parameters()]
    personal = personal_keys(pattern, names)
    shared = [n for n in names if n not in set(personal)]
    if kind == "evaluate":
        return [Phase("personal", personal, model)]
    if schedule == "fedrep":
        return [Phase("personal", personal, model), Phase("shared", shared, model)]
    return [Phase("all", names, model)]


def fit_personal(model: torch.nn.Module, context: Context, data: object, steps: int = 100,
                 lr: float = 1.0) -> str:
    """One call before the handler's own training, and one before its test, instead of the
    ``personal_phases`` loop: fits the personal head (one ``torch.nn.Linear``, with
    ``Phase.fit_head``'s rule) where the schedule asks for it, and tells what the handler's own
    training then trains. train + fedrep: the head is fitted on ``data``, then frozen
    (``requires_grad`` off), so the training that follows updates the shared layers only ->
    "shared"; train + finetune: nothing to do -> "all"; evaluate: the head is fitted (the
    node's own on the current body, or the global one fine-tuned) -> "personal". The handler's
    optimizer must be built after this call (or zero its gradients with ``set_to_none``). The
    freeze is not undone: build the model afresh for each message (as Flower's handlers do) or
    turn ``requires_grad`` back on yourself."""
    phases = personal_phases(model, context)
    if phases[0].name == "all":
        return "all"
    head = phases[0]
    head.fit_head(data, steps, lr)
    if len(phases) == 1:
        return "personal"
    frozen = set(head.trains)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return "shared"
