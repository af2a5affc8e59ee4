#!/usr/bin/env bash
# Build a local Python base image from Debian packages, for hosts that reach no container registry:
#   bash scripts/build_base_image.sh [TAG]        # default localhost/vitascope-python:3.11-bookworm
# then build with `--build-arg PYTHON_IMAGE=<TAG>`. It offers what deploy/Dockerfile takes from
# python:3.11-slim: `python` and `pip` on PATH (Debian's CPython 3.11, packages under /usr/local),
# groupadd/useradd, CA certificates. Skipped when the tag exists. Needs root, mmdebstrap and podman.
set -euo pipefail
tag=${1:-localhost/vitascope-python:3.11-bookworm}
if podman image exists "$tag"; then
  echo "build_base_image: $tag exists" >&2
  exit 0
fi
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
tar=$(mktemp --suffix=.tar)
trap 'rm -f "$tar"' EXIT
start=$(date +%s)
# PEP 668's marker is removed: this image is a container's only Python, as in the python:*-slim images.
mmdebstrap --quiet --variant=minbase --format=tar \
  --include=python3,python3-pip,python-is-python3,ca-certificates \
  --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  bookworm "$tar" "$mirror"
podman import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' "$tar" "$tag" >/dev/null
echo "build_base_image: $tag in $(( $(date +%s) - start )) s" >&2
