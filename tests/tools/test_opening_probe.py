"""The opening probe reads what a prediction draws: the true opening latents read as their own shape and colour."""
from __future__ import annotations

import pathlib

import pytest
import torch

from services.vae.checkpoint import load_video_vae
from services.vae.model import VideoDecoder
from tools.train import opening_probe, world
from tools.train.dit import Conditioner

pytestmark = pytest.mark.cpu

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL_ROOT = REPO / "models" / "tiny" / "MiniMax-H3"  # the shipped model: its trained VAEs and text encoder


@pytest.fixture(scope="module")
def cond_and_decoder():
    device = torch.device("cpu")
    cond = Conditioner(MODEL_ROOT, MODEL_ROOT, device, opening_probe.LAYOUTS["phase"].num_frames)
    return cond, VideoDecoder(load_video_vae(MODEL_ROOT, device), tile_overlap=64)


def test_the_clean_latents_of_each_opening_draw_its_own_shape_and_colour_with_no_error(cond_and_decoder):
    cond, decoder = cond_and_decoder
    clean = lambda batch, ph, noise_v, noise_a: batch.clean(ph)[0]  # noqa: E731 - a perfect predictor
    draws = opening_probe.probe(clean, cond, decoder, colours=("red", "blue"))
    assert [(d.colour, d.shape) for d in draws] == [(c, s) for c in ("red", "blue") for s in world.SHAPES]
    assert [d.drawn for d in draws] == [d.shape for d in draws]
    assert [d.drawn_colour for d in draws] == [d.colour for d in draws]
    assert max(d.mse for d in draws) == 0.0

