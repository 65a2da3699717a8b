#!/usr/bin/env bash
# Build kvpick's images (`make images`):
#   picker   deploy/docker/Dockerfile.picker               python:3.11-slim, non-root, no torch
#   sim      deploy/docker/Dockerfile.picker EXTRAS=sim    the simulator (no torch)
#   replica  deploy/docker/Dockerfile.replica              vllm/vllm-openai + our scheduler plugin
# Environment: REGISTRY (ghcr.io/kvpick), TAG (0.1.0), IMAGES ("picker sim replica"),
# VLLM_IMAGE (vllm/vllm-openai:v0.32.0), PUSH=1 to push, REQUIRE_DOCKER=1 to fail without Docker.
set -euo pipefail
cd "$(dirname "$0")/../.."

REGISTRY=${REGISTRY:-ghcr.io/kvpick}
TAG=${TAG:-0.1.0}
IMAGES=${IMAGES:-picker sim replica}
VLLM_IMAGE=${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "SKIPPED: make images needs a running Docker engine (docker CLI missing or daemon unreachable)."
  [[ "${REQUIRE_DOCKER:-0}" == 1 ]] && exit 1
  exit 0
fi
export DOCKER_BUILDKIT=1  # for the per-Dockerfile .dockerignore files

for image in $IMAGES; do
  ref="$REGISTRY/$image:$TAG"
  case "$image" in
    picker)  docker build -f deploy/docker/Dockerfile.picker -t "$ref" . ;;
    sim)     docker build -f deploy/docker/Dockerfile.picker --build-arg EXTRAS=sim -t "$ref" . ;;
    replica) docker build -f deploy/docker/Dockerfile.replica --build-arg "VLLM_IMAGE=$VLLM_IMAGE" -t "$ref" . ;;
    *) echo "unknown image '$image' (known: picker sim replica)" >&2; exit 2 ;;
  esac
  echo "built $ref"
  if [[ "${PUSH:-0}" == 1 ]]; then docker push "$ref"; fi
done
