"""Prometheus multiprocess files of gunicorn's workers: read them, and fold dead workers' into one.

In multiprocess mode every worker writes ``counter_<pid>.db`` and ``histogram_<pid>.db`` under
``PROMETHEUS_MULTIPROC_DIR`` and a scrape merges every file there. prometheus_client's
``mark_process_dead`` (the ``child_exit`` hook it documents for gunicorn) only removes the files of
*live* gauges; a dead worker's counters and histograms stay on purpose, or the totals would drop.
With ``max_requests`` (gunicorn.conf.py) workers are recycled all the time, so the files pile up
and every scrape gets slower. ``mark_process_dead`` here also adds a dead worker's counters,
histograms and summaries into one ``<type>_archive.db`` per type and removes its files: the
directory holds the live workers' files plus the archives, and the totals are unchanged.

A scrape must never see a dead worker's counts twice (its file and the archive) nor not at all
(between the two): Prometheus would read that as a counter reset. The master folds under an
exclusive ``flock`` on a lock file in the directory, and ``collect`` reads under a shared one.

Only prometheus_client and the standard library: gunicorn's master imports this without Django.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import multiprocess
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key

__all__ = ["ARCHIVE", "FOLDED_TYPES", "collect", "mark_process_dead", "reset"]

ARCHIVE = "archive"  # stands in for the pid in the archive files' names: counter_archive.db
# Types whose dead-process values are summed (gauges are per-process or live-only: left as they are).
FOLDED_TYPES = ("counter", "histogram", "summary")
LOCK_NAME = ".fold.lock"  # not *.db: scrapes never read it


def _directory(path: str | None) -> Path:
    path = path or os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
    if not path:
        raise ValueError("PROMETHEUS_MULTIPROC_DIR is not set")
    return Path(path)


@contextmanager
def _locked(directory: Path, *, exclusive: bool) -> Iterator[None]:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def collect(path: str | None = None) -> list[Metric]:
    """Every process's metrics summed (live workers' files and the archives), read consistently."""
    directory = _directory(path)
    with _locked(directory, exclusive=False):
        return list(multiprocess.MultiProcessCollector(None, path=str(directory)).collect())


def _write(target: Path, metrics) -> None:
    """Write merged (not accumulated) samples into a fresh file, then put it in place atomically."""
    scratch = target.with_name(f".{target.name}.tmp")
    scratch.unlink(missing_ok=True)
    out = MmapedDict(str(scratch))
    try:
        for metric in metrics:
            for sample in metric.samples:
                key = mmap_key(metric.name, sample.name, list(sample.labels), list(sample.labels.values()),
                               metric.documentation)
                out.write_value(key, sample.value, sample.timestamp or 0.0)
    finally:
        out.close()
    os.replace(scratch, target)


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """Bookkeeping for a dead worker (gunicorn.conf.py's child_exit): prometheus_client's, then fold
    its counters, histograms and summaries into the archive files and remove its own."""
    directory = _directory(path)
    multiprocess.mark_process_dead(pid, str(directory))
    with _locked(directory, exclusive=True):
        for typ in FOLDED_TYPES:
            dead = directory / f"{typ}_{pid}.db"
            if not dead.exists():
                continue
            archive = directory / f"{typ}_{ARCHIVE}.db"
            files = [str(f) for f in (archive, dead) if f.exists()]
            # accumulate=False: histogram buckets stay per bucket, as the files hold them.
            _write(archive, multiprocess.MultiProcessCollector.merge(files, accumulate=False))
            dead.unlink()


def reset(path: str | None = None) -> None:
    """Empty the directory (gunicorn's on_starting): values of an earlier run never leak in."""
    directory = _directory(path)
    directory.mkdir(parents=True, exist_ok=True)
    for child in directory.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
