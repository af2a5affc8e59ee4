"""Ulysses sequence parallelism on CPU (gloo): USP2/USP4 forwards and a USP2 streaming session equal one rank,
each rank's KV cache holds its head shard, and a killed rank fails the group instead of hanging."""

import dataclasses
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.config import DiTConfig, ModelConfig, Profile
from services.dit.api import HoldConfig, PhaseOutput, PromptUpdate, RuntimeConfig, SessionCancelled, SessionConfig
from services.dit.model.block_graphs import BlockGraphs
from services.dit.stream.geometry import Canvas
from services.dit.group.orchestration import GroupFailed
from services.dit.group.launch import GroupOptions, free_port, launch_group, rank_device_env
from services.dit.model.layout import pack_layout
from services.dit.model.network import PRESETS, DiT, FullAttention, build_random
from services.dit.model.shard import pack_head_groups
from services.dit.stream.runtime import DiTRuntime, block_graph_shapes
from services.dit.group.ulysses import UlyssesAttend, heads_to_rows, install_ulysses, out_to_rows
from tests.dit.factories import TINY, tiny_model

ARGS = TINY  # 4 heads: N = 2 and N = 4 both divide
TEXT_TOKENS = 16
TEXT_BUCKETS = (8, TEXT_TOKENS)
CANVAS = (64, 64)


def build_tiny(profile: Profile, device: torch.device) -> DiTRuntime:
    """The group's builder: the tiny preset with seed-0 random weights (identical on every rank)."""
    torch.set_num_threads(1)
    model = build_random(PRESETS[profile.model.preset], device, getattr(torch, profile.dit.dtype), seed=0)
    degree = profile.dit.usp_degree
    buckets = TEXT_BUCKETS if degree > 1 else ()  # the group pads the text rows like the usp2 profile
    runtime = DiTRuntime(model, RuntimeConfig.for_preset("tiny", max_text_tokens=TEXT_TOKENS, ulysses_degree=degree,
                                                         text_buckets=buckets))
    runtime.teacher.overlap = profile.dit.teacher_overlap
    if degree > 1:  # the group's forwards through the block pieces (eager on the CPU)
        model.block_graphs = BlockGraphs(model, None, device, degree)
        for rows, slots in block_graph_shapes([Canvas(*CANVAS)], degree, buckets):
            model.block_graphs.capture(rows, slots)
    return runtime


def build_tiny_late_or_broken(profile: Profile, device: torch.device) -> DiTRuntime:
    """`build_tiny`, but a spawned rank finishes loading 6 s after rank 0 (VITASCOPE_TEST_WORKER=late) or fails
    (=broken)."""
    if mp.parent_process() is not None:  # a spawned rank
        if os.environ.get("VITASCOPE_TEST_WORKER") == "broken":
            raise RuntimeError("injected: this rank cannot load its weights")
        time.sleep(6)
    return build_tiny(profile, device)


def tiny_profile(devices: tuple[str, ...], dtype: str = "float32", teacher_staged: bool = False) -> Profile:
    return Profile(name="usp-test", model=ModelConfig(preset="tiny", dir="/nonexistent"),
                   dit=DiTConfig(devices=devices, dtype=dtype, canvas_short_edges=(64,), teacher_staged=teacher_staged))


def forward_inputs(device: str = "cpu"):
    """A text + audio + video document of 4 + 2 * 7 + 24 = 42 real rows, padded to 64."""
    gen = torch.Generator().manual_seed(7)
    tt, ta, tv = 4, 7, 24
    layout = pack_layout(text_len=tt, audio_len_per_channel=ta, video_rows=tv,
                         positions_text=torch.rand(tt, 3, generator=gen) * 8,
                         positions_audio=torch.rand(2 * ta, 3, generator=gen) * 8,
                         positions_video=torch.rand(tv, 3, generator=gen) * 8, video_t=0.7, audio_t=0.4)
    video = torch.randn(tv, ARGS.video_row_dim, generator=gen)
    audio = torch.randn(2 * ta, ARGS.audio_channels, generator=gen)
    text = torch.randn(tt, ARGS.text_dim, generator=gen)
    return video.to(device), audio.to(device), text.to(device), layout.to(device)


def _forward_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of 4 gloo ranks: a USP4 forward over all ranks, then a USP2 forward within ranks {0, 1} / {2, 3}."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
        model = tiny_model()
        video, audio, text, layout = forward_inputs()
        full = FullAttention(layout)
        result = {}
        for n, group, group_rank in ((4, None, rank), (2, pairs[rank // 2], rank % 2)):
            shapes = []

            def attention(layer, q, k, v):
                # the layout the all-to-all leaves: q, k, v side by side in one receive buffer, read in place
                in_place = (q.stride() == k.stride() == v.stride() == (3 * q.shape[1] * q.shape[2], q.shape[2], 1)
                            and k.data_ptr() - q.data_ptr() == v.data_ptr() - k.data_ptr() == q[0].numel() * 4)
                shapes.append((tuple(q.shape), in_place))
                return full(layer, q, k, v)

            handle = install_ulysses(model, group, group_rank, n)
            with torch.no_grad():
                out = model(video, audio, text, layout, attention)
            handle.remove()
            result[n] = {"video": out[0], "audio": out[1], "shapes": shapes}
        # the all-to-all pair alone: exact head shards of every row, and back to exact row shards
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(layout.seq_len, ARGS.num_heads, ARGS.head_dim, generator=gen) for _ in range(3))
        rows, heads = layout.seq_len // world, ARGS.num_heads // world
        mine = slice(rank * rows, (rank + 1) * rows)
        send = pack_head_groups(q[mine], k[mine], v[mine], q.new_empty(world, rows, 3, heads, ARGS.head_dim))
        got = heads_to_rows(send, None)  # [S, 3, H/N, D]
        head_slice = slice(rank * heads, (rank + 1) * heads)
        result["a2a_exact"] = all(torch.equal(got[:, i], t[:, head_slice]) for i, t in enumerate((q, k, v)))
        back = out_to_rows(q[:, head_slice], None, world)  # [N, S/N, H/N, D]: head group i of our rows
        result["a2a_back_exact"] = torch.equal(back.transpose(0, 1).flatten(1, 2), q[mine])
        # a block's attention from the packed send buffer: this rank's rows of the attention over every row and head
        attend = UlyssesAttend(lambda q, k, v: full(0, q, k, v), None, world)
        out = torch.empty(rows, ARGS.num_heads, ARGS.head_dim)
        attend.packed(send, out)
        result["packed_matches"] = torch.allclose(out, full(0, q, k, v)[mine], rtol=1e-5, atol=1e-6)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 90) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes}"


@pytest.mark.cpu
@pytest.mark.slow
def test_full_attention_forward_usp2_usp4_match_one_rank(tmp_path):
    model = tiny_model()
    video, audio, text, layout = forward_inputs()
    with torch.no_grad():
        ref_v, ref_a = model(video, audio, text, layout, FullAttention(layout))
    run_ranks(_forward_rank, 4, free_port("127.0.0.1"), str(tmp_path))
    for r in range(4):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["a2a_exact"] and got["a2a_back_exact"] and got["packed_matches"]
        for n in (2, 4):
            # the inner pattern saw every row but only this rank's heads, as views of the receive buffer
            expect = [((layout.seq_len, ARGS.num_heads // n, ARGS.head_dim), True)] * ARGS.num_layers
            assert got[n]["shapes"] == expect
            for ref, out in ((ref_v, got[n]["video"]), (ref_a, got[n]["audio"])):
                assert out.shape == ref.shape
                err = (out - ref).abs().max() / ref.abs().max()
                assert err < 1e-5, f"USP{n} rank {r}: relative error {err:.2e}"


HOLD = HoldConfig(enabled=True, max_seconds=0.3, poll_seconds=0.02)
NUM_PHASES = 9  # request 0 (4 phases), request 1 (4), request 2 (1): an arrived prompt, then an expired hold


def drive(session, prompts: list[PromptUpdate]) -> list:
    """Phases of a held session: e1 arrives during request 0; request 2 finds none and falls back."""
    outs = []
    for i in range(NUM_PHASES):
        if i == 1:
            session.submit_prompt(prompts[1])
        outs.append(session.next_phase())
    return outs


def session_config() -> SessionConfig:
    return SessionConfig(seed=3, width=CANVAS[0], height=CANVAS[1], hold=HOLD)


def run_or_raise(fn):
    """fn()'s result, or the exception it raised."""
    try:
        return fn()
    except Exception as exc:  # the caller asserts which one it expects
        return exc


@pytest.mark.cpu
@pytest.mark.parametrize("staged", [False, True], ids=["teacher_whole", "teacher_staged"])
@pytest.mark.slow
def test_usp2_streaming_session_matches_one_rank(staged):
    gen = torch.Generator().manual_seed(11)
    prompts = [PromptUpdate(torch.randn(6, ARGS.text_dim, generator=gen), "e0"),
               PromptUpdate(torch.randn(9, ARGS.text_dim, generator=gen), "e1"),
               PromptUpdate(torch.randn(4, ARGS.text_dim, generator=gen), "fallback")]
    rt = build_tiny(tiny_profile(("cpu",)), torch.device("cpu"))
    session = rt.open_session(session_config(), prompts[0], prompts[2])
    ref = drive(session, prompts)
    ref_kv = (session.kv.live, session.kv.audio_rows, session.kv.video_rows)
    session.close()
    assert [o.meta.active_event_id for o in ref[::4]] == ["e0", "e1", "fallback"]

    group = launch_group(tiny_profile(("cpu", "cpu"), teacher_staged=staged), build_tiny,
                         GroupOptions(timeout_s=30, heartbeat_s=2))
    try:
        assert (group.runtime.teacher.stages is not None) == staged
        session = group.open_session(session_config(), prompts[0], prompts[2])
        assert group.active_session is session
        outs = drive(session, prompts)
        for i, (out, r) in enumerate(zip(outs, ref)):
            assert out.meta == dataclasses.replace(r.meta, timings=out.meta.timings)
            for name in ("video", "audio"):
                a, b = getattr(out, name), getattr(r, name)
                err = (a - b).abs().max() / b.abs().max()
                assert err < 1e-5, f"phase {i} {name}: relative error {err:.2e}"
        assert outs[8].meta.timings.hold_s >= HOLD.max_seconds  # the expired hold is reported
        graphs = group.runtime.model.block_graphs  # rank 0's forwards went through the packed pieces, every one
        forwards = 3 * len(outs) + len(outs) - 1  # 3 students a phase, each phase's commit at the start of the next
        assert graphs.bank.stats.replays == forwards * (ARGS.num_layers + 1)
        status = group.rank_status()
        assert [s.rank for s in status] == [0, 1]
        for s in status:
            assert s.session_open and (s.kv_local_heads, s.kv_head_dim) == (ARGS.num_heads // 2, ARGS.head_dim)
            assert (s.kv_live_rows, s.kv_audio_rows, s.kv_video_rows) == ref_kv
            assert (s.request_index, s.phase_index) == (2, 1)
        assert tuple(session.kv.k[0].shape[1:]) == (ARGS.num_heads // 2, ARGS.head_dim)
        # cancel while a phase may be running: every rank stops at the same agreed check and releases its KV
        ended: list = []
        thread = threading.Thread(target=lambda: ended.append(run_or_raise(session.next_phase)))
        thread.start()
        time.sleep(0.05)
        session.cancel()
        thread.join(30)
        assert len(ended) == 1 and isinstance(ended[0], (SessionCancelled, PhaseOutput)), ended
        assert group.active_session is None and session.kv is None
        assert not any(s.session_open for s in group.rank_status())
        # the ranks are still in step: a new session opens, runs a phase and closes
        again = group.open_session(SessionConfig(seed=4, width=CANVAS[0], height=CANVAS[1]), prompts[1])
        assert again.next_phase().meta.active_event_id == "e1"
        again.close()
        assert not any(s.session_open for s in group.rank_status())
    finally:
        group.shutdown()
    assert not dist.is_initialized()


@pytest.mark.cpu
@pytest.mark.slow
def test_group_hold_ends_when_no_prompt_can_come_and_a_late_prompt_beats_the_fallback():
    gen = torch.Generator().manual_seed(3)
    first, late, fallback = (PromptUpdate(torch.randn(5, ARGS.text_dim, generator=gen), e)
                             for e in ("e0", "late", "fallback"))
    group = launch_group(tiny_profile(("cpu", "cpu")), build_tiny, GroupOptions(timeout_s=30, heartbeat_s=2))
    try:
        config = SessionConfig(seed=1, width=CANVAS[0], height=CANVAS[1], hold=HoldConfig(enabled=True))
        session = group.open_session(config, first)
        for _ in range(4):  # request 0; request 1 holds forever for a newer prompt
            session.next_phase()
        threading.Timer(0.3, session.close_prompts).start()  # the client's request stream ended
        out = session.next_phase()
        assert out.meta.active_event_id == "e0" and out.meta.timings.hold_s >= 0.3  # the previous prompt goes on
        session.close()
        # a prompt that arrives as a finite hold expires is newer than the fallback: it wins on every rank
        config = dataclasses.replace(config, hold=HoldConfig(enabled=True, max_seconds=0.05))
        session = group.open_session(config, first, fallback)
        for _ in range(4):
            session.next_phase()
        session.submit_prompt(late)
        session._hold = lambda: (0.05, True)  # the hold expired just before the prompt came
        out = session.next_phase()
        assert out.meta.active_event_id == "late" and out.meta.started_event_ids == ("late",)
        assert [s.request_index for s in group.rank_status()] == [1, 1]
        session.close()
    finally:
        group.shutdown()
    assert not dist.is_initialized()


@pytest.mark.cpu
@pytest.mark.slow
def test_group_runs_a_tool_on_every_rank_between_sessions():
    from services.common.errors import NoCapacity
    from tools.dit.probe import group_forward_seconds, phase_inputs, time_forward

    group = launch_group(tiny_profile(("cpu", "cpu")), build_tiny, GroupOptions(timeout_s=30, heartbeat_s=2))
    try:
        seconds = group_forward_seconds(group, 64, 96, latents=2, runs=2)
        assert 0 < seconds < 30
        with pytest.raises(ValueError, match="canvas 90x64"):  # refused on rank 0 before any rank moves
            group_forward_seconds(group, 64, 90)
        with pytest.raises(ValueError, match="runs=0"):
            group_forward_seconds(group, 64, 96, runs=0)
        session = group.open_session(session_config(), PromptUpdate(torch.randn(5, ARGS.text_dim), "e0"))
        with pytest.raises(NoCapacity, match="a session is open"):
            group_forward_seconds(group, 64, 96, latents=2, runs=1)
        session.next_phase()  # the ranks are still in step
        session.close()
        assert group_forward_seconds(group, 64, 96, latents=1, runs=1) > 0
    finally:
        group.shutdown()
    model = tiny_model()
    video, audio, text, layout = phase_inputs(model, 64, 96, latents=2)
    assert video.shape[0] == 2 * 2 * 3 and layout.seq_len % 64 == 0  # 2 latents of (64/32) x (96/32) rows
    with pytest.raises(ValueError, match="runs=0"):
        time_forward(model, (video, audio, text, layout), runs=0)


def phases_in_thread(session) -> tuple[threading.Thread, list[BaseException]]:
    """A daemon thread (not started) that runs phases until one raises, and the list it reports that into."""
    raised: list[BaseException] = []

    def drive():
        try:
            while True:
                session.next_phase()
        except BaseException as exc:  # the thread reports whatever ended it
            raised.append(exc)

    return threading.Thread(target=drive, daemon=True), raised


@pytest.mark.cpu
@pytest.mark.parametrize("busy", ["mid-phase", "idle", "holding"])
@pytest.mark.slow
def test_killed_rank_fails_the_group_within_bounded_time(busy):
    failures: list[str] = []
    group = launch_group(tiny_profile(("cpu", "cpu")), build_tiny, GroupOptions(timeout_s=15, heartbeat_s=2))
    group.on_failure(failures.append)  # the service flips its health to NOT_SERVING here
    try:
        hold = HoldConfig(enabled=busy == "holding")  # holding: forever, for a prompt that never comes
        session = group.open_session(SessionConfig(seed=1, width=CANVAS[0], height=CANVAS[1], hold=hold),
                                     PromptUpdate(torch.randn(5, ARGS.text_dim), "e0"))
        for _ in range(4 if busy == "holding" else 1):  # holding: request 0, then the boundary where it holds
            session.next_phase()
        thread, raised = phases_in_thread(session)
        if busy != "idle":
            thread.start()
            time.sleep(0.3)
        os.kill(group.processes[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        if busy == "idle":  # nobody calls in: the watchdog alone must notice
            while not group.failed and time.monotonic() - killed < 20:
                time.sleep(0.05)
            assert group.failed, "the watchdog did not notice the dead rank"
            thread.start()
        thread.join(20)
        assert not thread.is_alive(), "rank 0 hung after rank 1 died"
        assert time.monotonic() - killed < 20
        assert len(raised) == 1 and isinstance(raised[0], GroupFailed), raised
        assert group.failed and len(failures) == 1 and "rank 1" in failures[0]
        with pytest.raises(GroupFailed):
            group.open_session(SessionConfig(seed=1, width=CANVAS[0], height=CANVAS[1]),
                               PromptUpdate(torch.randn(5, ARGS.text_dim), "e1"))
        session.cancel()  # what the gRPC handler does on the way out: releases rank 0's KV without collectives
        assert session.kv is None and group.active_session is None
    finally:
        group.shutdown(timeout_s=2)
    assert not dist.is_initialized()


@pytest.mark.cpu
@pytest.mark.slow
def test_ranks_that_finish_loading_later_than_the_collective_timeout_still_join(monkeypatch):
    # ranks load and compile at their own pace (4 ranks reading a 33B checkpoint from one disk); only once all have
    # arrived do collectives run under the group's timeout, here 3 s against a rank 6 s late
    monkeypatch.setenv("VITASCOPE_TEST_WORKER", "late")
    group = launch_group(tiny_profile(("cpu", "cpu")), build_tiny_late_or_broken,
                         GroupOptions(timeout_s=3, heartbeat_s=1, join_timeout_s=60))
    try:
        session = group.open_session(SessionConfig(seed=1, width=CANVAS[0], height=CANVAS[1]),
                                     PromptUpdate(torch.randn(5, ARGS.text_dim), "e0"))
        assert session.next_phase().meta.phase_index == 0
        session.close()
    finally:
        group.shutdown()
    assert not dist.is_initialized()


@pytest.mark.cpu
@pytest.mark.slow
def test_a_rank_that_fails_to_load_fails_the_start_at_once(monkeypatch):
    monkeypatch.setenv("VITASCOPE_TEST_WORKER", "broken")
    started = time.monotonic()
    with pytest.raises(GroupFailed, match="exited during start-up"):
        launch_group(tiny_profile(("cpu", "cpu")), build_tiny_late_or_broken,
                     GroupOptions(timeout_s=3, heartbeat_s=1, join_timeout_s=600))
    assert time.monotonic() - started < 60  # not the join timeout
    assert not dist.is_initialized()


@pytest.mark.cpu
def test_rank_devices_map_through_the_parents_visible_list():
    assert rank_device_env("cuda:1", None) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})
    assert rank_device_env("cuda:1", "4,5,6,7") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "5"})
    assert rank_device_env("cpu", "0") == ("cpu", {})
    with pytest.raises(ValueError, match="has only 2 devices"):
        rank_device_env("cuda:3", "0,1")
    with pytest.raises(ValueError, match="heartbeat_s"):
        GroupOptions(timeout_s=4, heartbeat_s=2)


@contextmanager
def nccl_ulysses_model(rank: int, world: int, port: int) -> Iterator[DiT]:
    """In a spawned rank: join an NCCL group on cuda:`rank` and yield the tiny seed-0 DiT (BF16) sharded over it;
    the group is left on the way out."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        model = tiny_model(f"cuda:{rank}", torch.bfloat16)
        install_ulysses(model, None, rank, world)
        yield model
    finally:
        dist.destroy_process_group()


def _nccl_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with nccl_ulysses_model(rank, world, port) as model:
        video, audio, text, layout = forward_inputs(f"cuda:{rank}")
        with torch.no_grad():
            out = model(video, audio, text, layout, FullAttention(layout))
        torch.save({"video": out[0].cpu(), "audio": out[1].cpu()}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multi_gpu
def test_usp2_nccl_forward_matches_one_gpu(tmp_path):
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    model = tiny_model("cuda:0", torch.bfloat16)
    video, audio, text, layout = forward_inputs("cuda:0")
    with torch.no_grad():
        ref_v, ref_a = (t.cpu() for t in model(video, audio, text, layout, FullAttention(layout)))
    run_ranks(_nccl_rank, 2, free_port("127.0.0.1"), str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt")
    for ref, out in ((ref_v, got["video"]), (ref_a, got["audio"])):
        err = (out - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, f"USP2 NCCL vs 1 GPU: relative error {err:.2e}"
