"""MiniMax-H3 DiT ("H3-Omni-Transformer"): one packed single-stream transformer over text, audio and video rows.

Module names follow the ORIGINAL checkpoint keys (`blocks.N.attn.qkv_proj`, `mlp.fc1`, `final_layer.video_out`, ...),
with `qkv_proj` rows in [Q; K; V] order. Knows nothing about checkpoints on disk or KV caches: attention is a
callable handed to `forward` (`AttentionPattern`), sequence parallelism is the `sequence_shard` object installed
from outside, LoRA wraps the plain `nn.Linear`s from outside (peft, `lora.py`). A block reads a wrapped QKV
projection or fc1 as its base output, its branch's down-projection and its up-projection (`lora_down`, `lora_up`),
so that on CUDA the kernel consuming the output (`lora_kernels.py`) also does the up-projection.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.dit.model.adaln_cache import AdaLNCacheReport, install_adaln_cache
from services.dit.model.attention_kernels import sdpa_rows
from services.dit.model.fused import cuda_compiled, gated_residual, norm_modulate, qk_norm_rope, rms_norm, swiglu
from services.dit.model.layout import NUM_MODALITIES, PackedLayout
from services.dit.model.shard import NoShard, SequenceShard, ShardedAttend, pack_head_groups

# Parameters the shipped checkpoint keeps in float32 (prefixes of the original key names).
FP32_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                 "final_layer.audio_out.", "rope.")


@dataclass(frozen=True)
class ModelArgs:
    """Architecture hyper-parameters; `PRESETS["full"]` equals the shipped `FL2VA/transformer/config.json`."""

    hidden_size: int = 5376
    """Residual stream width."""
    num_layers: int = 50
    """DiT blocks."""
    refiner_layers: int = 2
    """Token-refiner blocks applied to the projected text rows."""
    num_heads: int = 56
    """Attention heads (inner dim num_heads * head_dim is not hidden_size)."""
    head_dim: int = 128
    """Channels per head."""
    ffn_hidden: int = 14336
    """SwiGLU inner width; fc1 outputs [gate | up] = 2 * ffn_hidden."""
    video_channels: int = 24
    """Video latent channels."""
    audio_channels: int = 32
    """Audio latent channels (one row per latent per channel)."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) patch of video latents; a video row holds video_channels * prod(patch_size) values."""
    text_dim: int = 5120
    """Text-encoder hidden size."""
    timestep_dim: int = 256
    """Sinusoidal timestep embedding width."""
    time_embed_hidden: int = 5376
    """Timestep MLP inner width."""
    time_embed_dim: int = 2688
    """Timestep MLP output width (input of every AdaLN projection)."""
    rope_freqs: int = 16
    """RoPE frequencies per axis; 2 * 3 * rope_freqs head channels rotate."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """Epsilon of the block pre-norms."""
    qk_norm_eps: float = 1e-5
    """Epsilon of the per-head QK norms."""
    final_norm_eps: float = 1e-5
    """Epsilon of the refiner output norm and the final-layer norm."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "patch_size":
                if len(v) != 3 or any(not isinstance(p, int) or p < 1 for p in v):
                    raise ValueError(f"patch_size={v!r} must be three positive ints (t, h, w)")
            elif isinstance(v, float):
                if not v > 0:
                    raise ValueError(f"{f.name}={v} must be > 0")
            elif not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}={v!r} must be a positive int")
        if self.rope_dims > self.head_dim:
            raise ValueError(f"rope_freqs={self.rope_freqs} rotates {self.rope_dims} channels but head_dim="
                             f"{self.head_dim}; need 6 * rope_freqs <= head_dim")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def video_row_dim(self) -> int:
        return self.video_channels * math.prod(self.patch_size)

    @property
    def rope_dims(self) -> int:
        return 6 * self.rope_freqs

    @property
    def adaln_out(self) -> int:
        return 6 * self.hidden_size * NUM_MODALITIES

    @property
    def final_adaln_out(self) -> int:
        return 2 * self.hidden_size


PRESETS: dict[str, ModelArgs] = {
    "full": ModelArgs(),
    "tiny": ModelArgs(hidden_size=96, num_layers=2, refiner_layers=2, num_heads=4, head_dim=32, ffn_hidden=192,
                      text_dim=64, time_embed_hidden=96, time_embed_dim=48, rope_freqs=4),
}


class AttentionPattern(Protocol):
    """Attention over packed rows: q/k/v `[S, H_local, D]` after QK-norm and RoPE, global row order; each may be a
    strided view (last dim contiguous): under Ulysses they are the three planes of the receive buffer."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class FullAttention:
    """Base pattern: the real rows form one document, the pad rows another (block-diagonal by slicing).

    Text rows a prompt-length bucket appended (`layout.text_valid` False) are masked out as keys of the document.
    """

    def __init__(self, layout: PackedLayout):
        self.num_real = layout.num_real
        self.seq_len = layout.seq_len
        self.key_valid = None  # [num_real] bool when the text is padded
        if layout.text_valid is not None:
            valid = layout.text_valid
            self.key_valid = torch.cat([valid, valid.new_ones(layout.num_real - layout.text_len)])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D]
        if q.shape[0] != self.seq_len:
            raise ValueError(f"FullAttention built for {self.seq_len} rows got q with {q.shape[0]} rows")
        n = self.num_real
        if n == self.seq_len:  # a fresh tensor, not a view, like every pattern's output: the compiled block
            return sdpa_rows(q, k, v, self.key_valid).clone()  # region is specialised on whether its input is a view
        return torch.cat([sdpa_rows(q[:n], k[:n], v[:n], self.key_valid), sdpa_rows(q[n:], k[n:], v[n:])], dim=0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., C]; statistics in float32, result in x's dtype
        return rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """3-axis RoPE: one `inv_freq` shared by t/h/w; channels [t h w t h w] x rope_freqs rotate (rotate-half)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        n = args.rope_freqs
        self.register_buffer("inv_freq", rope_inv_freq(n, args.rope_theta), persistent=True)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [S, 3] -> cos, sin: [S, 6 * rope_freqs] float32
        ang = positions.float()[:, :, None] * self.inv_freq.float()[None, None, :]  # [S, 3, F]
        ang = ang.flatten(1)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()


def rope_inv_freq(n: int, theta: float) -> torch.Tensor:
    """The `rope.inv_freq` buffer: theta ** (-2i / 2n), i < n, float32."""
    return 1.0 / (theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, 3 * args.inner_dim, bias=False)  # rows [Q; K; V]
        self.q_norm = RMSNorm(args.head_dim, args.qk_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.qk_norm_eps)
        self.out_proj = nn.Linear(args.inner_dim, args.hidden_size, bias=False)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[S, H, D]` of x `[S, C]`, QK-norm applied (the refiner's; a DiT block's is `attention_inputs`)."""
        qkv = self.qkv_proj(x).unflatten(-1, (3, self.num_heads, self.head_dim))  # [S, 3, H, D]
        q, k, v = qkv.unbind(1)
        return self.q_norm(q), self.k_norm(k), v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        # out: [S, H, D] -> [S, C]
        return self.out_proj(out.flatten(1))

    def forward(self, x: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        # x: [S, C] -> [S, C]
        return self.project_out(attend(*self.project_qkv(x)))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, 2 * args.ffn_hidden, bias=False)  # rows [gate; up]
        self.fc2 = nn.Linear(args.ffn_hidden, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x)))


class AdaLNProj(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim, bias=True)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        # temb: [n, E] float32 -> [n, out] in the projection's dtype (SiLU at temb's precision)
        return self.linear(F.silu(temb).to(self.linear.weight.dtype))


class RefinerBlock(nn.Module):
    """Plain pre-norm block over text rows: no AdaLN, no RoPE."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args)
        self.norm2 = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
        # x: [Tt, C]; key_valid: [Tt] or [Tt, Tt] bool, or None
        x = x + self.attn(self.norm1(x), lambda q, k, v: sdpa_rows(q, k, v, key_valid))
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.blocks = nn.ModuleList([RefinerBlock(args) for _ in range(args.refiner_layers)])
        self.final_norm = RMSNorm(args.hidden_size, args.final_norm_eps)

    def forward(self, x: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        # x: [Tt, C]; key_valid: [Tt] bool, False on bucket padding (None: all rows real), or [Tt, Tt] bool, the keys
        # of each row (several prompts packed, each over its own rows)
        for block in self.blocks:
            x = block(x, key_valid)
        return self.final_norm(x)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args)
        self.norm2 = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = MLP(args)
        self.adaln_proj = AdaLNProj(args.time_embed_dim, args.adaln_out)

    def forward(self, x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], attend: ShardedAttend) -> torch.Tensor:
        # x: [S, C]; table: [n * 3, 6, C] AdaLN (shift, scale, gate) x (attention, mlp); rows: [S] table row per x row
        h, d, g = self.attn.num_heads, self.attn.head_dim, attend.degree
        send = x.new_empty(g, x.shape[0], 3, h // g, d)
        attention_inputs(self, x, table, rows, *rope, send)
        out = x.new_empty(x.shape[0], h, d)
        attend.packed(send, out)
        return residual_branches(self, x, table, rows, out)


def attention_inputs(block: Block, x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, send: torch.Tensor) -> None:
    """A block's work before its attention: q, k, v of x (QK-norm and RoPE applied) written into `send`
    `[G, S, 3, H / G, D]` by head group (`pack_head_groups`' layout)."""
    base, down = qkv_projection(block, x, table, rows)
    attn = block.attn
    up, scale = lora_up(attn.qkv_proj, down)
    if fused_kernels(base, attn.head_dim):
        lora_kernels().qkv_heads(base, down, up, scale, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                                 cos, sin, send)
        return
    qkv = with_branch(base, down, up, scale).unflatten(-1, (3, attn.num_heads, attn.head_dim))  # [S, 3, H, D]
    q, k, v = qkv.unbind(1)
    q, k = qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin)
    pack_head_groups(q, k, v, send)


def residual_branches(block: Block, x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                      attn_out: torch.Tensor) -> torch.Tensor:
    """A block's work after its attention: the gated attention residual, then the modulated, gated MLP residual ->
    x `[S, C]`."""
    x, base, down = mlp_inputs(block, x, table, rows, attn_out)
    up, scale = lora_up(block.mlp.fc1, down)
    if fused_kernels(base):
        act = lora_kernels().swiglu(base, down, up, scale)
    else:
        act = swiglu(with_branch(base, down, up, scale))
    return mlp_residual(block, x, table, rows, act)


@cuda_compiled
def qkv_projection(block: Block, x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compiled region: AdaLN-modulated norm and the QKV projection's base output `[S, 3 * H * D]` and LoRA
    down-projection `[S, rank]` (`lora_down`)."""
    mod = table[:, :2].index_select(0, rows)  # [S, 2, C]: this region's (shift, scale)
    h = norm_modulate(x, block.norm1.weight, mod[:, 0], mod[:, 1], block.norm1.eps)
    return lora_down(block.attn.qkv_proj, h)


@cuda_compiled
def mlp_inputs(block: Block, x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, attn_out: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Compiled region: the gated attention residual -> x `[S, C]`, then the modulated norm and fc1's base output
    `[S, 2F]` and LoRA down-projection."""
    mod = table[:, 2:5].index_select(0, rows)  # [S, 3, C]: the attention's gate, the MLP's (shift, scale)
    x = gated_residual(x, mod[:, 0], block.attn.project_out(attn_out))
    h = norm_modulate(x, block.norm2.weight, mod[:, 1], mod[:, 2], block.norm2.eps)
    return (x, *lora_down(block.mlp.fc1, h))


@cuda_compiled
def mlp_residual(block: Block, x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, act: torch.Tensor
                 ) -> torch.Tensor:
    """Compiled region: fc2 of the SwiGLU activation `[S, F]` as the MLP's gated residual -> x `[S, C]`."""
    gate = table[:, 5].index_select(0, rows)  # [S, C]
    return gated_residual(x, gate, block.mlp.fc2(act))


def lora_down(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear`'s base output on x and, where a LoRA side branch is on (peft's `LoraLayer`, which `lora.py`
    installs), the branch's down-projection A x `[S, rank]`; (linear(x), None) otherwise. The up-projection is left
    to the kernel that consumes the output (`lora_up`)."""
    base = getattr(linear, "base_layer", None)
    if base is None or linear.disable_adapters:
        return linear(x), None
    (name,) = linear.active_adapters
    return base(x), linear.lora_A[name](x)


def lora_up(linear: nn.Module, down: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
    """The up-projection B `[out, rank]` and the scale of `linear`'s LoRA side branch; (None, 0.0) where
    `lora_down` found the branch off (`down` None)."""
    if down is None:
        return None, 0.0
    (name,) = linear.active_adapters
    return linear.lora_B[name].weight, linear.scaling[name]


def with_branch(base: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor | None, scale: float
                ) -> torch.Tensor:
    """base + scale * B (A x), as peft computes a LoRA linear: the plain-torch reference of the kernels."""
    return base if down is None else base + F.linear(down, up) * scale


def fused_kernels(base: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the Triton kernels (`lora_kernels`) finish the linears whose base output is `base`: CUDA, 16-bit."""
    return base.is_cuda and base.dtype in (torch.bfloat16, torch.float16) and (
        head_dim is None or (head_dim >= 16 and head_dim & (head_dim - 1) == 0))


def lora_kernels():
    """`services.dit.model.lora_kernels`, imported on first CUDA use: it needs Triton, which CPU installs lack."""
    try:
        from services.dit.model import lora_kernels as kernels
    except ImportError as e:
        raise RuntimeError(f"the DiT's CUDA path needs Triton (the triton package, which CUDA builds of torch "
                           f"install), and it does not import here ({e})") from e
    return kernels


class TimeEmbedder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.timestep_dim
        self.proj_in = nn.Linear(args.timestep_dim, args.time_embed_hidden, bias=True)
        self.proj_out = nn.Linear(args.time_embed_hidden, args.time_embed_dim, bias=True)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # t: [n] float32 in [0, 1] (unscaled) -> [n, time_embed_dim] float32
        return self.proj_out(F.silu(self.proj_in(timestep_sinusoid(t, self.dim).to(self.proj_in.weight.dtype))))


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[cos | sin] of t * 10000^(-i / (dim/2)), i < dim/2."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    ang = t.float()[:, None] * freqs[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


class FinalLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.final_norm_eps)
        self.adaln_proj = AdaLNProj(args.time_embed_dim, args.final_adaln_out)
        self.video_out = nn.Linear(args.hidden_size, args.video_row_dim, bias=True)
        self.audio_out = nn.Linear(args.hidden_size, args.audio_channels, bias=True)


class DiT(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.video_patch_proj = nn.Linear(args.video_row_dim, args.hidden_size, bias=True)
        self.audio_patch_proj = nn.Linear(args.audio_channels, args.hidden_size, bias=True)
        self.condition_proj = nn.Linear(args.text_dim, args.hidden_size, bias=True)
        self.time_embedder = TimeEmbedder(args)
        self.rope = Rope(args)
        self.token_refiner = TokenRefiner(args)
        self.blocks = nn.ModuleList([Block(args) for _ in range(args.num_layers)])
        self.final_layer = FinalLayer(args)
        self.sequence_shard: SequenceShard = NoShard()
        self.adaln_table = None  # set by cache_adaln(); then the adaln_proj linears are gone
        self.block_graphs = None  # `BlockGraphs`, installed from outside: the block stack as piecewise CUDA graphs

    @property
    def dtype(self) -> torch.dtype:
        return self.condition_proj.weight.dtype

    def cache_adaln(self, timesteps: Sequence[float]) -> AdaLNCacheReport:
        """Precompute every AdaLN modulation for `timesteps`, drop the adaln_proj weights; returns the report."""
        return install_adaln_cache(self, timesteps)

    def _check_inputs(self, video, audio, text, layout: PackedLayout) -> None:
        a = self.args
        for name, x, rows, width in (("video", video, layout.video_len, a.video_row_dim),
                                     ("audio", audio, layout.audio_rows, a.audio_channels),
                                     ("text", text, layout.text_len, a.text_dim)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (rows, width):
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} has shape {shape}, expected ({rows}, {width}) for this layout")

    def _block_tables(self, layout: PackedLayout, blocks: range) -> list[torch.Tensor]:
        """Per block of `blocks`, the AdaLN table `[n * 3, 6, C]` of the layout's timesteps."""
        if self.adaln_table is not None:
            return self.adaln_table.block_tables(layout.timestep_values, blocks)
        temb = self.time_embedder(layout.timesteps)  # [n, E] float32
        return [self.blocks[i].adaln_proj(temb).view(-1, 6, self.args.hidden_size) for i in blocks]

    def _final_table(self, layout: PackedLayout) -> torch.Tensor:
        """The final layer's table `[n, 2, C]` of the layout's timesteps."""
        if self.adaln_table is not None:
            return self.adaln_table.final_table(layout.timestep_values)
        temb = self.time_embedder(layout.timesteps)  # [n, E] float32
        return self.final_layer.adaln_proj(temb).view(-1, 2, self.args.hidden_size)

    def forward(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, layout: PackedLayout,
                attention: AttentionPattern, heads: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run one packed document; returns (video_v [Tv, 96], audio_v [Ta, 32]) float32, or None if not heads."""
        # video: [Tv, 96], audio: [Ta, 32], text: [Tt, text_dim]
        x = self.embed(video, audio, text, layout)
        x = self.run_blocks(x, layout, attention, range(len(self.blocks)))
        return self.head(x, layout) if heads else None

    def embed(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, layout: PackedLayout
              ) -> torch.Tensor:
        """The packed rows `[S, C]` that enter the first block: input projections, the text through the refiner.

        A layout may have no text rows: the attention pattern then brings the text's K/V recorded earlier."""
        # video: [Tv, 96], audio: [Ta, 32], text: [Tt, text_dim] -> x: [S, C]
        self._check_inputs(video, audio, text, layout)
        dt, dev, c = self.dtype, self.condition_proj.weight.device, self.args.hidden_size
        v_rows = self.video_patch_proj(video.to(dev, self.video_patch_proj.weight.dtype)).to(dt)
        a_rows = self.audio_patch_proj(audio.to(dev, self.audio_patch_proj.weight.dtype)).to(dt)
        x = torch.zeros(layout.seq_len, c, device=dev, dtype=dt)  # [S, C]
        if layout.text_len:  # the refiner: full attention over the real text rows only
            t_rows = self.token_refiner(self.condition_proj(text.to(dev, dt)), layout.text_valid)
            x.index_copy_(0, layout.text_index.to(dev), t_rows)
        x.index_copy_(0, layout.audio_index.to(dev), a_rows)
        x.index_copy_(0, layout.video_index.to(dev), v_rows)
        return x

    def run_blocks(self, x: torch.Tensor, layout: PackedLayout, attention: AttentionPattern, blocks: range
                   ) -> torch.Tensor:
        """Blocks `blocks` (a contiguous range of layer indices) on the packed rows `[S, C]`, sharded over the
        sequence shard inside; every block eagerly, or the whole stack replaying the piecewise CUDA graphs captured
        for its shape (`block_graphs`)."""
        dev = x.device
        mods = self._block_tables(layout, blocks)
        cos, sin = self.rope(layout.positions.to(dev))
        shard = self.sequence_shard
        x = shard.split(x)  # [S, C] -> [S / N, C] on this rank
        rows = shard.split(layout.adaln_rows.to(dev))
        rope = (shard.split(cos.to(x.dtype)), shard.split(sin.to(x.dtype)))
        attends = [shard.attend(functools.partial(attention, i)) for i in blocks]
        whole = blocks == range(len(self.blocks))
        if whole and self.block_graphs is not None and self.block_graphs.covers(x, mods):
            x = self.block_graphs.run(x, mods, rows, rope, attends)
        else:
            for i, table, attend in zip(blocks, mods, attends):
                x = self.blocks[i](x, table, rows, rope, attend)
        return shard.gather(x)

    def head(self, x: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm + (shift, scale) per timestep slot on the video and audio rows of `x` `[S, C]`, then the
        float32 heads: (video_v [Tv, 96], audio_v [Ta, 32])."""
        dev = x.device
        final_mod = self._final_table(layout)
        sel = torch.cat([layout.video_index, layout.audio_index]).to(dev)
        fm = final_mod.index_select(0, layout.timestep_slot.to(dev).index_select(0, sel))  # [Tv + Ta, 2, C]
        h = self.final_layer.norm(x.index_select(0, sel)) * (1.0 + fm[:, 1]) + fm[:, 0]
        h = h.to(self.final_layer.video_out.weight.dtype)
        tv = layout.video_len
        return self.final_layer.video_out(h[:tv]), self.final_layer.audio_out(h[tv:])


def is_fp32_param(name: str) -> bool:
    """True for the parameters the shipped checkpoint stores (and the model keeps) in float32."""
    return name.startswith(FP32_PREFIXES)


def cast_model(model: DiT, dtype: torch.dtype) -> DiT:
    """Cast to `dtype`, keeping patch projections, time embedder, heads and rope.inv_freq in float32."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        want = torch.float32 if is_fp32_param(name) else dtype
        if p.dtype != want:
            p.data = p.data.to(want)
    return model


def meta_model(args: ModelArgs, dtype: torch.dtype = torch.bfloat16) -> DiT:
    """The model on the meta device with the final dtypes (no memory); used for shape checks and loading."""
    with torch.device("meta"):
        model = DiT(args)
    return cast_model(model, dtype)


def build_random(args: ModelArgs, device: torch.device | str, dtype: torch.dtype, seed: int) -> DiT:
    """Build the model with random weights directly on `device` (normal std 0.02, norms 1, biases 0)."""
    model = meta_model(args, dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 0.02, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
        model.rope.inv_freq.copy_(rope_inv_freq(args.rope_freqs, args.rope_theta))
    return model.eval().requires_grad_(False)
