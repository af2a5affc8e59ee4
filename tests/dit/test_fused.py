"""The fused element-wise kernels compute the same function as their plain-torch references."""
import pytest
import torch

from services.dit import fused


def _inputs(device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    s, c, h, d, rot = 300, 256, 4, 64, 48
    return dict(x=r(s, c), w=r(c), shift=r(s, c), scale=r(s, c), gate=r(s, c), y=r(s, c), q=r(s, h, d), k=r(s, h, d),
                wq=r(d), wk=r(d), cos=r(s, rot), sin=r(s, rot), h2=r(s, 2 * c))


def _check(device, dtype, tol):
    t = _inputs(device, dtype)
    eps = 1e-5
    pairs = [
        (fused.norm_modulate(t["x"], t["w"], t["shift"], t["scale"], eps),
         fused.rms_norm(t["x"], t["w"], eps) * (1.0 + t["scale"]) + t["shift"]),
        (fused.gated_residual(t["x"], t["gate"], t["y"]), t["x"] + t["gate"] * t["y"]),
        (fused.swiglu(t["h2"]), torch.nn.functional.silu(t["h2"][:, :256]) * t["h2"][:, 256:]),
    ]
    q, k = fused.qk_norm_rope(t["q"], t["k"], t["wq"], t["wk"], eps, t["cos"], t["sin"])
    pairs += [(q, fused.apply_rope(fused.rms_norm(t["q"], t["wq"], eps), t["cos"], t["sin"])),
              (k, fused.apply_rope(fused.rms_norm(t["k"], t["wk"], eps), t["cos"], t["sin"]))]
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < tol, err


@pytest.mark.cpu
def test_cpu_path_is_the_reference_bitwise():
    _check("cpu", torch.float32, 1e-7)


@pytest.mark.cpu
def test_rope_leaves_the_unrotated_channels_alone():
    x = torch.randn(5, 2, 8)
    cos, sin = torch.ones(5, 6), torch.zeros(5, 6)
    out = fused.apply_rope(x, cos, sin)
    assert torch.equal(out, x)
    out = fused.apply_rope(x, torch.zeros(5, 6), torch.ones(5, 6))  # a quarter turn: (x1, x2) -> (-x2, x1)
    assert torch.equal(out[..., 6:], x[..., 6:])
    assert torch.equal(out[..., :3], -x[..., 3:6]) and torch.equal(out[..., 3:6], x[..., :3])


@pytest.mark.gpu
def test_compiled_cuda_kernels_match_the_reference():
    _check("cuda", torch.bfloat16, 1e-2)
