#!/usr/bin/env bash
# kind end-to-end test (`make kind-test`): the whole request path on a real cluster.
#   1. create a kind cluster; build the picker and simulator images and load them
#   2. install the InferencePool CRD and a gateway (plain Envoy from deploy/envoy, as a Deployment)
#   3. helm install charts/kvpick with simulator replicas
#   4. send requests through the gateway: assert prefix affinity, then failover after a replica
#      pod is deleted (deploy/kind/check.py)
#   5. tear down (KEEP=1 keeps the cluster)
# Without docker, kind, helm or kubectl it prints "SKIPPED: ..." and exits 0.
# Environment: CLUSTER (kvpick-e2e), NAMESPACE (kvpick), GIE_VERSION (v1.0.1), ENVOY_IMAGE, KEEP,
# MODEL (the served model name: set as the chart's `model` and sent by check.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${CLUSTER:-kvpick-e2e}
NAMESPACE=${NAMESPACE:-kvpick}
RELEASE=${RELEASE:-kvpick}
GIE_VERSION=${GIE_VERSION:-v1.0.1}
ENVOY_IMAGE=${ENVOY_IMAGE:-envoyproxy/envoy:v1.36-latest}
REGISTRY=kvpick.local
TAG=e2e
LOCAL_PORT=${LOCAL_PORT:-18080}
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
PYTHON=${PYTHON:-python3}

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
teardown() {
  local rc=$?
  [[ -n "$PF_PID" ]] && kill "$PF_PID" 2>/dev/null || true
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
REGISTRY=$REGISTRY TAG=$TAG IMAGES="picker sim" REQUIRE_DOCKER=1 bash deploy/docker/build.sh
kind load docker-image --name "$CLUSTER" "$REGISTRY/picker:$TAG" "$REGISTRY/sim:$TAG"

echo "=== 2. InferencePool CRD ($GIE_VERSION) and the Envoy gateway"
kubectl apply -k "github.com/kubernetes-sigs/gateway-api-inference-extension/config/crd?ref=$GIE_VERSION"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -

echo "=== 3. helm install with simulator replicas"
helm upgrade --install "$RELEASE" charts/kvpick -n "$NAMESPACE" --wait --timeout 5m \
  --set-string model="$MODEL" \
  --set picker.image.repository=$REGISTRY/picker --set picker.image.tag=$TAG --set picker.image.pullPolicy=Never \
  --set simulator.enabled=true --set simulator.replicas=3 \
  --set simulator.image.repository=$REGISTRY/sim --set simulator.image.tag=$TAG --set simulator.image.pullPolicy=Never \
  --set picker.resources.requests.cpu=100m --set picker.resources.requests.memory=128Mi
"$PYTHON" deploy/kind/envoy_manifest.py --namespace "$NAMESPACE" --image "$ENVOY_IMAGE" \
  --picker "$RELEASE-picker.$NAMESPACE.svc.cluster.local:9002" | kubectl apply -f -
kubectl -n "$NAMESPACE" rollout status deploy/kvpick-envoy --timeout 180s
kubectl -n "$NAMESPACE" rollout status deploy/"$RELEASE"-picker --timeout 180s

echo "=== 4. requests through the gateway"
kubectl -n "$NAMESPACE" port-forward svc/kvpick-envoy "$LOCAL_PORT":8080 >/dev/null 2>&1 &
PF_PID=$!
for _ in $(seq 60); do
  curl -s -o /dev/null "http://127.0.0.1:$LOCAL_PORT/" && break
  sleep 1
done
"$PYTHON" deploy/kind/check.py --url "http://127.0.0.1:$LOCAL_PORT" --namespace "$NAMESPACE" --model "$MODEL"

echo "=== 5. done"
