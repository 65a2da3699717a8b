#!/usr/bin/env bash
# kind end-to-end test (`make kind-test`): the whole request path on a real cluster.
#   1. create a kind cluster; build the picker and simulator images and load them
#   2. install the InferencePool CRD and a gateway (plain Envoy from deploy/envoy, as a Deployment)
#   3. helm install charts/kvpick with simulator replicas
#   4. run deploy/kind/checks.py's checks through the gateway (the same ones `make docker-e2e`
#      runs, driven by deploy/kind/check.py): the picker's gRPC health, 400 for bad input,
#      prefix affinity and spreading from the replicas' own counters, a forged destination header
#      ignored, and a force-deleted replica pod losing its traffic
#   5. tear down (KEEP=1 keeps the cluster)
# Without docker, kind, helm or kubectl it prints "SKIPPED: ..." and exits 0.
# Environment: CLUSTER (kvpick-e2e), NAMESPACE (kvpick), GIE_VERSION (v1.0.1), KEEP,
# ENVOY_IMAGE (default: our envoy image from deploy/docker/Dockerfile.envoy, loaded into kind),
# MODEL (the served model name: set as the chart's `model` and sent by check.py),
# PYTHON (default: the project's venv, made with `make .venv/.kvpick-core`; needs grpcio).
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${CLUSTER:-kvpick-e2e}
NAMESPACE=${NAMESPACE:-kvpick}
RELEASE=${RELEASE:-kvpick}
GIE_VERSION=${GIE_VERSION:-v1.0.1}
REGISTRY=kvpick.local
TAG=e2e
ENVOY_IMAGE=${ENVOY_IMAGE:-$REGISTRY/envoy:$TAG}
LOCAL_PORT=${LOCAL_PORT:-18080}
HEALTH_PORT=${HEALTH_PORT:-19003}
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
PYTHON=${PYTHON:-.venv/bin/python}

for bin in docker kind helm kubectl; do
  if ! command -v "$bin" >/dev/null 2>&1; then
    echo "SKIPPED: the kind e2e test needs '$bin' on PATH (have: $(for b in docker kind helm kubectl; do command -v $b >/dev/null 2>&1 && printf '%s ' $b; done))"
    exit 0
  fi
done
if ! docker info >/dev/null 2>&1; then
  echo "SKIPPED: the kind e2e test needs a running Docker engine (docker info failed)"
  exit 0
fi

PF_PID=""
HF_PID=""
teardown() {
  local rc=$?
  [[ -n "$PF_PID" ]] && kill "$PF_PID" 2>/dev/null || true
  [[ -n "$HF_PID" ]] && kill "$HF_PID" 2>/dev/null || true
  if [[ $rc -ne 0 ]]; then
    echo "--- e2e failed (rc=$rc); cluster state:"
    kubectl -n "$NAMESPACE" get pods -o wide || true
    kubectl -n "$NAMESPACE" logs deploy/"$RELEASE"-picker --tail=50 || true
    kubectl -n "$NAMESPACE" logs deploy/kvpick-envoy --tail=50 || true
  fi
  if [[ "${KEEP:-0}" != 1 ]]; then kind delete cluster --name "$CLUSTER" || true; fi
  exit $rc
}
trap teardown EXIT

echo "=== 1. cluster and images"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --config deploy/kind/cluster.yaml --wait 180s
[[ "$PYTHON" != .venv/bin/python ]] || make --no-print-directory .venv/.kvpick-core
REGISTRY=$REGISTRY TAG=$TAG IMAGES="picker sim envoy" REQUIRE_DOCKER=1 bash deploy/docker/build.sh
kind load docker-image --name "$CLUSTER" "$REGISTRY/picker:$TAG" "$REGISTRY/sim:$TAG"
[[ "$ENVOY_IMAGE" != "$REGISTRY/envoy:$TAG" ]] || kind load docker-image --name "$CLUSTER" "$ENVOY_IMAGE"

echo "=== 2. InferencePool CRD ($GIE_VERSION) and the Envoy gateway"
kubectl apply -k "github.com/kubernetes-sigs/gateway-api-inference-extension/config/crd?ref=$GIE_VERSION"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -

echo "=== 3. helm install with simulator replicas"
# check.py reads the replicas' /metrics through the API server's pod proxy: the replicas'
# NetworkPolicy admits the control plane's address to the serving port, besides gateway and pickers.
CP_IP=$(kubectl get node "$CLUSTER-control-plane" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')
helm upgrade --install "$RELEASE" charts/kvpick -n "$NAMESPACE" --wait --timeout 5m \
  --set "replicaNetworkPolicy.extraFrom[0].ipBlock.cidr=$CP_IP/32" \
  --set-string model="$MODEL" \
  --set picker.image.repository=$REGISTRY/picker --set picker.image.tag=$TAG --set picker.image.pullPolicy=Never \
  --set simulator.enabled=true --set simulator.replicas=3 \
  --set simulator.image.repository=$REGISTRY/sim --set simulator.image.tag=$TAG --set simulator.image.pullPolicy=Never \
  --set picker.resources.requests.cpu=100m --set picker.resources.requests.memory=128Mi \
  --set picker.config.fallbacks=0
# fallbacks=0: the gateway below is render.py's ORIGINAL_DST Envoy, which routes on one address;
# the chart's default (2) lists fallbacks in the header, for override_host gateways only.
# The headless peers Service: its name resolves to every picker pod, so Envoy health-checks,
# ejects and retries each picker on its own (a ClusterIP name would be one host to Envoy).
"$PYTHON" deploy/kind/envoy_manifest.py --namespace "$NAMESPACE" --image "$ENVOY_IMAGE" \
  --gateway-name "$RELEASE-gateway" --client-secret "$RELEASE-gateway-client-tls" \
  --picker "$RELEASE-picker-peers.$NAMESPACE.svc.cluster.local:9002" | kubectl apply -f -
kubectl -n "$NAMESPACE" rollout status deploy/kvpick-envoy --timeout 180s
kubectl -n "$NAMESPACE" rollout status deploy/"$RELEASE"-picker --timeout 180s

echo "=== 4. requests through the gateway"
kubectl -n "$NAMESPACE" port-forward svc/kvpick-envoy "$LOCAL_PORT":8080 >/dev/null 2>&1 &
PF_PID=$!
for _ in $(seq 60); do
  curl -s -o /dev/null "http://127.0.0.1:$LOCAL_PORT/" && break
  sleep 1
done
kubectl -n "$NAMESPACE" port-forward deploy/"$RELEASE"-picker "$HEALTH_PORT":9003 >/dev/null 2>&1 &
HF_PID=$!
"$PYTHON" deploy/kind/check.py --url "http://127.0.0.1:$LOCAL_PORT" --namespace "$NAMESPACE" --model "$MODEL" \
  --health "127.0.0.1:$HEALTH_PORT"

echo "=== 5. done"
