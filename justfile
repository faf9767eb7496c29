# tollgate task runner. On a fresh machine use ./dev <recipe>, which installs the tools first.

set shell := ["bash", "-euo", "pipefail", "-c"]

wasm := "target/wasm32-wasip1/release/tollgate.wasm"

# List recipes.
default:
    @just --list

# Build the filter (.wasm, release profile: lto, opt-level s, panic=abort, strip).
build-wasm:
    cargo build --release --target wasm32-wasip1 -p tollgate
    @ls -l {{wasm}} | awk '{print "built {{wasm}}: " $5 " bytes"}'

# Run the demo: Envoy (4 workers) + tollgate filter + demo upstream, until Ctrl-C.
demo: build-wasm
    @echo "tollgate demo on http://127.0.0.1:10000 (admin http://127.0.0.1:9901). Try:"
    @echo "  for i in \$(seq 6); do curl -s -o /dev/null -w '%{http_code}\n' -X POST -H 'host: api.example.com' -H 'x-tenant-id: acme' localhost:10000/payments/transfers; done"
    @echo "  curl -si -X POST -H 'host: api.example.com' -H 'x-tenant-id: acme' localhost:10000/payments/transfers"
    @echo "  curl -s localhost:9901/stats/prometheus | grep ^tollgate_"
    envoy -c envoy/local.yaml --concurrency 4 --disable-hot-restart -l warn

# Formatting and lints (native and wasm32; unwrap/expect/panic denied outside tests).
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings
    cargo clippy -p tollgate -p tollgate-core --target wasm32-wasip1 -- -D warnings

# Every test: lint, unit + property + end-to-end (real Envoy, real Redis), core on wasm32.
test: lint build-wasm
    cargo test --workspace
    cargo test -p tollgate-core --target wasm32-wasip1

# Outputs target/oci/tollgate/ (OCI layout), target/oci/tollgate.tar (oci-archive) and
# target/oci/tollgate.digest (what WasmPlugin.sha256 pins). Push with
#   skopeo copy --preserve-digests oci-archive:target/oci/tollgate.tar docker://<repo>:<tag>

# Build the filter as a Wasm OCI image (Istio compat variant), without Docker; reproducible.
oci: build-wasm
    tools/oci-build --wasm {{wasm}} --out target/oci

# Regenerate deploy/k8s/base/policies-configmap.yaml from policies/ (after editing a policy).
k8s-policies:
    tools/render-k8s-policies

# Renders target/istio/wasmplugin.yaml from envoy/istio/wasmplugin.yaml.tmpl with the digest
# of the image `just oci` has just built and the policy document as pluginConfig. Apply with
#   kubectl apply -f target/istio/wasmplugin.yaml -f envoy/istio/stats-bootstrap.yaml \
#     -f envoy/istio/limiter-destinationrule.yaml
# Arguments are positional: just istio policies/payments-global.json registry.internal/tollgate
# (global limiting, with the limiter of deploy/k8s).

# Render the Istio WasmPlugin pinned to the freshly built image (target/istio/wasmplugin.yaml).
istio policy="policies/payments.json" repo="registry.example.com/platform/tollgate" limiter_cluster="outbound|8081||tollgate-limiter.tollgate.svc.cluster.local": oci
    tools/render-istio --wasm {{wasm}} --layout target/oci/tollgate --repo '{{repo}}' --policy '{{policy}}' --limiter-cluster '{{limiter_cluster}}' --out target/istio/wasmplugin.yaml

# Regenerate dashboards/tollgate.json (Grafana) from tools/gen-dashboard.
dashboard:
    tools/gen-dashboard
