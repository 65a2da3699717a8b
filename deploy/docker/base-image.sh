#!/usr/bin/env bash
# `make base-image`: a local Python 3.11 base image for machines that reach no image registry.
#
# debootstrap builds a minimal Debian bookworm root filesystem (python3 3.11, python3-venv,
# ca-certificates) from the Debian mirror this machine's apt already uses, and `docker import`
# turns it into an image. The Dockerfiles take it as BASE_IMAGE instead of python:3.11-slim:
#   BASE_IMAGE=kvpick/base:bookworm make images
# Environment: BASE_IMAGE (kvpick/base:bookworm), MIRROR (from /etc/apt/sources.list*, else
# http://deb.debian.org/debian), SUITE (bookworm). Needs root and the `debootstrap` package.
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-kvpick/base:bookworm}
SUITE=${SUITE:-bookworm}

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "SKIPPED: make base-image needs a running Docker engine (docker CLI missing or daemon unreachable)."
  exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "make base-image needs debootstrap: apt-get install -y debootstrap" >&2
  exit 1
fi
if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "$BASE_IMAGE exists (FORCE=1 rebuilds it)"
  exit 0
fi

# The first Debian (not security) mirror in apt's sources: deb822 "URIs:" or one-line "deb URI".
mirror_from_apt() {
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | awk '/^URIs:/ {print $2} /^deb / {print ($2 ~ /^\[/ ? $3 : $2)}' \
    | grep -E '/debian/?$' | head -n1
}
MIRROR=${MIRROR:-$(mirror_from_apt || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

root=$(mktemp -d /tmp/kvpick-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap $SUITE from $MIRROR into $root"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR" >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# As Debian's slim images: no manuals, info pages, translations or docs (copyright files stay),
# now and for what a Dockerfile later installs with apt (51 MB of the minbase root).
cat >"$root/etc/dpkg/dpkg.cfg.d/kvpick-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
find "$root/usr/share/doc" -type f ! -name copyright -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
  --message "kvpick base: debootstrap --variant=minbase $SUITE (python3, python3-venv, ca-certificates)" \
  - "$BASE_IMAGE"
docker run --rm "$BASE_IMAGE" python3 -c 'import sys, venv; assert sys.version_info[:2] == (3, 11), sys.version; print("base", sys.version.split()[0])'
echo "built $BASE_IMAGE"
