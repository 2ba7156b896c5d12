"""Shared fixtures: in-process aggregators and the session's pool of worker processes.

Also puts ``scripts/`` on ``sys.path`` (at the end, so it shadows nothing): the benchmarks' package
``ombench`` lives there, beside the scripts, and is not installed; the tests import it from the
checkout, as the scripts do.

``--min-passed N`` fails a run in which fewer than N tests passed (make test-pythons: a run that
skipped or deselected most of its tests must not look green).
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import omnireduce
from tests.harness import RankPool

_jobs = itertools.count()

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.append(str(SCRIPTS))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--min-passed", type=int, default=0, metavar="N",
                     help="fail the run when fewer than N tests passed (a run that skips or deselects most of "
                          "what it was given must not look green)")


def _too_few_passed(config: pytest.Config) -> str | None:
    need = config.getoption("--min-passed")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not need or reporter is None:
        return None
    passed = len(reporter.stats.get("passed", []))
    return f"only {passed} tests passed; --min-passed asks for {need}" if passed < need else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _too_few_passed(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    problem = _too_few_passed(config)
    if problem:
        terminalreporter.write_line(problem, red=True, bold=True)


@pytest.fixture(scope="session")
def pool() -> Iterator[RankPool]:
    p = RankPool(4)
    yield p
    p.close()


@pytest.fixture
def aggregator() -> Iterator[omnireduce.Aggregator]:
    with omnireduce.Aggregator() as agg:
        yield agg


@pytest.fixture
def aggregators() -> Iterator[list[omnireduce.Aggregator]]:
    """Two aggregators, for tests that spread slots over several."""
    with omnireduce.Aggregator() as a, omnireduce.Aggregator() as b:
        yield [a, b]


@pytest.fixture
def job() -> str:
    """A job name no other test uses."""
    return f"test-{next(_jobs)}"


@pytest.fixture(autouse=True)
def _no_stale_replies(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the pool, no reply of its commands is left for the next test (one
    that failed between ``submit`` and ``collect`` leaves some: they are read, or the processes
    still busy with them are restarted)."""
    pool = request.getfixturevalue("pool") if "pool" in request.fixturenames else None
    yield
    if pool is not None:
        pool.drain()


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
