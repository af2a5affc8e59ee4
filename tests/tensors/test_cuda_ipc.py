"""CUDA IPC transport: handshake decisions, slot lease/generation bookkeeping, pool records (CPU); pool round trips
and memory flatness across two processes (GPU)."""

import os
import subprocess
import sys

import pytest
import torch

from services.common import metrics
from services.tensors.cuda_ipc import (MODE_HOST, MODE_IPC, IpcConsumer, IpcError, IpcProducer, OpenPools,
                                      PoolExhausted, PoolRecord, SlotLedger, _check_ref, count_fallback,
                                      decide_transport, local_hello, negotiate, process_alive, read_boot_id)
from services.tensors.stage_transport import send_tensor
from vitascope.common.v1 import tensor_pb2 as pb

BOOT = "3b1f0c9e-0000-4000-8000-000000000001"


def hello(boot=BOOT, gpus=("GPU-a", "GPU-b"), pid=100, pid_namespace="pid:[4026531836]"):
    return pb.TransportHello(boot_id=boot, gpu_uuids=list(gpus), pid=pid, pid_namespace=pid_namespace)


@pytest.mark.cpu
def test_handshake_picks_ipc_only_for_same_boot_other_pid_shared_gpu():
    d = decide_transport(hello(), hello(gpus=("GPU-b", "GPU-c"), pid=200))
    assert d.mode == MODE_IPC and d.shared_gpus == ("GPU-b",)
    other_boot = decide_transport(hello(), hello(boot="ffff-other", pid=200))
    assert other_boot.mode == MODE_HOST and "boot id" in other_boot.reason
    same_pid = decide_transport(hello(), hello())
    assert same_pid.mode == MODE_HOST and "same pid" in same_pid.reason
    no_gpu = decide_transport(hello(), hello(gpus=("GPU-z",), pid=200))
    assert no_gpu.mode == MODE_HOST and "GPU" in no_gpu.reason
    no_cuda = decide_transport(hello(gpus=()), hello(pid=200))
    assert no_cuda.mode == MODE_HOST
    assert decide_transport(hello(boot=""), hello(boot="", pid=200)).mode == MODE_HOST
    # containers on one machine without a shared PID namespace: pid 1 in each, or a pid that means another process
    for peer_namespace in ("pid:[4026532999]", ""):
        apart = decide_transport(hello(), hello(pid=200, pid_namespace=peer_namespace))
        assert apart.mode == MODE_HOST and "different PID namespaces" in apart.reason


@pytest.mark.cpu
def test_local_hello_reads_this_process():
    h = local_hello()
    assert h.pid == os.getpid()
    assert h.boot_id == read_boot_id()
    if os.path.exists("/proc/self/ns/pid"):
        assert h.pid_namespace == os.readlink("/proc/self/ns/pid") and h.pid_namespace.startswith("pid:[")
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert len(h.boot_id) == 36
    if not torch.cuda.is_available():
        assert list(h.gpu_uuids) == []


@pytest.mark.cpu
def test_fallback_is_counted():
    counter = metrics.TRANSPORT_FALLBACKS.labels(peer="test-peer")
    before = counter._value.get()
    count_fallback("test-peer", "different boot id")
    assert counter._value.get() == before + 1


@pytest.mark.cpu
def test_negotiate_counts_host_decisions_only():
    counter = metrics.TRANSPORT_FALLBACKS.labels(peer="dit->vae")
    before = counter._value.get()
    assert negotiate(hello(), hello(pid=200), "dit->vae").mode == MODE_IPC
    assert counter._value.get() == before
    assert negotiate(hello(), hello(boot="other", pid=200), "dit->vae").mode == MODE_HOST
    assert counter._value.get() == before + 1


@pytest.mark.cpu
def test_gpu_check_refuses_to_run_without_cuda():
    from tools.dit.gpu_check import main, make_chunk

    chunk = make_chunk(7, torch.device("cpu"))
    assert chunk.shape == (128, 512) and torch.equal(chunk, make_chunk(7, torch.device("cpu")))
    assert not torch.equal(chunk[:64], make_chunk(5, torch.device("cpu")))
    if not torch.cuda.is_available():
        assert main([]) == 2


@pytest.mark.cpu
def test_send_tensor_without_producer_uses_host_parts():
    parts = send_tensor(torch.arange(6, dtype=torch.float32), None, "test-peer")
    assert len(parts) == 1 and parts[0].WhichOneof("where") == "host"


@pytest.mark.cpu
def test_ledger_lease_release_and_generations():
    ledger = SlotLedger(2)
    s0, g0 = ledger.lease()
    s1, g1 = ledger.lease()
    assert (s0, s1) == (0, 1) and g1 > g0 and ledger.leased == 2
    ledger.release(s0, g0)
    s2, g2 = ledger.lease()
    assert s2 == s0 and g2 > g1  # the reused slot gets a new generation
    with pytest.raises(IpcError, match="stale release of slot 0: generation"):
        ledger.release(s0, g0)  # the old lease of the same slot
    ledger.release(s2, g2)
    with pytest.raises(IpcError, match="double release of slot 0"):
        ledger.release(s2, g2)
    with pytest.raises(IpcError, match="slots 0..1"):
        ledger.release(7, g2)
    assert ledger.leased == 1


@pytest.mark.cpu
def test_ledger_exhaustion_is_a_clear_error():
    ledger = SlotLedger(3)
    leases = [ledger.lease() for _ in range(3)]
    with pytest.raises(PoolExhausted, match="all 3 slots are leased"):
        ledger.lease()
    ledger.release(*leases[1])
    assert ledger.lease()[0] == leases[1][0]
    with pytest.raises(IpcError, match="num_slots"):
        SlotLedger(0)


@pytest.mark.cpu
def test_pool_record_round_trip_and_rejects_garbage():
    rec = PoolRecord("GPU-a", b"\x00\x01" * 32, 64 << 20, 512, b"/torch_123_ref", 8, None, False, 42, "ab12")
    pool_id = rec.to_pool_id()
    assert pool_id.startswith("cudaipc1:")
    assert PoolRecord.from_pool_id(pool_id) == rec
    with pytest.raises(IpcError, match="not a 'cudaipc1:'"):
        PoolRecord.from_pool_id("pool-7")
    with pytest.raises(IpcError, match="does not decode"):
        PoolRecord.from_pool_id("cudaipc1:!!!notbase64")


@pytest.mark.cpu
def test_ref_checks_bytes_and_bounds():
    meta = pb.TensorMeta(dtype=pb.BFLOAT16, shape=[4, 8])
    ok = pb.CudaIpcRef(slot=1, offset_bytes=2 << 20, nbytes=64)
    assert _check_ref(ok, meta, 4 << 20) == (torch.bfloat16, [4, 8])
    with pytest.raises(IpcError, match="expected 64"):
        _check_ref(pb.CudaIpcRef(slot=1, offset_bytes=0, nbytes=60), meta, 4 << 20)
    with pytest.raises(IpcError, match="outside"):
        _check_ref(pb.CudaIpcRef(slot=1, offset_bytes=(4 << 20) - 32, nbytes=64), meta, 4 << 20)


@pytest.mark.cpu
def test_producer_refuses_cpu_device():
    with pytest.raises(IpcError, match="needs a CUDA device"):
        IpcProducer("cpu", 1 << 20)


@pytest.mark.cpu
def test_process_alive_tells_a_running_process_from_an_exited_one():
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # exited and reaped: its pid is free
    assert not process_alive(child.pid)


@pytest.mark.cpu
def test_pools_of_exited_producers_are_forgotten_with_their_events():
    alive = {10: True, 11: True}
    pools = OpenPools(alive=lambda pid: alive[pid])
    old, new = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    pools.add("pool-old", old, pid=10)
    pools.add("pool-new", new, pid=11)
    made = []
    event = lambda name: (lambda: made.append(name) or name)  # noqa: E731
    pools.event(b"ev-old", "pool-old", event("old"))
    pools.event(b"ev-new", "pool-new", event("new"))
    assert pools.close_exited() == []  # everyone alive: nothing forgotten
    alive[10] = False  # the old producer restarted
    assert pools.close_exited() == [10]
    assert pools.get("pool-old") is None and pools.get("pool-new") is new
    pools.event(b"ev-new", "pool-new", event("new again"))  # still cached
    pools.event(b"ev-old", "pool-old", event("old again"))  # forgotten: made anew if ever seen again
    assert made == ["old", "new", "old again"]


@pytest.mark.gpu
def test_producer_pool_is_aligned_and_exhausts():
    prod = IpcProducer(0, 3 << 20, num_slots=2)
    assert prod.slot_bytes == 2 << 20 and prod.pool_bytes == 4 << 20
    x = torch.randn(1000, device="cuda")
    parts = [prod.export(x), prod.export(x)]
    assert all((prod._buffer.data_ptr() + p.cuda.offset_bytes) % (2 << 20) == 0 for p in parts)
    with pytest.raises(PoolExhausted):
        prod.export(x)
    prod.release(pb.Release(pool_id=prod.pool_id, slot=parts[0].cuda.slot, generation=parts[0].cuda.generation))
    assert prod.export(x).cuda.slot == parts[0].cuda.slot
    with pytest.raises(IpcError, match="does not fit"):
        prod.export(torch.empty(3 << 20, dtype=torch.uint8, device="cuda"))


@pytest.mark.gpu
def test_an_export_whose_copy_fails_leases_no_slot():
    prod = IpcProducer(0, 2 << 20, num_slots=1)
    with pytest.raises((RuntimeError, NotImplementedError)):
        prod.export(torch.empty(4, device="meta"))  # no data to copy: the copy into the slot raises
    assert prod.leased == 0
    assert prod.export(torch.ones(4, device="cuda")).cuda.slot == 0  # the one slot is free


@pytest.mark.gpu
def test_consumer_refuses_own_pool():
    prod = IpcProducer(0, 2 << 20, num_slots=1)
    part = prod.export(torch.ones(4, device="cuda"))
    with pytest.raises(IpcError, match="this very process"):
        IpcConsumer().open(part)


@pytest.mark.gpu
def test_two_process_round_trip_and_flat_memory():
    from tools.dit.gpu_check import ipc_flatness_loop

    result = ipc_flatness_loop(chunks=1000)
    assert result["mismatches"] == 0
    assert result["producer_growth_bytes"] == 0
    assert result["consumer_growth_bytes"] == 0


def _short_lived_producer(conn, pool_mib: int) -> None:
    """Export one small tensor from a pool of `pool_mib` MiB, send the part, exit when told to."""
    producer = IpcProducer(0, pool_mib << 20, num_slots=1)
    (part,) = send_tensor(torch.full((4,), 7.0, device="cuda"), producer, "restart_test")
    torch.cuda.synchronize()
    conn.send_bytes(part.SerializeToString())
    conn.recv()  # "exit"
    del producer


@pytest.mark.gpu
def test_a_restarted_producer_leaves_no_pool_mapped_in_the_consumer():
    import multiprocessing as mp

    pool_mib = 512
    ctx = mp.get_context("spawn")
    consumer = IpcConsumer()

    def start():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_short_lived_producer, args=(child, pool_mib), daemon=True)
        proc.start()
        assert parent.poll(120), "producer did not export"
        return proc, parent, pb.TensorPart.FromString(parent.recv_bytes())

    first, first_conn, part = start()
    tensor, _ = consumer.open(part)
    assert tensor.tolist() == [7.0] * 4
    first_conn.send("exit")
    first.join(60)
    assert not process_alive(first.pid)
    second, second_conn, part = start()
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    tensor, _ = consumer.open(part)  # a new pool: the exited producer's is closed first
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info(0)
    assert tensor.tolist() == [7.0] * 4
    # the first producer's pool was only kept alive by this consumer's mapping; closing it frees it on the device
    assert free_after - free_before >= 0.9 * (pool_mib << 20), (free_before, free_after)
    second_conn.send("exit")
    second.join(60)

