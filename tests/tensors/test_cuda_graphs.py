"""CUDA graph bank: prompt buckets, keying, sealing and misses (CPU, eager bank); replay == eager bitwise (GPU)."""

import threading

import pytest
import torch

from services.tensors.cuda_graphs import CudaGraphBank, GraphError, GraphKey, PromptBuckets, signature_of


@pytest.mark.cpu
def test_prompt_buckets():
    b = PromptBuckets()
    assert [b.bucket(n) for n in (1, 128, 129, 300, 512)] == [128, 128, 256, 384, 512]
    with pytest.raises(GraphError, match="exceeds the largest bucket 512"):
        b.bucket(513)
    with pytest.raises(GraphError, match="positive int"):
        b.bucket(0)
    with pytest.raises(GraphError, match="strictly increasing"):
        PromptBuckets((256, 128))
    with pytest.raises(GraphError, match="positive ints"):
        PromptBuckets(())
    rows = torch.randn(100, 8)
    padded, n = PromptBuckets((64, 128)).pad(rows)
    assert padded.shape == (128, 8) and n == 100
    assert torch.equal(padded[:100], rows) and (padded[100:] == 0).all()
    same, n = PromptBuckets((100,)).pad(rows)
    assert same is rows and n == 100


@pytest.mark.cpu
def test_keys_distinguish_shape_dtype_tag_and_name():
    x, y = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    assert signature_of([x]) == (((4, 8), "float32"),)
    k = GraphKey.for_inputs("teacher", [x], tag=(1,))
    assert k == GraphKey.for_inputs("teacher", [torch.ones(4, 8)], tag=(1,))
    others = [GraphKey.for_inputs("teacher", [y], (1,)), GraphKey.for_inputs("teacher", [x], (2,)),
              GraphKey.for_inputs("text_encoder", [x], (1,)), GraphKey.for_inputs("teacher", [torch.zeros(5, 8)], (1,))]
    assert len({k, *others}) == 5
    with pytest.raises(GraphError, match="non-empty"):
        GraphKey.for_inputs("", [x])
    with pytest.raises(GraphError, match="expected a tensor"):
        signature_of([x, 3])


@pytest.mark.cpu
def test_cpu_bank_capture_run_seal_and_misses():
    bank = CudaGraphBank("cpu")
    assert not bank.enabled

    def fn(a, b):
        return a * 2 + b

    a, b = torch.ones(3), torch.arange(3.0)
    key = GraphKey.for_inputs("teacher", [a, b], tag=("step", 0))
    out = bank.capture(key, fn, [a, b])
    assert torch.equal(out, a * 2 + b) and key in bank and len(bank) == 1
    with pytest.raises(GraphError, match="already captured"):
        bank.capture(key, fn, [a, b])
    with pytest.raises(GraphError, match="do not match the key"):
        bank.capture(GraphKey.for_inputs("teacher", [a, b], tag=("step", 1)), fn, [a])
    got = bank.run(key, lambda *_: pytest.fail("the captured callable must run"), [b, a])
    assert torch.equal(got, b * 2 + a)
    with pytest.raises(GraphError, match="do not match graph"):
        bank.run(key, fn, [torch.ones(4), a])
    bank.seal()
    late = GraphKey.for_inputs("teacher", [a, b], tag=("step", 5))
    with pytest.raises(GraphError, match="after seal"):
        bank.capture(late, fn, [a, b])
    assert torch.equal(bank.run(late, fn, [a, b]), a * 2 + b)  # eager, counted
    assert bank.stats.misses == 1 and bank.stats.missed_keys == [late] and bank.stats.captured == 1
    bank.close()  # everything freed: the captured key now runs eagerly (a miss), and nothing can be captured
    assert len(bank) == 0 and key not in bank
    assert torch.equal(bank.run(key, fn, [b, a]), b * 2 + a) and bank.stats.misses == 2
    with pytest.raises(GraphError, match="after seal"):
        bank.capture(key, fn, [a, b])
    with pytest.raises(GraphError, match="warmup"):
        CudaGraphBank("cpu", warmup=0)


@pytest.mark.cpu
def test_static_inputs_captured_in_inference_mode_take_copies_outside_it():
    # A replay copies its inputs into the static buffers; the DiT's teacher captures in the bench's inference mode and
    # replays from a worker thread, where inference mode (thread-local) is off.
    with torch.inference_mode():
        bank = CudaGraphBank("cpu")
        x = torch.ones(4)
        key = GraphKey.for_inputs("teacher", [x])
        bank.capture(key, lambda t: t * 2, [x])
    (static,) = bank._entries[key].static_inputs
    assert x.is_inference() and not static.is_inference()
    static.copy_(torch.full((4,), 3.0))  # an inference tensor here: "Inplace update to inference tensor outside ..."
    assert static.tolist() == [3.0] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replay_equals_eager_bitwise_and_outputs_are_static():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 256, device="cuda", generator=gen, dtype=torch.bfloat16)

    def fn(x):
        return torch.softmax(x @ w, dim=-1) @ w.T

    bank = CudaGraphBank("cuda")
    x0 = torch.randn(64, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    key = GraphKey.for_inputs("teacher", [x0])
    bank.capture(key, fn, [x0])
    bank.seal()
    for _ in range(3):
        x = torch.randn(64, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
        got = bank.run(key, fn, [x])
        assert torch.equal(got, fn(x))
    assert bank.run(key, fn, [x]) is got  # the graph's output buffer, overwritten by every replay
    assert bank.stats.replays == 4 and bank.stats.misses == 0
    before = torch.cuda.memory_reserved()
    bank.close()
    del got
    torch.cuda.empty_cache()
    assert len(bank) == 0 and torch.cuda.memory_reserved() < before  # the pool's memory came back


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_bank_captures_and_replays_on_its_own_device_whatever_the_current_one():
    # The VAE service captures its audio decoder on cuda:1 from a thread whose current device is cuda:0.
    torch.cuda.set_device(0)
    w = torch.randn(1, 1, 7, device="cuda:1")

    def fn(x):  # a replicate pad allocates on cuda:1 during the capture
        return torch.nn.functional.conv1d(torch.nn.functional.pad(x, (3, 3), mode="replicate"), w)

    bank = CudaGraphBank("cuda:1")
    x = torch.randn(2, 1, 100, device="cuda:1")
    key = GraphKey.for_inputs("audio_vae", [x])
    bank.capture(key, fn, [x])
    bank.seal()
    y = torch.randn(2, 1, 100, device="cuda:1")
    assert torch.cuda.current_device() == 0
    assert torch.equal(bank.replay(key, [y]), fn(y)) and bank.stats.replays == 1


@pytest.mark.gpu
def test_two_banks_replay_side_by_side_each_with_its_own_capture_stream():
    # The DiT's teacher graphs replay from a worker thread beside its block pieces: thin GEMMs with a long K (cuBLAS
    # splits K and coordinates the splits through the workspace of the stream the graph was captured on).
    w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) / 64

    def fn(x):
        return x @ w

    banks = [CudaGraphBank("cuda"), CudaGraphBank("cuda")]
    assert banks[0].stream != banks[1].stream
    x = torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16)
    key = GraphKey.for_inputs("thin_gemm", [x])
    for bank in banks:
        bank.capture(key, fn, [x])
        bank.seal()
    want = fn(x)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def replay(i: int) -> None:
        with torch.cuda.stream(streams[i]):
            for _ in range(300):
                banks[i].replay(key, [x])
        streams[i].synchronize()

    threads = [threading.Thread(target=replay, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a replay hung"
    for bank in banks:
        assert torch.equal(bank.replay(key, [x]), want)
