# tollgate task runner. On a fresh machine use ./dev <recipe>, which installs the tools first.

set shell := ["bash", "-euo", "pipefail", "-c"]

wasm := "target/wasm32-wasip1/wasm/tollgate.wasm"

# List recipes.
default:
    @just --list

# Build the filter (.wasm, profile `wasm`: lto, opt-level 3, panic=abort, strip).
build-wasm:
    cargo build --profile wasm --target wasm32-wasip1 -p tollgate
    @ls -l {{wasm}} | awk '{print "built {{wasm}}: " $5 " bytes"}'

# Build the native filter: target/native/libtollgate_native.so, an Envoy dynamic module
# (profile `native`: lto, unwinding panics, caught at every hook).
build-native:
    cargo build --profile native -p tollgate-native
    @ls -l target/native/libtollgate_native.so | awk '{print "built target/native/libtollgate_native.so: " $5 " bytes"}'

# Envoy + tollgate (global policy) + limiter (store=memory|redis) + demo upstream, until Ctrl-C.
# The demo runs envoy/global.yaml with policies/demo.json: numbers a person can follow (burst
# 20, a transfer costs 5, refilled at 10 units a minute).
up store="memory": build-wasm build-limiter
    #!/usr/bin/env bash
    set -euo pipefail
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT INT TERM
    redis_args=()
    if [ "{{store}}" = "redis" ]; then
      redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --daemonize no > target/demo-redis.log 2>&1 &
      pids+=($!)
      for _ in $(seq 50); do redis-cli -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
      redis_args=(--redis redis://127.0.0.1:6379)
    elif [ "{{store}}" != "memory" ]; then
      echo "store must be memory or redis" >&2; exit 2
    fi
    tools/render-demo-config policies/demo.json target/demo/envoy.yaml
    target/debug/tollgate-limiter --policies policies/demo.json "${redis_args[@]}" > target/demo-limiter.log 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do curl -sf localhost:8081/healthz >/dev/null 2>&1 && break; sleep 0.1; done
    echo "tollgate demo ({{store}} store): Envoy on http://127.0.0.1:10000, admin :9901, limiter :8081 (/metrics). Try:"
    echo "  for i in \$(seq 6); do curl -s -o /dev/null -w '%{http_code} ' -X POST -H 'host: api.example.com' -H 'x-tenant-id: acme' localhost:10000/payments/transfers; done; echo"
    echo "  curl -si -X POST -H 'host: api.example.com' -H 'x-tenant-id: acme' localhost:10000/payments/transfers"
    echo "  curl -s localhost:9901/stats/prometheus | grep ^tollgate_ ; curl -s localhost:8081/metrics | grep ^tollgate_"
    echo "Logs: target/demo-limiter.log. Ctrl-C stops everything."
    envoy -c target/demo/envoy.yaml --concurrency 4 --disable-hot-restart -l warn

# The demo (same as `up`): store=memory or store=redis.
demo store="memory": (up store)

# Local limiting only (no limiter): Envoy + tollgate with policies/payments.json.
demo-local: build-wasm
    @echo "tollgate (local policies) on http://127.0.0.1:10000 (admin :9901). Try:"
    @echo "  curl -si -X POST -H 'host: api.example.com' -H 'x-tenant-id: acme' localhost:10000/payments/transfers"
    envoy -c envoy/local.yaml --concurrency 4 --disable-hot-restart -l warn

# An LLM gateway: tokens reserved from `max_tokens`, settled from `usage.total_tokens` (policies/llm.json).
demo-llm: build-wasm
    @echo "tollgate (LLM tokens per tenant) on http://127.0.0.1:10000 (admin :9901). Try:"
    @echo "  curl -si -H 'x-tenant-id: acme' -H 'content-type: application/json' -d '{\"max_tokens\":300}' localhost:10000/v1/chat/completions"
    envoy -c envoy/llm.yaml --concurrency 4 --disable-hot-restart -l warn

# Build the limiter service (debug profile: builds fast, plenty for a demo).
build-limiter:
    cargo build -p tollgate-limiter

# Build the limiter for production (profile `server`: opt-level 3, thin LTO, unwinding panics).
build-limiter-server:
    cargo build --profile server -p tollgate-limiter
    @echo "built target/server/tollgate-limiter"

# Validate policy documents as the filter and the limiter do (exit 1 with every error).
check-policies *files="policies/*.json": build-limiter
    target/debug/tollgate-limiter check-policies {{files}}

# Formatting and lints (native and wasm32; unwrap/expect/panic denied outside tests), and the
# dependency policy (deny.toml: licenses, bans, sources).
lint: deny
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --features tollgate-e2e/e2e,tollgate-limiter/e2e,tollgate-bench/micro -- -D warnings
    cargo clippy -p tollgate -p tollgate-engine -p tollgate-core --target wasm32-wasip1 -- -D warnings

# Licenses, banned or duplicate crates, and sources of every dependency (deny.toml).
deny:
    cargo-deny --workspace check --hide-inclusion-graph licenses bans sources

# RustSec advisories against the dependency graph (fetches the advisory database from GitHub).
deny-advisories:
    cargo-deny --workspace check advisories

# Every test: lint, unit + property + end-to-end (real Envoy, real Redis), core on wasm32.
# (A plain `cargo test` runs the unit and property tests only.)
test: lint docs build-wasm build-native
    # The limiter as the demo (`just up`) and the end-to-end tests build it. The test build below
    # shares its dependencies (the limiter's and the harness's dev-dependencies add no features
    # to them) and compiles again only the limiter itself and the regex crates proptest widens.
    cargo build -p tollgate-limiter
    # Every suite runs even when an earlier one fails; the recipe fails at the end if any did.
    # The end-to-end tier (real Envoy, Redis, limiter) is behind the e2e features.
    status=0; cargo test --workspace --no-fail-fast --features tollgate-e2e/e2e,tollgate-limiter/e2e || status=1; cargo test -p tollgate-core --target wasm32-wasip1 || status=1; exit $status

# Build the book (docs/, mdBook) into target/book/ and check the links of the documentation:
# every relative link and #anchor of README.md, CONTRIBUTING.md, CHANGELOG.md and docs/src.
docs:
    mdbook build docs
    tools/check-links

# Outputs target/oci/tollgate/ (OCI layout), target/oci/tollgate.tar (oci-archive) and
# target/oci/tollgate.digest (what WasmPlugin.sha256 pins). Push with
#   skopeo copy --preserve-digests oci-archive:target/oci/tollgate.tar docker://<repo>:<tag>

# Build the filter as a Wasm OCI image (Istio compat variant), without Docker; reproducible.
oci: build-wasm
    tools/oci-build --wasm {{wasm}} --out target/oci

# Outputs target/oci/tollgate-limiter/ (OCI layout), target/oci/tollgate-limiter.tar and
# target/oci/tollgate-limiter.digest (what deploy/k8s pins). Push with
#   skopeo copy --preserve-digests oci-archive:target/oci/tollgate-limiter.tar docker://<repo>:<tag>

# Build the limiter's container image without Docker (static musl binary, non-root, no shell); reproducible.
oci-limiter:
    tools/oci-build-limiter --out target/oci

# The image's digest changes with every change to the limiter's code or dependencies: a
# release builds it, pushes it and re-pins (commit the result); CI checks the mechanism, not
# that every commit is pinned. k8s-render leaves the repository alone.

# Pin deploy/k8s/base/deployment.yaml to the image `just oci-limiter` builds.
k8s-pin: oci-limiter
    tools/k8s-pin

# Exit 1 unless deploy/k8s pins the image this tree builds (a release gate).
k8s-pin-check: oci-limiter
    tools/k8s-pin --check

# Render target/k8s/: deploy/k8s pinned to the freshly built image (apply -k target/k8s/base).
k8s-render repo="registry.example.com/platform/tollgate-limiter": oci-limiter
    tools/k8s-pin --out target/k8s --repo '{{repo}}'

# Regenerate deploy/k8s/base/policies-configmap.yaml from policies/ (after editing a policy).
k8s-policies:
    tools/render-k8s-policies

# Renders target/istio/wasmplugin.yaml from envoy/istio/wasmplugin.yaml.tmpl with the digest
# of the image `just oci` has just built and the policy document as pluginConfig. Apply with
#   kubectl apply -f target/istio/wasmplugin.yaml -f envoy/istio/stats-bootstrap.yaml \
#     -f envoy/istio/limiter-destinationrule.yaml -f envoy/istio/limiter-peerauthentication.yaml \
#     -f envoy/istio/limiter-authorizationpolicy.yaml
# Arguments are positional: just istio policies/payments-global.json registry.internal/tollgate
# (global limiting, with the limiter of deploy/k8s).

# Render the Istio WasmPlugin pinned to the freshly built image (target/istio/wasmplugin.yaml).
istio policy="policies/payments.json" repo="registry.example.com/platform/tollgate" limiter_cluster="outbound|8081||tollgate-limiter.tollgate.svc.cluster.local": oci
    tools/render-istio --wasm {{wasm}} --layout target/oci/tollgate --repo '{{repo}}' --policy '{{policy}}' --limiter-cluster '{{limiter_cluster}}' --out target/istio/wasmplugin.yaml

# Regenerate dashboards/tollgate.json (Grafana) from tools/gen-dashboard.
dashboard:
    tools/gen-dashboard

# Per store it also runs h2c next to HTTP/2 over mutual TLS (client certificate) in alternating
# rounds and prints the ratio. More flags go to the bench: `just bench-limiter 5 --only memory`.
# Limiter leases/s, p50/p99 over HTTP on Redis, a 3x1 cluster and memory, next to redis-benchmark.
bench-limiter seconds="5" *args:
    cargo bench --profile server -p tollgate-limiter --bench leases -- --seconds {{seconds}} {{args}}

# tollgate vs Envoy's own limiters and a per-request global check, side by side: interleaved
# rounds, ratios, Redis calls, peak RSS; writes bench/results/latest.{md,json}. Needs wrk.
# Flags go to the driver, e.g. `just bench --rounds 5 --seconds 10` (see bench/src/main.rs).
bench *args: build-wasm build-native build-limiter-server
    cargo build --profile server -p tollgate-bench
    TOLLGATE_LIMITER_BIN=target/server/tollgate-limiter target/server/tollgate-bench {{args}}

# Draw bench/results/ratios.svg and overload.svg again from stored results, measuring nothing:
# each chart from the first file that has its data (`just bench` also writes them).
bench-charts *files="bench/results/latest.json bench/results/overload.json":
    cargo run -q -p tollgate-bench -- chart {{files}}

# Criterion microbenchmarks of the core and the filter's decision path (ns per operation).
# Also writes bench/results/micro.{md,json}; args go to criterion (e.g. a name filter).
bench-micro *args:
    cargo bench --profile server -p tollgate-bench --features micro --bench core -- {{args}}
    cargo build --profile server -p tollgate-bench
    target/server/tollgate-bench micro-summary
