"""The base DiT's objective on packed documents: an example made ready for one forward (`Document`), several
packed into one forward (`pack_documents`, `DocumentsAttention`), and their flow-matching losses.

An example is one of the two documents the base model meets in serving (see `tools.train.dit`): a request-0 clip,
or an audio teacher document. Objective (rectified flow, `stream.schedule`'s convention): for clean latents x0 and
noise e, x_s = (1 - s) x0 + s e and the model, given t = 1 - s, predicts v with x0_hat = x_s + s v, so the target
is v = x0 - e. The network's packed rows have no batch axis, so a step's documents are packed block by block and
each attends only to its own rows, which gives every document the velocity it would get alone for about a third of
the operations separate forwards dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.dit.model.layout import PackedLayout, pack_layout, padded_rows
from services.dit.model.network import PRESETS, DiT
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, Canvas, plan_request
from services.dit.stream.runtime import patchify
from services.dit.stream.schedule import AUDIO_SHIFT, TEACHER_SHIFT, VIDEO_SHIFT, model_t
from services.dit.stream.timeline import UNITS_PER_FRAME, Timeline, frame_grid, latent_frame_offset
from tools.train import world

WORLD_CANVAS = Canvas(width=world.WIDTH, height=world.HEIGHT)


def tail_latents(request_index: int) -> int:
    """Clean tail latents a channel of request `request_index`'s teacher document (request 0 has none)."""
    return 0 if request_index == 0 else TEACHER_TAIL_LATENTS


@dataclass(frozen=True)
class Example:
    """One clip as the DiT sees it."""

    caption: str
    text: torch.Tensor
    """[L, text_dim] layer hidden states of the caption."""
    video: torch.Tensor
    """[F, 24, h, w] normalised video latents."""
    audio: torch.Tensor
    """[2, A, 32] normalised audio latents (left, right)."""
    opening: bool = False
    """An opening clip: its video is trained from pure noise (sigma 1)."""


@dataclass(frozen=True)
class TeacherExample:
    """One audio teacher document as the DiT sees it."""

    caption: str
    text: torch.Tensor
    """[L, text_dim] layer hidden states of the caption."""
    request_index: int
    audio: torch.Tensor
    """[2, n_tail + A, 32] normalised audio latents (left, right): the clean tail, then the new latents."""

    @property
    def n_tail(self) -> int:
        return tail_latents(self.request_index)


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The sampler's time shift of a uniform draw: sigma = k u / (1 + (k - 1) u)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def video_positions(canvas: Canvas, origin: float, num_latents: int) -> torch.Tensor:
    """[F * rows_per_frame, 3] positions of a request-0 clip's video rows (frame-major, row-major)."""
    grid, _ = frame_grid(canvas)  # [R, 2] (h, w) of one latent frame
    times = torch.tensor([origin + float(latent_frame_offset(i) * UNITS_PER_FRAME) for i in range(num_latents)],
                         dtype=torch.float64)
    pos = torch.empty(num_latents, grid.shape[0], 3, dtype=torch.float64)
    pos[:, :, 0] = times[:, None]
    pos[:, :, 1:] = grid[None]
    return pos.reshape(-1, 3).float()


LOSS_PARTS = ("video", "audio", "teacher", "opening")


@dataclass(frozen=True)
class Document:
    """One example made ready for the DiT: its own layout (on the CPU), its noised input rows and the velocity its
    loss compares with (v = x0 - e)."""

    kind: str
    """One of "clip", "opening" or "teacher"."""
    layout: PackedLayout
    text: torch.Tensor
    """[L, text_dim]"""
    video: torch.Tensor
    """[Tv, 96] noised video rows (none in a teacher document)."""
    audio: torch.Tensor
    """[Ta, 32] audio rows, the left channel's then the right's."""
    target_video: torch.Tensor
    """[Tv, 96]"""
    target_audio: torch.Tensor
    """[n, 32] the target of the audio rows `loss_rows`."""
    loss_rows: torch.Tensor
    """[n] int64: the audio rows in the loss (every row of a clip; a teacher document's new rows)."""


def clip_document(ex: Example, device: torch.device, generator: torch.Generator | None = None) -> Document:
    """A clip at a random noise level per modality (see the module docstring). An opening clip's video is pure
    noise (sigma 1, the student's first state in a session's first phase): only the text can tell what it shows,
    and its caption decides every pixel."""
    num_latents, _, lh, lw = ex.video.shape
    canvas = Canvas(width=lw * 16, height=lh * 16)
    x0_video = patchify(ex.video.to(device))  # [Tv, 96]
    x0_audio = ex.audio.to(device).reshape(-1, ex.audio.shape[-1])  # [2A, 32], left rows then right rows
    sigma_v, sigma_a = (shifted(torch.rand((), generator=generator), k).item() for k in (VIDEO_SHIFT, AUDIO_SHIFT))
    if ex.opening:
        sigma_v = 1.0
    noise_v = torch.randn(x0_video.shape, generator=generator).to(device)
    noise_a = torch.randn(x0_audio.shape, generator=generator).to(device)
    text_len = ex.text.shape[0]
    timeline = Timeline(canvas, origin=float(text_len))
    layout = pack_layout(
        text_len=text_len, audio_len_per_channel=ex.audio.shape[1], video_rows=x0_video.shape[0],
        positions_text=timeline.text(0, text_len), positions_audio=timeline.audio(0, ex.audio.shape[1]),
        positions_video=video_positions(canvas, float(text_len), num_latents),
        video_t=1.0 - sigma_v, audio_t=1.0 - sigma_a)
    return Document("opening" if ex.opening else "clip", layout, ex.text.to(device),
                    (1 - sigma_v) * x0_video + sigma_v * noise_v, (1 - sigma_a) * x0_audio + sigma_a * noise_a,
                    x0_video - noise_v, x0_audio - noise_a, torch.arange(x0_audio.shape[0], device=device))


def teacher_layout(text_len: int, request_index: int, u: float) -> tuple[PackedLayout, float]:
    """The layout of request `request_index`'s teacher document at the uniform draw `u`, and its audio sigma.

    Positions are `Timeline.teacher`'s, as the served teacher's; the tail rows sit at t = 1, the new rows at the
    audio t = 1 - shift3(u) and the text at the video clock's t = 1 - shift12(u): at u on the teacher's 10-point
    linspace, exactly the layout of that teacher step (`stream.teacher.step_layout`)."""
    plan, n_tail = plan_request(request_index), tail_latents(request_index)
    sigma, text_sigma = shifted(u, TEACHER_SHIFT), shifted(u, VIDEO_SHIFT)
    pos_text, pos_audio = Timeline(WORLD_CANVAS, 0.0).teacher(plan, text_len, n_tail)
    t, text_t = model_t(sigma), model_t(text_sigma)
    layout = pack_layout(text_len=text_len, audio_len_per_channel=n_tail + plan.num_audio_latents, video_rows=0,
                         positions_text=pos_text, positions_audio=pos_audio, positions_video=torch.zeros(0, 3),
                         video_t=text_t, text_t=text_t,
                         audio_timesteps=([1.0] * n_tail + [t] * plan.num_audio_latents) * 2)
    return layout, sigma


def teacher_document(ex: TeacherExample, device: torch.device, generator: torch.Generator | None = None
                     ) -> Document:
    """A teacher document at a random noise level: the tail rows clean, at t = 1, and outside the loss."""
    u = torch.rand((), generator=generator).item()
    layout, sigma = teacher_layout(ex.text.shape[0], ex.request_index, u)
    x0 = ex.audio.to(device)  # [2, n_tail + A, 32]
    tail, new = x0[:, :ex.n_tail], x0[:, ex.n_tail:]
    noise = torch.randn(new.shape, generator=generator).to(device)
    rows = torch.cat([tail, (1 - sigma) * new + sigma * noise], dim=1).reshape(-1, x0.shape[-1])  # L rows, R rows
    per_channel = x0.shape[1]
    loss_rows = torch.cat([torch.arange(ex.n_tail, per_channel),  # the new rows of the left channel, then the right
                           torch.arange(per_channel + ex.n_tail, 2 * per_channel)])
    empty = torch.zeros(0, PRESETS["tiny"].video_row_dim, device=device)  # no video rows (the width is the VAE's)
    return Document("teacher", layout, ex.text.to(device), empty, rows, empty,
                    (new - noise).reshape(-1, x0.shape[-1]), loss_rows.to(device))


def document(ex: Example | TeacherExample, device: torch.device, generator: torch.Generator | None = None
             ) -> Document:
    """The document of an example of either kind."""
    if isinstance(ex, TeacherExample):
        return teacher_document(ex, device, generator)
    return clip_document(ex, device, generator)


def pack_documents(layouts: list[PackedLayout]) -> tuple[PackedLayout, list[torch.Tensor]]:
    """One layout of several documents, block by block: [every text | every audio-L | every audio-R | every video |
    pad], each block in document order. Also, per document, the packed rows of its own rows `[n_b]` in its own
    order [text | audio-L | audio-R | video], which is the order of its single layout's real rows."""
    tt, a, tv = (sum(getattr(l, f) for l in layouts) for f in ("text_len", "audio_len", "video_len"))
    seq_len = padded_rows(tt + 2 * a + tv)
    values = list(dict.fromkeys(v for l in layouts for v in l.timestep_values))
    positions, tags = torch.zeros(seq_len, 3), torch.full((seq_len,), -1, dtype=torch.long)
    slots = torch.zeros(seq_len, dtype=torch.long)  # pad rows take slot 0
    starts = [0, tt, tt + a, tt + 2 * a]  # where the next document's text, audio-L, audio-R and video rows go
    rows = []
    for l in layouts:
        lens = (l.text_len, l.audio_len, l.audio_len, l.video_len)
        own = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        starts = [s + n for s, n in zip(starts, lens)]
        remap = torch.tensor([values.index(v) for v in l.timestep_values])
        n = l.num_real
        positions[own], tags[own], slots[own] = l.positions[:n], l.tags[:n], remap[l.timestep_slot[:n]]
        rows.append(own)
    packed = PackedLayout(
        seq_len=seq_len, text_len=tt, audio_len=a, video_len=tv, text_index=torch.arange(tt),
        audio_index=torch.arange(tt, tt + 2 * a), video_index=torch.arange(tt + 2 * a, tt + 2 * a + tv),
        positions=positions, tags=tags, timestep_slot=slots, timesteps=torch.tensor(values, dtype=torch.float32),
        timestep_values=tuple(values))
    return packed, rows


class DocumentsAttention:
    """Full attention inside each of the packed documents and none across them: each document's rows attend as
    `FullAttention` has them attend in its own layout, all documents in one batched call."""

    def __init__(self, rows: list[torch.Tensor], device: torch.device):
        n = max(len(r) for r in rows)
        self.index = torch.stack([F.pad(r, (0, n - len(r))) for r in rows]).to(device)  # [B, N]; pads point at row 0
        self.valid = torch.stack([torch.arange(n) < len(r) for r in rows]).to(device)  # [B, N]
        self.mask = None if all(len(r) == n for r in rows) else self.valid[:, None, None, :]  # [B, 1, 1, N]
        self.rows = self.index[self.valid]  # every document's rows, in the order `out[self.valid]` lists them

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D] -> per document [B, H, N, D]
        qb, kb, vb = (x[self.index].transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self.mask).transpose(1, 2)  # [B, N, H, D]
        result = q.new_zeros(q.shape)  # pad rows of the packed sequence attend to nothing: their rows stay zero
        return result.index_put((self.rows,), out[self.valid])


def document_losses(model: DiT, docs: list[Document]) -> tuple[torch.Tensor, list[dict[str, float | None]]]:
    """Every document in one forward of the packed rows; the mean of their losses (each the velocity MSE of its
    video rows plus that of its audio loss rows) and, per document, its parts (`LOSS_PARTS`)."""
    device = next(model.parameters()).device
    layout, rows = pack_documents([d.layout for d in docs])
    layout = layout.to(device)
    x = torch.zeros(layout.seq_len, model.args.hidden_size, device=device)  # [S, C]
    for d, own in zip(docs, rows):  # each text through the refiner on its own
        x[own[:d.layout.text_len].to(device)] = model.token_refiner(model.condition_proj(d.text))
    halves = [d.audio.unflatten(0, (2, -1)) for d in docs]  # each [2, A_b, 32]: left, right
    audio = torch.cat([h[0] for h in halves] + [h[1] for h in halves])  # [2A, 32]: every left block, every right
    x[layout.audio_index.to(device)] = model.audio_patch_proj(audio)
    x[layout.video_index.to(device)] = model.video_patch_proj(torch.cat([d.video for d in docs]))
    x = model.run_blocks(x, layout, DocumentsAttention(rows, device), range(len(model.blocks)))
    v_video, v_audio = model.head(x, layout)  # [Tv, 96], [2A, 32] in the packed order
    per_doc, named = [], []  # named: (document, part, loss)
    video_at, left_at, right_at = 0, 0, layout.audio_len
    for i, d in enumerate(docs):
        tv, a = d.layout.video_len, d.layout.audio_len
        own_v = v_video[video_at:video_at + tv]
        own_a = torch.cat([v_audio[left_at:left_at + a], v_audio[right_at:right_at + a]])  # [2A_b, 32]: L, R
        video_at, left_at, right_at = video_at + tv, left_at + a, right_at + a
        loss = F.mse_loss(own_a.float().index_select(0, d.loss_rows), d.target_audio)
        named.append((i, "teacher" if d.kind == "teacher" else "audio", loss))
        if tv:
            loss_v = F.mse_loss(own_v.float(), d.target_video)
            named.append((i, "video" if d.kind == "clip" else "opening", loss_v))
            loss = loss + loss_v
        per_doc.append(loss)
    parts: list[dict[str, float | None]] = [dict.fromkeys(LOSS_PARTS) for _ in docs]
    values = torch.stack([loss for *_, loss in named]).detach().tolist()  # one read of every part: no sync each
    for (i, part, _), value in zip(named, values):
        parts[i][part] = value
    return torch.stack(per_doc).mean(), parts


def window_means(window: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each loss part's mean over the logged window's examples that have it (None: none of that kind)."""
    means: dict[str, float | None] = {}
    for part in LOSS_PARTS:
        values = [parts[part] for parts in window if parts[part] is not None]
        means[part] = float(np.mean(values)) if values else None
    return means
