"""Resumable training state: the model, its EMA, the optimizer, the step and every RNG, in one file per run; and
`StepClock`, where a logged step's time went.

Knows nothing about what is trained. `save` writes `<dir>/state.pt` atomically (a temporary file renamed over the
old one, so a run killed mid-write leaves the previous state intact); `load` restores it, RNGs included (the global
ones and the trainer's own generators, by name), so a run that resumes draws the same noise a run that never
stopped would have drawn. The data a step sees is a function of the step alone (the trainers index their datasets
by sample number), so the step is all the data state there is.
"""
from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
STOP_FILE = "stop"


def stop_requested(directory: Path) -> bool:
    """True when a file `stop` has appeared in the state directory `directory`, which it then removes: a caller
    that must end a run by a deadline of its own asks the trainer to save (and export) at its next step, as if its
    minutes were up. Removed, so the run resumed from that state trains on."""
    path = directory / STOP_FILE
    if not path.exists():
        return False
    path.unlink(missing_ok=True)
    log.info("%s asked the run to end now", path)
    return True


def run_over(directory: Path, elapsed: float, minutes: float, step: int, max_steps: int | None) -> bool:
    """Whether a run whose state lives in `directory` ends after this step: its `minutes` of training in this
    process are up, it reached `max_steps`, or its caller asked it to stop (`stop_requested`)."""
    return (stop_requested(directory) or elapsed >= 60 * minutes
            or (max_steps is not None and step >= max_steps))


class EMA:
    """Exponential moving average of a model's floating-point parameters and buffers (what gets exported)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay={decay}: must lie in [0, 1)")
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Move the average towards `model`; early steps use a shorter horizon (decay ramps up with the step)."""
        decay = min(self.decay, (1.0 + step) / (10.0 + step))
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].lerp_(v.detach().float(), 1.0 - decay)

    def copy_to(self, model: nn.Module) -> None:
        """Load the averaged weights into `model` (its non-float entries are kept)."""
        state = model.state_dict()
        state.update({k: v.to(state[k].dtype) for k, v in self.shadow.items()})
        model.load_state_dict(state)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainState:
    """What a run resumes from."""

    model: nn.Module
    ema: EMA
    optimizer: torch.optim.Optimizer
    step: int = 0
    """Optimizer steps taken so far, over all runs."""
    seconds: float = 0.0
    """Training wall-clock seconds so far, over all runs."""
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    """The trainer's own generators (beside the global RNGs), saved and restored by name."""

    def save(self, directory: Path, meta: dict) -> Path:
        """Write the state (and `meta`, e.g. the dims and the run's arguments) to `directory/state.pt`."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / STATE_FILE
        tmp = directory / (STATE_FILE + ".tmp")
        torch.save({"model": self.model.state_dict(), "ema": self.ema.shadow, "optimizer": self.optimizer.state_dict(),
                    "step": self.step, "seconds": self.seconds, "rng": rng_state(),
                    "generators": {name: g.get_state() for name, g in self.generators.items()}, "meta": meta}, tmp)
        os.replace(tmp, path)
        log.info("saved step %d to %s", self.step, path)
        return path

    def load(self, directory: Path, expect: dict, before: dict | None = None) -> dict | None:
        """Restore from `directory/state.pt` if it exists; return its meta (None when there is nothing to resume).

        Raises ValueError, before touching the model, when the saved meta disagrees with `expect` on any key
        (another model or other dims, or another recipe, were trained there). `before`: the value a key had in
        states saved before the trainer recorded it."""
        path = directory / STATE_FILE
        if not path.is_file():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=False)
        meta = {**(before or {}), **saved["meta"]}
        wrong = {k: meta.get(k) for k, v in expect.items() if meta.get(k) != v}
        if wrong:
            raise ValueError(f"{path} holds a run with {wrong}, not {expect}; use another state directory")
        self.model.load_state_dict(saved["model"])
        device = next(self.model.parameters()).device
        self.ema.shadow = {k: v.to(device) for k, v in saved["ema"].items()}
        self.optimizer.load_state_dict(saved["optimizer"])
        self.step, self.seconds = saved["step"], saved["seconds"]
        set_rng_state(saved["rng"])
        kept = saved.get("generators", {})
        for name, generator in self.generators.items():
            if name in kept:
                generator.set_state(kept[name])
            else:  # a state saved before the trainer's generators were kept
                log.warning("%s holds no state of the generator %r: it goes on from its seed", path, name)
        log.info("resumed step %d (%.0f s trained) from %s", self.step, self.seconds, path)
        return saved["meta"]


class StepClock:
    """Wall seconds of each part of one step, the device drained at every mark (so each part holds its own GPU
    work); a clock made with `on=False` does nothing, so only the logged steps pay for the syncs."""

    def __init__(self, device: torch.device, on: bool):
        self.device, self.on, self.parts = device, on, {}
        self.last = time.monotonic()

    def mark(self, part: str) -> None:
        if not self.on:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.monotonic()
        self.parts[part] = round(now - self.last, 3)
        self.last = now
