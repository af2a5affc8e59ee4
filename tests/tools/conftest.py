"""Fixtures the student trainer's test files share."""
from __future__ import annotations

import pytest
import torch

from services.dit.model.network import PRESETS, build_random
from tools.train import student


@pytest.fixture(scope="module")
def trainer_inputs(tmp_path_factory):
    """What `student.train` starts from: a random base DiT in the shipped layout, and the conditioner over random
    tiny VAEs and text encoder."""
    from services.dit.model.checkpoint import write_trained_checkpoint
    from services.encoder.checkpoint import write_random_checkpoint as write_encoder
    from services.vae.checkpoint import write_random_checkpoint as write_vaes
    from tools.train.dit import Conditioner

    root = tmp_path_factory.mktemp("minimax")
    write_encoder("tiny", root)
    write_vaes("tiny", root)
    base_dir = write_trained_checkpoint(PRESETS["tiny"], build_random(PRESETS["tiny"], "cpu", torch.float32, 3)
                                        .state_dict(), tmp_path_factory.mktemp("base"))
    return base_dir, Conditioner(root, root, torch.device("cpu"), student.SESSION_FRAMES, cache=True)
