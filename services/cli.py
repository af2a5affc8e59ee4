"""`vitascope <command> [options]`: the operator's entry point, installed as a console command.

- `vitascope up [--profile P] [--host H] [--port N]`: the whole node on one machine, supervised (`services.up`).
- `vitascope client --prompt ... [--url ...]`: stream a session and write an MP4 (`services.client`).
- `vitascope checkpoint --preset tiny --out DIR`: write a random-weight checkpoint tree (`services.checkpoints`).
- `vitascope encoder|dit|vae|gateway --profile P`: one service alone.
Each command's own `--help` lists its options. Knows nothing beyond which module serves which command.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "up": ("services.up", "bring the whole node up and keep it up"),
    "client": ("services.client", "stream one session to a file"),
    "checkpoint": ("services.checkpoints", "write a random-weight checkpoint tree"),
    "encoder": ("services.encoder.__main__", "the text encoder stage alone"),
    "dit": ("services.dit.__main__", "the DiT stage alone"),
    "vae": ("services.vae.__main__", "the VAE stage alone"),
    "gateway": ("services.gateway.__main__", "the websocket gateway alone"),
}


def usage() -> str:
    lines = ["usage: vitascope <command> [options]   (vitascope <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:11s} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one command with the rest of the arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vitascope: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"vitascope {name}", *rest]  # the stages' own parsers read sys.argv
    code = module.main(rest) if name in ("up", "client", "checkpoint") else module.main()
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
