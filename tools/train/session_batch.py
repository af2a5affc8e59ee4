"""B streaming sessions packed in one DiT document, forward for forward as the runtime serves each alone.

The rows of every session share one packed document `[texts | audio-L | audio-R | video | pad]` (session-major
inside each block): `session_rows` says where each session's rows sit, `SessionsAttention` lets each text attend to
itself and each session's media to [its text | its history | its media], `retained` is the KV cache's retention
over the commits so far (its sink optionally `moved_back` in time), and `SessionBatch` builds the document of any
phase and step, whose `forward` runs the model on it. The student trainer (`tools.train.student`) computes its
loss over these forwards; the opening probe reads a base through them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.dit.model.fused import apply_rope
from services.dit.model.layout import PackedLayout, pack_layout, padded_rows
from services.dit.model.network import DiT
from services.dit.stream.geometry import Canvas, PhasePlan, request_latent_start
from services.dit.stream.runtime import patchify
from services.dit.stream.schedule import model_t
from services.dit.stream.timeline import Timeline


@dataclass(frozen=True)
class Session:
    """One session as the DiT sees it."""

    texts: tuple[torch.Tensor, ...]
    """Per request, [L, text_dim] layer hidden states of its prompt."""
    video: torch.Tensor
    """[72, 24, h, w] normalised video latents."""
    audio: torch.Tensor
    """[2, 405, 32] normalised audio latents (left, right)."""


@dataclass(frozen=True)
class SessionRows:
    """Where the rows of B sessions sit in one packed document `[texts | audio-L | audio-R | video | pad]`
    (session-major inside each block), as the indices `SessionsAttention` gathers and scatters them by."""

    seq_len: int
    """S: the document's rows, padding included."""
    text_index: torch.Tensor
    """[B, Lmax] int64 packed row of each session's text rows; row 0 past a text's end."""
    text_valid: torch.Tensor
    """[B, Lmax] bool, False past a text's end."""
    media_index: torch.Tensor
    """[B, M] int64 packed rows of each session's media: its audio-L, audio-R, then video rows (M = 2A + Tv)."""
    order: torch.Tensor
    """[S] int64: the row of [text outputs `[B * Lmax]` | media outputs `[B * M]` | a zero row] each packed row
    takes (the inverse of the two gathers; pad rows take the zero row)."""


def session_rows(text_lens: list[int], audio_len: int, video_len: int, device: torch.device) -> SessionRows:
    """The rows of B sessions of `text_lens` text rows, `audio_len` audio rows a channel and `video_len` video rows
    each."""
    b, a, tv = len(text_lens), audio_len, video_len
    lens = torch.tensor(text_lens)
    lmax, tt, m = max(text_lens), sum(text_lens), 2 * a + tv
    col = torch.arange(lmax)
    text_valid = col < lens[:, None]  # [B, Lmax]
    text_index = torch.where(text_valid, (lens.cumsum(0) - lens)[:, None] + col, 0)
    session = torch.arange(b)[:, None]  # [B, 1]
    media_index = torch.cat([tt + session * a + torch.arange(a),  # audio-L
                             tt + b * a + session * a + torch.arange(a),  # audio-R
                             tt + 2 * b * a + session * tv + torch.arange(tv)], dim=1)  # video -> [B, M]
    seq_len = padded_rows(tt + b * m)
    order = torch.full((seq_len,), b * (lmax + m))
    order[text_index[text_valid]] = torch.arange(b * lmax)[text_valid.flatten()]
    order[media_index.flatten()] = b * lmax + torch.arange(b * m)
    return SessionRows(seq_len, text_index.to(device), text_valid.to(device), media_index.to(device),
                       order.to(device))


class SessionsAttention:
    """The streaming pattern for B sessions packed in one document (`SessionRows`): each text attends to itself;
    each session's media rows to [its text | its history | its media rows]. With `commit`, each layer's media K/V
    `[B, M, H, D]` (rows: audio-L, audio-R, video) are kept in `committed`."""

    def __init__(self, rows: SessionRows, history: list[list[tuple[torch.Tensor, torch.Tensor]]], commit: bool):
        self.rows, self.history, self.commit = rows, history, commit  # history[layer]: [(k, v) [B, n, H, D], ...]
        self.committed: list[tuple[torch.Tensor, torch.Tensor]] = []
        valid = rows.text_valid  # [B, Lmax]
        held = sum(k.shape[1] for k, _ in history[0]) if history else 0  # n: history rows of a session
        keys = torch.cat([valid, valid.new_ones(valid.shape[0], held + rows.media_index.shape[1])], dim=1)
        self.text_mask = valid[:, None, None, :]  # [B, 1, 1, Lmax]
        self.media_mask = keys[:, None, None, :]  # [B, 1, 1, Lmax + n + M]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D]
        rows = self.rows
        if q.shape[0] != rows.seq_len:
            raise ValueError(f"SessionsAttention built for {rows.seq_len} rows got q with {q.shape[0]} rows")
        qt, kt, vt = (x[rows.text_index].transpose(1, 2) for x in (q, k, v))  # [B, H, Lmax, D]
        out_t = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=self.text_mask)  # each text over itself
        qm, km, vm = (x[rows.media_index] for x in (q, k, v))  # [B, M, H, D]
        if self.commit:
            self.committed.append((km, vm))
        hist = self.history[layer] if self.history else []
        keys = torch.cat([kt.transpose(1, 2)] + [h[0] for h in hist] + [km], dim=1)  # [B, Lmax + n + M, H, D]
        values = torch.cat([vt.transpose(1, 2)] + [h[1] for h in hist] + [vm], dim=1)
        out_m = F.scaled_dot_product_attention(qm.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=self.media_mask)  # [B, H, M, D]
        parts = [out_t.transpose(1, 2).flatten(0, 1), out_m.transpose(1, 2).flatten(0, 1),
                 q.new_zeros(1, *q.shape[1:])]  # [B * Lmax + B * M + 1, H, D]
        return torch.cat(parts)[rows.order]  # [S, H, D]


def moved_back(keys: torch.Tensor, turn: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Keys (RoPE applied) as a forward placed G_b units earlier on the time axis would have made them: each
    session's turned by the RoPE angles of positions (-G_b, 0, 0) (`SessionBatch.sink_turn`)."""
    # keys: [B, n, H, D]; cos, sin: [B, R]
    cos, sin = (c.to(keys.dtype) for c in turn)
    b, n, h, d = keys.shape
    return apply_rope(keys.reshape(b, n * h, d), cos, sin).reshape(b, n, h, d)  # [B, n * H, D] -> [B, n, H, D]


def retained(commits: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]], audio_rows: list[int],
             sink_turn: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, the history the KV cache holds after `len(commits)` commits: all of them up to 2; from 3 on,
    commit 0's video rows (the sink) and the 2 newest whole. `audio_rows[i]`: commit i's audio rows (both
    channels). With `sink_turn` (`SessionBatch.sink_turn`), the sink's keys are `moved_back` as if commit 0 had
    been made that much earlier; its values stay."""
    if not commits:
        return []
    n, layers = len(commits), len(commits[0][1])
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]
    for i, (index, per_layer) in enumerate(commits):
        if n > 2 and index == 0:
            cut = audio_rows[0]
            for layer, (k, v) in enumerate(per_layer):
                sink = k[:, cut:] if sink_turn is None else moved_back(k[:, cut:], sink_turn)
                out[layer].append((sink, v[:, cut:]))
        elif i >= n - 2:
            for layer, kv in enumerate(per_layer):
                out[layer].append(kv)
    return out


class SessionBatch:
    """B encoded sessions on one canvas; builds the packed document of any phase and step."""

    def __init__(self, sessions: list[Session], device: torch.device):
        self.sessions, self.device = sessions, device
        _, _, lh, lw = sessions[0].video.shape
        self.canvas = Canvas(width=lw * 16, height=lh * 16)
        self.timelines = [Timeline(self.canvas, origin=float(s.texts[0].shape[0])) for s in sessions]
        self.video = torch.stack([s.video for s in sessions]).to(device)  # [B, 72, 24, h, w]
        self.audio = torch.stack([s.audio for s in sessions]).to(device)  # [B, 2, 405, 32]
        self._phases: dict[tuple[int, int], tuple[dict, SessionRows]] = {}

    def refined_texts(self, model: DiT, k: int) -> torch.Tensor:
        """Request `k`'s text rows of every session, packed `[sum L_b, C]`, through the condition projection and the
        token refiner, each prompt attending to its own rows. Neither sees the phase, the step or the noise level, so
        one loss computes them once a request and all of the request's forwards share them (their gradients add up
        there)."""
        lens = torch.tensor([s.texts[k].shape[0] for s in self.sessions])
        owner = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [Tt] session of each row
        own_prompt = (owner[:, None] == owner[None, :]).to(self.device)  # [Tt, Tt]
        texts = torch.cat([s.texts[k] for s in self.sessions]).to(self.device)  # [Tt, text_dim]
        return model.token_refiner(model.condition_proj(texts), own_prompt)

    def clean(self, ph: PhasePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Clean video rows `[B, Tv, 96]` and audio rows `[B, 2A, 32]` (L rows then R rows) of phase `ph`."""
        first = request_latent_start(ph.request_index) + ph.latent_offset
        b = len(self.sessions)
        video = patchify(self.video[:, first:first + ph.num_latents].flatten(0, 1)).unflatten(0, (b, -1))
        audio = self.audio[:, :, ph.audio_start:ph.audio_start + ph.num_audio_latents].flatten(1, 2)
        return video, audio

    def phase(self, ph: PhasePlan) -> tuple[dict, SessionRows]:
        """What the packed documents of phase `ph` share whatever the step: `pack_layout`'s row counts and positions,
        and the sessions' rows; built once a phase."""
        key = (ph.request_index, ph.phase_index)
        if key not in self._phases:
            k, a = ph.request_index, ph.num_audio_latents
            lens = [s.texts[k].shape[0] for s in self.sessions]
            aud = [tl.audio(ph.audio_start, a) for tl in self.timelines]  # each [2A, 3]: L then R
            pos_v = torch.cat([tl.video(ph) for tl in self.timelines])
            document = dict(text_len=sum(lens), audio_len_per_channel=len(lens) * a, video_rows=pos_v.shape[0],
                            positions_text=torch.cat([tl.text(k, n) for tl, n in zip(self.timelines, lens)]),
                            positions_audio=torch.cat([p[:a] for p in aud] + [p[a:] for p in aud]),
                            positions_video=pos_v)
            self._phases[key] = document, session_rows(lens, a, pos_v.shape[0] // len(lens), self.device)
        return self._phases[key]

    def sink_turn(self, model: DiT, gaps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE (cos, sin) `[B, R]` that moves each session's sink back by its gap `gaps[b]` time units
        (`retained`): `model.rope` of positions (-gap, 0, 0)."""
        # gaps: [B]
        positions = torch.zeros(gaps.shape[0], 3, device=self.device)  # [B, 3]: t, h, w
        positions[:, 0] = -gaps.to(self.device)
        return model.rope(positions)

    def layout(self, ph: PhasePlan, sigma_v: float, sigma_a: float) -> tuple[PackedLayout, SessionRows]:
        """The packed layout of phase `ph` for every session at (sigma_v, sigma_a), text at the video's t, and the
        sessions' rows in it."""
        document, rows = self.phase(ph)
        layout = pack_layout(**document, video_t=model_t(sigma_v), audio_t=model_t(sigma_a))
        return layout.to(self.device), rows


def forward(model: DiT, batch: SessionBatch, ph: PhasePlan, video: torch.Tensor, audio: torch.Tensor,
            sigma_v: float, sigma_a: float, history, commit: bool, texts: torch.Tensor):
    """One student (or commit) forward of phase `ph` for the batch: video velocity `[B, Tv, 96]` (None for a
    commit) and the attention (its `committed` K/V after a commit). `texts`: the request's refined texts, packed
    `[sum L_b, C]` (`SessionBatch.refined_texts`)."""
    # video: [B, Tv, 96], audio: [B, 2A, 32] (L rows then R rows per session)
    layout, rows = batch.layout(ph, sigma_v, sigma_a)
    b, tv, a = video.shape[0], video.shape[1], ph.num_audio_latents
    rows_a = model.audio_patch_proj(torch.cat([audio[:, :a].flatten(0, 1), audio[:, a:].flatten(0, 1)]))
    rows_v = model.video_patch_proj(video.flatten(0, 1))
    pad = layout.seq_len - layout.num_real
    x = torch.cat([texts, rows_a, rows_v, rows_v.new_zeros(pad, rows_v.shape[1])])  # [S, C]
    attention = SessionsAttention(rows, history, commit)
    x = model.run_blocks(x, layout, attention, range(len(model.blocks)))
    if commit:
        return None, attention
    v_video, _ = model.head(x, layout)
    return v_video.unflatten(0, (b, tv)), attention
