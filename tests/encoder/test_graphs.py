"""Text-encoder graphs: a prompt padded to its bucket gives the unpadded hidden states (the stack is causal), every
bucket is captured at start-up, and on the GPU a replay equals the same padded forward run eagerly, bitwise."""

import pytest
import torch

from services.common.config import EncoderConfig
from services.tensors.cuda_graphs import PromptBuckets
from services.encoder.model import TextEncoder

BUCKETS = PromptBuckets((8, 16, 32))


@pytest.mark.cpu
def test_padded_encode_equals_the_unpadded_prompt_and_never_misses():
    enc = TextEncoder.random("tiny", "cpu", torch.float32, seed=0, max_tokens=32)
    ids = [list(torch.randint(0, enc.stack.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)))
           for n in (3, 8, 9, 32)]
    ref = [enc.encode_ids(i) for i in ids]
    enc.capture_graphs(BUCKETS)
    assert len(enc.graphs) == len(BUCKETS.sizes)
    for i, r in zip(ids, ref):
        got = enc.encode_ids(i)
        assert got.shape == r.shape
        torch.testing.assert_close(got, r, rtol=1e-5, atol=1e-5)
    assert enc.graphs.stats.misses == 0


@pytest.mark.cpu
def test_buckets_must_hold_the_longest_prompt():
    enc = TextEncoder.random("tiny", "cpu", torch.float32, seed=0, max_tokens=64)
    with pytest.raises(ValueError, match="do not hold max_tokens=64"):
        enc.capture_graphs(BUCKETS)
    with pytest.raises(ValueError, match="largest bucket must hold encoder.max_tokens=512"):
        EncoderConfig(device="cuda:0", cuda_graphs=True, prompt_buckets=(128, 256))
    with pytest.raises(ValueError, match="graphs need CUDA"):
        EncoderConfig(device="cpu", cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_encoder_graph_replay_equals_eager_bitwise_on_gpu():
    enc = TextEncoder.random("tiny", "cuda", torch.bfloat16, seed=0, max_tokens=32)
    enc.capture_graphs(BUCKETS)
    for n in (5, 16, 30):
        ids = torch.randint(0, enc.stack.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        got = enc.encode_ids(ids)
        padded, _ = BUCKETS.pad(ids.cuda())
        with torch.inference_mode():
            eager = enc.stack(padded)[:n]
        assert torch.equal(got, eager)
    assert enc.graphs.stats.replays == 3 and enc.graphs.stats.misses == 0
