import os
import shutil
import socket
import tempfile

import numpy as np
import pytest

from fedpriv.config import RunConfig
from fedpriv.configure import parse_config

FLOWER_QUIET = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_TELEMETRY_ENABLED": "0",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_WORKER_HOME: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Flower's and Ray's state private to this test process: under pytest-xdist (the README's
    ``-n``) each worker gets its own FLWR_HOME and RAY_TMPDIR, so two workers never share a
    Flower home or a Ray session folder (ports are free ones, chosen per run). The accountant's
    remembered answers are shared by the whole test run, and start empty."""
    for key, value in FLOWER_QUIET.items():
        os.environ.setdefault(key, value)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker and "FEDPRIV_ACCOUNTING_CACHE" not in os.environ:
        # the accountant's remembered answers (fedpriv.privacy.memo): one folder for this test
        # run, made before the xdist workers start (they inherit it), never the user's cache
        memo = tempfile.mkdtemp(prefix="fpmemo", dir="/tmp")
        _WORKER_HOME.append(memo)
        os.environ["FEDPRIV_ACCOUNTING_CACHE"] = memo
    if worker and not _WORKER_HOME:
        home = tempfile.mkdtemp(prefix=f"fp{worker}", dir="/tmp")  # Ray's socket paths: short
        _WORKER_HOME.append(home)
        os.environ["FLWR_HOME"] = os.path.join(home, "flwr")
        os.environ["RAY_TMPDIR"] = os.path.join(home, "ray")
        os.makedirs(os.environ["RAY_TMPDIR"])


def pytest_unconfigure(config: pytest.Config) -> None:
    for home in _WORKER_HOME:
        shutil.rmtree(home, ignore_errors=True)
    _WORKER_HOME.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tier (``@pytest.mark.slow``: the full neighbouring-dataset grid, every stored
    figure's privacy plans) runs only when selected: ``python3 -m pytest -m slow`` (or any
    ``-m`` expression naming it, ``-m full_grid``)."""
    _long_files_first(items)
    selected = config.getoption("markexpr") or ""
    if "slow" in selected or "full_grid" in selected:
        return
    skip = pytest.mark.skip(reason="the slow tier: python3 -m pytest -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Seconds in tests per file, measured (2026-11-29, 2 cores; `benchmarks/suite_durations.py`):
# only the order of the files below depends on them. A file with a test marked `integration`
# (the real Flower runtime) that is not listed counts as 60 s.
LONG_FILES = {"tests/test_docs.py": 630, "tests/test_neighbours.py": 330,
              "tests/test_secure_flower.py": 320, "tests/test_deployment.py": 310,
              "tests/test_flower_integration.py": 300, "tests/test_flower_reliability.py": 300,
              "tests/test_tuning.py": 230, "tests/test_flower_personal.py": 175,
              "tests/test_first_hour.py": 180, "tests/test_run_control.py": 140,
              "tests/test_sweep.py": 125, "tests/test_types.py": 70}


def _long_files_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, each worker's share of the tests starts with long files and ends on
    short ones. xdist gives each worker a contiguous share and later moves tests from the end
    of the longest queue to an idle worker, so the run then ends on short tests instead of one
    worker finishing a two-minute test alone (CI's run of 2026-11-29 ended on three of 95-175
    s). The long files (``LONG_FILES``, and any with a test marked ``integration``) are dealt
    whole, longest first, to the share with the fewest seconds so far; the other files keep
    their order and fill the shares."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers < 2:
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    weight = {name: LONG_FILES.get(name, 60) for name, its in files.items()
              if name in LONG_FILES or any(i.get_closest_marker("integration") for i in its)}
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0] * workers
    for name in sorted(weight, key=lambda n: -weight[n]):
        w = load.index(min(load))
        heads[w].extend(files[name])
        load[w] += weight[name]
    rest = [item for name, its in files.items() if name not in weight for item in its]
    share, ordered = -(-len(items) // workers), []
    for w in range(workers):
        ordered.extend(heads[w])
        take = len(rest) if w == workers - 1 else max(0, share * (w + 1) - len(ordered))
        ordered.extend(rest[:take])
        rest = rest[take:]
    items[:] = ordered


def small_config(**overrides) -> RunConfig:
    """A small, fast Private FedRep config; keyword names use underscores."""
    values = {"num-users": 600, "dim": 10, "rank": 2, "samples-per-user": 10,
              "epsilon": 4.0, "rounds": 4, "test-samples-per-user": 5}
    values.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return parse_config(values)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def flower_env():
    # Ray's socket paths must stay under 107 bytes: keep its temp dir short.
    short = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    env = dict(os.environ)
    env.update({
        **FLOWER_QUIET,
        "FLWR_HOME": os.path.join(short, "flwr"),
        "RAY_TMPDIR": os.path.join(short, "ray"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),  # not Flower's default: tests run at once
    })
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    yield env
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="session")
def _worker_flower_session():
    """This test process's own SuperLink and Ray head (``FlowerSession.start_superlink``),
    started when a test first asks for them and stopped when the process ends."""
    from fedpriv.launcher import FlowerSession

    with FlowerSession() as session:
        session.start_superlink()
        yield session


@pytest.fixture
def shared_flower_env(_worker_flower_session):
    """The environment of a Flower run whose test needs only its outputs: ``fedpriv run``
    submits to this test process's running SuperLink (as to one a user named with
    ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``) and leaves it running, so the SuperLink, its
    SuperExec and Ray's head start once per test process instead of once per run. Variables
    set here reach the command, not the ServerApp or the ClientApps (they run under the
    SuperLink): a test whose apps read the environment, or that checks how a run starts or
    stops, uses ``flower_env``."""
    link = _worker_flower_session.link
    assert link is not None and link.control_port is not None and link.home is not None
    return {**os.environ, **FLOWER_QUIET, "FLWR_HOME": link.home,
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(link.port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(link.control_port)}


@pytest.fixture
def flower_sessions(flower_env, monkeypatch):
    """The Flower environment in this process, and the list of every ``FlowerSession`` entered
    (to check that a sweep or a tuning shares one SuperLink and one Ray head)."""
    from fedpriv import launcher

    for key, value in flower_env.items():
        monkeypatch.setenv(key, value)
    sessions = []
    real_enter = launcher.FlowerSession.__enter__

    def enter(self):
        sessions.append(real_enter(self))
        return sessions[-1]

    monkeypatch.setattr(launcher.FlowerSession, "__enter__", enter)
    return sessions


@pytest.fixture
def deadline():
    """``with deadline(seconds):`` raises ``fedpriv.stopping.Interrupted`` (as SIGTERM would)
    in the test's process when the block outlives ``seconds``: a run that would hang (a Ray
    driver that cannot reach its head retries for many minutes) fails the test instead, and a
    guarded command stops its processes on the way out."""
    import contextlib
    import signal

    from fedpriv.stopping import Interrupted

    @contextlib.contextmanager
    def guard(seconds: int):
        def hung(signum, frame):
            raise Interrupted(signal.SIGTERM)

        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return guard
