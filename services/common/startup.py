"""Start-up progress of a stage: a log line for each step, and the newest step in a small JSON file.

Knows nothing about models, gRPC or Kubernetes. Loading code reports with `report(...)` or counts the parts of a
long step with `Steps` (shards loaded, graphs captured, shapes compiled: "k/N, elapsed"); both only log, through
the caller's logger, with the step in the record's `startup` field. A stage's `main()` may install
`ProgressFile`, a logging handler that keeps the newest such step (plus the seconds since the process started
loading) in a JSON file; `services.common.healthcheck --progress-file` prints it while the stage is not yet
SERVING, so a start-up probe's failure message (`kubectl describe pod`, `docker inspect`) says how far it got.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StartupStep:
    """One reported point of a stage's start-up."""

    what: str
    """The step, e.g. "DiT shards" or "teacher CUDA graphs"."""

    done: int | None = None
    """Parts finished so far (None: a step without parts)."""

    total: int | None = None
    """Parts in all, when known."""

    detail: str = ""
    """Anything else worth a glance: bytes loaded, the part's name, the step's elapsed seconds."""

    def describe(self) -> str:
        """One readable phrase: `what k/N (detail)`."""
        count = "" if self.done is None else f" {self.done}/{self.total}" if self.total is not None else f" {self.done}"
        return f"{self.what}{count}" + (f" ({self.detail})" if self.detail else "")


def size_text(num_bytes: int) -> str:
    """Bytes as a reader wants them in a progress line: MiB below a GiB, GiB from there."""
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes < 2**30 else f"{num_bytes / 2**30:.1f} GiB"


def report(logger: logging.Logger, what: str, done: int | None = None, total: int | None = None,
           detail: str = "") -> None:
    """Log one start-up step through `logger` (INFO, with the step in the record's `startup` field)."""
    step = StartupStep(what, done, total, detail)
    logger.info("start-up: %s", step.describe(), extra={"startup": asdict(step)})


class Steps:
    """Counts the parts of one long step, reporting each with the step's elapsed seconds, then the whole."""

    def __init__(self, logger: logging.Logger, what: str, total: int | None = None) -> None:
        self._logger = logger
        self.what = what
        self.total = total
        self.done = 0
        self._started = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        """Seconds since the step began."""
        return time.perf_counter() - self._started

    def tick(self, detail: str = "") -> None:
        """Report one more part finished."""
        self.done += 1
        text = f"{detail}; {self.elapsed_s:.1f} s" if detail else f"{self.elapsed_s:.1f} s"
        report(self._logger, self.what, self.done, self.total, text)


class ProgressFile(logging.Handler):
    """Keeps the newest start-up step of this process in `path` as JSON, replaced atomically.

    The file holds `{"what", "done", "total", "detail", "elapsed_s", "pid"}`: `elapsed_s` counts from the handler's
    creation (the stage's `main()`, before loading starts). `ready()` records that start-up finished.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(logging.INFO)
        self.path = Path(path)
        self._started = time.monotonic()
        self._write({"what": "starting", "done": None, "total": None, "detail": ""})

    def emit(self, record: logging.LogRecord) -> None:
        step = getattr(record, "startup", None)
        if isinstance(step, dict):
            try:
                self._write(step)
            except OSError:
                self.handleError(record)

    def ready(self) -> None:
        """Record that the stage is serving (the probe then has nothing to explain)."""
        self._write({"what": "serving", "done": None, "total": None, "detail": ""})

    def _write(self, step: dict[str, object]) -> None:
        entry = {**step, "elapsed_s": round(time.monotonic() - self._started, 1), "pid": os.getpid()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, self.path)


def read_progress(path: str | os.PathLike) -> str:
    """The progress file as one line for a probe's output ("" when absent or unreadable)."""
    try:
        entry = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(entry, dict):
        return ""
    step = StartupStep(str(entry.get("what", "?")), entry.get("done"), entry.get("total"),
                       str(entry.get("detail", "")))
    return f"{step.describe()}, {entry.get('elapsed_s', '?')} s after start (pid {entry.get('pid', '?')})"
