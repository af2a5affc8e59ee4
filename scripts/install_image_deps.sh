#!/usr/bin/env bash
# Install what the image tier (tests/images) drives, from Debian's packages: podman (with buildah's builder,
# netavark, fuse-overlayfs, slirp4netns, uidmap), mmdebstrap for a local base image, docker-compose (run against
# podman's Docker-compatible socket) and iproute2 for the test's network namespace. Once; skipped when present.
# Exit status 0 when everything is there afterwards, 1 when something is missing (not root, no apt-get).
set -euo pipefail
need=(podman:podman buildah:buildah mmdebstrap:mmdebstrap docker-compose:docker-compose ip:iproute2
      fuse-overlayfs:fuse-overlayfs slirp4netns:slirp4netns newuidmap:uidmap)
missing=()
for pair in "${need[@]}"; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_image_deps: missing ${missing[*]} and cannot install them (needs root and apt-get)" >&2
  exit 1
fi
echo "install_image_deps: installing ${missing[*]}" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
