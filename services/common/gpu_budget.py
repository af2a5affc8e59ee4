"""GPU memory budgets of a deployment profile: what each stage may use on each GPU of the node.

Each stage section declares its share (`encoder.memory_gib`, `dit.memory_gib` per rank, `vae.memory_gib` and
`vae.tile_memory_gib` per tile device). A stage checks at start-up, before it loads anything, that the shares of
every stage placed on its GPUs fit in those GPUs (`check_fits`). A node whose GPUs are too small then fails at
once, with the numbers, instead of running out of memory minutes into loading or in the middle of a session.
The shares are not enforced while serving. Torch is imported only inside `check_fits`: the gateway imports
`grpc_server`, which imports this module, and the gateway runs without torch.
"""
from __future__ import annotations

from collections.abc import Mapping

from services.common.config import Profile

GIB = 1 << 30


def placements(profile: Profile) -> list[tuple[str, str, str, float]]:
    """(stage, part, device, GiB) of every place a stage of `profile` runs: the encoder, each DiT rank, the VAE and
    each device it shares tiles with."""
    enc, dit, vae = profile.encoder, profile.dit, profile.vae
    return ([("encoder", "encoder", enc.device, enc.memory_gib)]
            + [("dit", f"dit rank {r}", d, dit.memory_gib) for r, d in enumerate(dit.devices)]
            + [("vae", "vae", vae.device, vae.memory_gib)]
            + [("vae", "vae tiles", d, vae.tile_memory_gib) for d in vae.tile_devices])


def budgets(profile: Profile) -> dict[str, dict[str, float]]:
    """CUDA device -> {stage part: GiB} for every declared (non-zero) share of `profile`."""
    out: dict[str, dict[str, float]] = {}
    for _, part, device, gib in placements(profile):
        if gib and device.startswith("cuda"):
            out.setdefault(_canonical(device), {})[part] = gib
    return out


def stage_devices(profile: Profile, stage: str) -> list[str]:
    """The devices `stage` ("encoder", "dit" or "vae") runs on."""
    return [device for name, _, device, _ in placements(profile) if name == stage]


def fit_error(profile: Profile, stage: str, sizes_gib: Mapping[str, float]) -> str:
    """Why `stage`'s GPUs cannot hold the shares placed on them ("" when they can).

    `sizes_gib`: the total memory of every GPU this process sees, by canonical name ("cuda:0": 139.8)."""
    shares = budgets(profile)
    missing, small = [], []
    for device in dict.fromkeys(_canonical(d) for d in stage_devices(profile, stage) if d.startswith("cuda")):
        if device not in sizes_gib:
            missing.append(device)
            continue
        placed = shares.get(device, {})
        need = sum(placed.values())
        if need > sizes_gib[device]:
            split = " + ".join(f"{part} {gib:g}" for part, gib in placed.items())
            small.append(f"{device} has {sizes_gib[device]:.1f} GiB, but the profile places {need:g} GiB on it "
                         f"({split})")
    problems, advice = [], []
    if missing:
        seen = f" ({', '.join(sizes_gib)})" if sizes_gib else ""
        problems.append(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} named in the profile, but "
                        f"this process sees {len(sizes_gib)} GPU(s){seen}")
        advice.append("Make every GPU the profile names visible to this process (CUDA_VISIBLE_DEVICES, the "
                      "container's GPUs).")
    if small:
        problems += small
        advice.append("Run it on GPUs with at least that much memory, or pick a profile made for these GPUs.")
    if not problems:
        return ""
    return (f"profile {profile.name} does not fit this node's GPUs for the {stage} stage: "
            + "; ".join(problems) + ". " + " ".join(advice))


def check_fits(profile: Profile, stage: str) -> None:
    """Raise ValueError (`fit_error`) when `stage`'s GPUs, as this process sees them, cannot hold their shares."""
    if not any(d.startswith("cuda") for d in stage_devices(profile, stage)):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sizes = {f"cuda:{i}": torch.cuda.get_device_properties(i).total_memory / GIB for i in range(count)}
    if why := fit_error(profile, stage, sizes):
        raise ValueError(why)


def _canonical(device: str) -> str:
    """"cuda" -> "cuda:0"; other names unchanged."""
    return "cuda:0" if device == "cuda" else device
