"""What the deploy/ tests share: where the files are, and what the stages listen on and write."""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
HEALTH = {"encoder": ("vitascope.encoder.v1.Encoder", 50051), "dit": ("vitascope.dit.v1.DiT", 50052),
          "vae": ("vitascope.vae.v1.VAE", 50053)}
"""Each stage's gRPC health service name and port, as the profiles, compose files and probes name them."""
PROGRESS_FILE = "/tmp/startup.json"
"""Where each stage container keeps its start-up progress (`--progress-file`), read by its start-up probe."""
