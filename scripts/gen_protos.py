"""Regenerate the committed gRPC stubs under vitascope/ from protos/ (`python scripts/gen_protos.py`).

`--check` regenerates into a temporary folder and fails if the committed stubs differ.
"""
import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = "vitascope"


def generate(out: pathlib.Path) -> None:
    """Write _pb2, _pb2_grpc and .pyi files for every proto into out/vitascope/."""
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for folder in [out / PACKAGE, *(p for p in (out / PACKAGE).rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def differences(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    """Relative paths of generated files that differ between two trees."""
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    names |= {p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return sorted(str(n) for n in names
                  if not (a / n).exists() or not (b / n).exists() or not filecmp.cmp(a / n, b / n, shallow=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        generate(out)
        if args.check:
            stale = differences(out / PACKAGE, ROOT / PACKAGE)
            if stale:
                print("stale generated stubs (run python scripts/gen_protos.py):", *stale, sep="\n  ")
                return 1
            return 0
        shutil.rmtree(ROOT / PACKAGE, ignore_errors=True)
        shutil.copytree(out / PACKAGE, ROOT / PACKAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
