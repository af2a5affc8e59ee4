"""Build-time self-check of a vitascope image: `python /opt/vitascope/image_check.py gateway|stage [--fa4]`.

Imports every server module the image's commands start and the health-check client its compose and Kubernetes
probes run, so that an image whose packages do not load together (a protobuf runtime older than the stubs'
gencode, a missing wheel) fails its build instead of its first start. Knows nothing about profiles or models.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

MODULES = {
    "gateway": ("services.gateway.__main__", "services.gateway.grpc_pipeline"),
    "stage": ("services.encoder.grpc_server", "services.dit.grpc_server", "services.vae.grpc_server",
              "services.checkpoints", "services.common.healthcheck"),
}
ABSENT = {"gateway": ("torch",), "stage": ()}
"""Packages an image must not carry (the gateway image has no torch)."""


def main(argv: list[str] | None = None) -> int:
    """Import the target's modules; exit non-zero naming the first that fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=sorted(MODULES))
    parser.add_argument("--fa4", action="store_true", help="also import FlashAttention 4 (flash_attn.cute)")
    args = parser.parse_args(argv)
    modules = [*MODULES[args.target], "services.common.healthcheck"]
    if args.fa4:
        modules.append("flash_attn.cute")
    for name in dict.fromkeys(modules):
        importlib.import_module(name)
    for name in ABSENT[args.target]:
        if importlib.util.find_spec(name) is not None:
            raise SystemExit(f"image_check: the {args.target} image must not hold {name}")
    import google.protobuf

    sys.stdout.write(f"image_check: {args.target} imports {len(modules)} modules (protobuf "
                     f"{google.protobuf.__version__})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
