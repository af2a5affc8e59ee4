"""Host-bytes tensor transport: round trips, 1 MiB parts, and malformed streams."""
import pytest
import torch

from services.tensors.transport import MAX_PART_BYTES, TensorAssembler, TransportError, tensor_to_parts

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16])
def test_round_trip_is_bitwise(dtype):
    t = (torch.randn(3, 700, 129) * 50).to(dtype)
    asm = TensorAssembler("x")
    parts = tensor_to_parts(t)
    out = [asm.add(p) for p in parts]
    assert all(o is None for o in out[:-1])
    assert out[-1].dtype == dtype and out[-1].shape == t.shape
    assert torch.equal(out[-1].view(torch.uint8), t.contiguous().view(torch.uint8))


def test_parts_are_at_most_one_mib():
    t = torch.randn(3 * MAX_PART_BYTES // 4 + 5)  # a little over 3 MiB
    parts = tensor_to_parts(t)
    assert len(parts) == 4
    assert all(len(p.host.data) <= MAX_PART_BYTES for p in parts)


def test_empty_tensor_travels():
    out = TensorAssembler("e").add(tensor_to_parts(torch.empty(0, 5))[0])
    assert out.shape == (0, 5)


def test_out_of_order_part_is_rejected():
    parts = tensor_to_parts(torch.randn(MAX_PART_BYTES // 2))
    with pytest.raises(TransportError, match="part 1 of 2 arrived after 0"):
        TensorAssembler("video").add(parts[1])


def test_wrong_byte_count_is_rejected():
    part = tensor_to_parts(torch.randn(10))[0]
    part.host.data = part.host.data[:-4]
    with pytest.raises(TransportError, match="part 0 of 1 holds 36 bytes, expected 40 of the 40 announced"):
        TensorAssembler("audio").add(part)


def test_unsupported_dtype_is_named():
    with pytest.raises(TransportError, match="complex64"):
        tensor_to_parts(torch.zeros(2, dtype=torch.complex64))


def test_an_oversized_announcement_is_refused_before_any_bytes_are_kept():
    part = tensor_to_parts(torch.zeros(4))[0]
    del part.meta.shape[:]
    part.meta.shape.extend([1 << 20, 1 << 10])  # 4 GiB of float32
    with pytest.raises(TransportError, match="more than the"):
        TensorAssembler("video").add(part)


def test_a_part_count_that_does_not_match_the_size_is_refused():
    part = tensor_to_parts(torch.zeros(4))[0]
    part.host.count = 5000
    with pytest.raises(TransportError, match="5000 parts announced for 16 bytes"):
        TensorAssembler("audio").add(part)


def test_a_later_part_cannot_raise_the_part_count():
    parts = tensor_to_parts(torch.zeros(MAX_PART_BYTES // 2 + 1))  # 3 parts
    asm = TensorAssembler("video")
    asm.add(parts[0])
    parts[1].host.count = 1000
    with pytest.raises(TransportError, match="part 1 announces 1000 parts, the first announced 3"):
        asm.add(parts[1])


@pytest.mark.parametrize("which, extra", [(1, MAX_PART_BYTES), (2, 1)])
def test_a_part_larger_than_its_share_of_the_announced_bytes_is_refused(which, extra):
    # a stream may not buffer more than the tensor it announced: a full part is 1 MiB, the last holds the rest
    parts = tensor_to_parts(torch.zeros(MAX_PART_BYTES // 2 + 1))  # 1 MiB, 1 MiB, 4 bytes
    parts[which].host.data += bytes(extra)
    asm = TensorAssembler("video")
    for part in parts[:which]:
        assert asm.add(part) is None
    with pytest.raises(TransportError, match=f"part {which} of 3 holds {len(parts[which].host.data)} bytes"):
        asm.add(parts[which])
