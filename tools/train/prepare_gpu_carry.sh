#!/usr/bin/env bash
# What a training call carries to the GPU machine, written into out/gpu (ignored; name it in the call's carry):
#   out/gpu/enc/  the tiny tree's text_encoder/ and tokenizer/ (the captions' encoder, the one the tiny preset ships)
#   out/gpu/whl/  the diffusers wheel the VAEs need (the device image has none), the version pyproject.toml pins
# Run from the repository root after `bash scripts/bootstrap.sh`; writes checkpoints/tiny first if it is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
py=.venv/bin/python
[ -f checkpoints/tiny/COMPLETE ] || "$py" -m services.checkpoints --preset tiny --out checkpoints/tiny
pin=$(grep -o '"diffusers==[^"]*"' pyproject.toml | tr -d '"')
[ -n "$pin" ] || { echo "no diffusers pin in pyproject.toml" >&2; exit 1; }
rm -rf out/gpu/enc out/gpu/whl
mkdir -p out/gpu/enc out/gpu/whl
cp -r checkpoints/tiny/MiniMax-H3/text_encoder checkpoints/tiny/MiniMax-H3/tokenizer out/gpu/enc/
"$py" -m pip download -q --no-deps --only-binary=:all: -d out/gpu/whl "$pin"
du -sh out/gpu/enc out/gpu/whl/*
