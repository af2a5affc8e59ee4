"""Start-up progress: each counted step is logged with k/N and its elapsed time, the newest one is kept in the
progress file, and the health probe prints it while the stage is not yet SERVING (what a start-up probe shows)."""
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest

from services.common.grpc_server import Stage, serve
from services.common.startup import ProgressFile, Steps, read_progress, report, size_text
from tools.ports import free_ports

pytestmark = pytest.mark.cpu

log = logging.getLogger("tests.startup")
log.setLevel(logging.INFO)  # as configure_logging sets the root in a stage; pytest leaves it at WARNING


def test_counted_steps_log_each_part_with_its_count_and_the_file_keeps_the_newest(tmp_path, caplog):
    path = tmp_path / "progress.json"
    handler = ProgressFile(path)
    log.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="tests.startup"):
            shards = Steps(log, "DiT shards", 3)
            shards.tick("a.safetensors: 10 tensors")
            shards.tick("b.safetensors: 12 tensors")
    finally:
        log.removeHandler(handler)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("start-up: DiT shards 1/3 (a.safetensors: 10 tensors; ") and lines[0].endswith(" s)")
    assert lines[1].startswith("start-up: DiT shards 2/3 (b.safetensors")
    assert caplog.records[1].startup["done"] == 2 and caplog.records[1].startup["total"] == 3
    entry = json.loads(path.read_text())
    assert (entry["what"], entry["done"], entry["total"], entry["pid"]) == ("DiT shards", 2, 3, os.getpid())
    assert read_progress(path).startswith("DiT shards 2/3 (b.safetensors: 12 tensors; ")
    handler.ready()
    assert json.loads(path.read_text())["what"] == "serving"


def test_records_without_a_step_leave_the_progress_file_alone(tmp_path):
    path = tmp_path / "progress.json"
    handler = ProgressFile(path)
    log.addHandler(handler)
    try:
        report(log, "warm-up")
        log.info("an ordinary line")
    finally:
        log.removeHandler(handler)
    assert json.loads(path.read_text())["what"] == "warm-up"


def test_a_missing_or_garbled_progress_file_reads_as_nothing(tmp_path):
    assert read_progress(tmp_path / "absent.json") == ""
    (tmp_path / "bad.json").write_text("{not json")
    assert read_progress(tmp_path / "bad.json") == ""


class _SlowStart(Stage):
    """Reports two steps, then waits for the test before it finishes loading."""

    def __init__(self) -> None:
        self.go_on = threading.Event()
        self.reported = threading.Event()

    def start(self) -> None:
        loaded = Steps(logging.getLogger("tests.startup.stage"), "text-encoder shards", 2)
        loaded.tick("model-00001-of-00002.safetensors: 300 tensors")
        self.reported.set()
        self.go_on.wait(30)
        loaded.tick("model-00002-of-00002.safetensors: 97 tensors")

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass


def _probe(port: int, path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.common.healthcheck", "--addr", f"127.0.0.1:{port}",
                           "--service", "test.v1.Slow", "--progress-file", str(path)],
                          capture_output=True, text=True, timeout=60)


async def test_the_probe_prints_how_far_a_loading_stage_got_then_serving(tmp_path):
    path, port = tmp_path / "progress.json", free_ports(1)[0]
    handler = ProgressFile(path)
    logging.getLogger().addHandler(handler)
    stage, ready = _SlowStart(), asyncio.Event()
    task = asyncio.create_task(serve(stage, "test.v1.Slow", lambda server, stage: None, port,
                                     ready=lambda: (handler.ready(), ready.set())))
    try:
        assert await asyncio.to_thread(stage.reported.wait, 30)
        loading = await asyncio.to_thread(_probe, port, path)
        assert loading.returncode == 1
        assert loading.stdout.startswith("NOT_SERVING: text-encoder shards 1/2 (model-00001-of-00002.safetensors")
        stage.go_on.set()
        await asyncio.wait_for(ready.wait(), 30)
        serving = await asyncio.to_thread(_probe, port, path)
        assert (serving.returncode, serving.stdout.strip()) == (0, "SERVING")
    finally:
        stage.go_on.set()
        logging.getLogger().removeHandler(handler)
        os.kill(os.getpid(), signal.SIGTERM)  # serve() stops on SIGTERM, as a stage process does
        assert await asyncio.wait_for(task, 30) is True


def test_the_probe_says_unreachable_when_nothing_listens(tmp_path):
    result = _probe(free_ports(1)[0], tmp_path / "absent.json")
    assert (result.returncode, result.stdout.strip()) == (1, "UNREACHABLE")


def test_sizes_read_in_mib_below_a_gib_and_in_gib_above():
    assert (size_text(5 * 2**20), size_text(3 * 2**30 + 2**29)) == ("5.0 MiB", "3.5 GiB")
