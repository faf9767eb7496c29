//! The Envoy configs and policy documents of every scenario, derived from the shipped
//! `envoy/local.yaml`, `envoy/global.yaml` and `envoy/global-mtls.yaml` (made test-ready by
//! [`tollgate_e2e::tollgate::envoy_config`]), so the benchmark measures what we ship: the same
//! V8 runtime, `failure_policy`, limiter cluster, TLS and stats settings.
//!
//! Four edits are applied to the shipped text, each checked to apply exactly once: answer on
//! the ingress route with a `direct_response` instead of the upstream, drop the wasm filter
//! (the ceiling), put Envoy's native `local_ratelimit` filter in its place, or add the
//! response header a settling policy reads its actual cost from (`x-usage-units`) to the
//! ingress route's answers. The mutual-TLS
//! config's `/etc/tollgate/...` paths and its SDS files are pointed at certificates made for
//! the run by [`tollgate_e2e::mtls::MtlsSetup`], as in the end-to-end tests.
//!
//! Scenario 8 runs the shipped `envoy/ratelimit-service.yaml` instead (Envoy's own
//! `envoy.filters.http.ratelimit` filter calling the limiter's RateLimitService over h2c, no
//! Wasm; [`ratelimit_service`]) with a ratelimit configuration of its own ([`rls_limits`]).

/// The tollgate filter's first line in the shipped configs' ingress filter chain.
const WASM_FILTER: &str = "          - name: envoy.filters.http.wasm\n";
/// The router, which follows the wasm filter.
const ROUTER: &str = "          - name: envoy.filters.http.router\n";
/// The ingress route to the upstream.
const UPSTREAM_ROUTE: &str = "                route: { cluster: demo_upstream }\n";

/// Envoy's own local rate limit filter: one token bucket per Envoy process, big enough that it
/// never denies (`max_tokens` is a uint32), enabled and enforced for every request.
const NATIVE_LOCAL_RATELIMIT: &str = r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: http_local_rate_limiter
              token_bucket:
                max_tokens: 4000000000
                tokens_per_fill: 4000000000
                fill_interval: 1s
              filter_enabled:
                runtime_key: local_rate_limit_enabled
                default_value: { numerator: 100, denominator: HUNDRED }
              filter_enforced:
                runtime_key: local_rate_limit_enforced
                default_value: { numerator: 100, denominator: HUNDRED }
"#;

/// The ingress route's fixed 200, answered by Envoy itself (see [`direct_response`]).
const DIRECT_RESPONSE: &str =
    "                direct_response: { status: 200, body: { inline_string: \"ok\" } }\n";

/// Replaces the ingress route to the upstream with a fixed 200 answered by Envoy itself.
pub fn direct_response(yaml: &str) -> Result<String, String> {
    replace_once(yaml, UPSTREAM_ROUTE, DIRECT_RESPONSE)
}

/// Adds `name: value` to every answer of the ingress route (the upstream's or the
/// `direct_response`, whichever the config has): the route's `response_headers_to_add`, which
/// Envoy applies before the response goes back through the filter chain, so the tollgate
/// filter reads it in its response headers as it would an upstream's.
pub fn with_response_header(yaml: &str, name: &str, value: &str) -> Result<String, String> {
    let route = match (
        yaml.matches(UPSTREAM_ROUTE).count(),
        yaml.matches(DIRECT_RESPONSE).count(),
    ) {
        (1, 0) => UPSTREAM_ROUTE,
        (0, 1) => DIRECT_RESPONSE,
        (u, d) => {
            let found = format!("found {u} and {d}");
            return Err(format!(
                "expected one ingress route (to the upstream or a direct_response), {found}"
            ));
        }
    };
    let header = format!(
        "                response_headers_to_add: [{{ header: {{ key: {name}, value: \"{value}\" }} }}]\n"
    );
    replace_once(yaml, route, &format!("{route}{header}"))
}

/// Removes the tollgate filter from the ingress filter chain.
pub fn without_wasm(yaml: &str) -> Result<String, String> {
    replace_wasm_filter(yaml, "")
}

/// Puts Envoy's `local_ratelimit` filter where the tollgate filter was.
pub fn with_native_local_ratelimit(yaml: &str) -> Result<String, String> {
    replace_wasm_filter(yaml, NATIVE_LOCAL_RATELIMIT)
}

fn replace_wasm_filter(yaml: &str, with: &str) -> Result<String, String> {
    if yaml.matches(WASM_FILTER).count() != 1 {
        return Err("expected exactly one tollgate wasm filter in the config".into());
    }
    let start = yaml.find(WASM_FILTER).ok_or("no wasm filter")?;
    let rest = yaml.get(start..).ok_or("bad offset")?;
    let end = start + rest.find(ROUTER).ok_or("no router after the wasm filter")?;
    let (head, _) = yaml.split_at(start);
    let tail = yaml.get(end..).ok_or("bad offset")?;
    Ok(format!("{head}{with}{tail}"))
}

fn replace_once(text: &str, from: &str, to: &str) -> Result<String, String> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(format!(
            "expected `{}` once in the config, found {n}",
            from.trim()
        )),
    }
}

/// The route every benchmark request takes (`GET /items/<n>`, see `bench/wrk/tenants.lua`).
pub const ROUTE: &str = "GET /items/{id}";

/// A route no benchmark request takes: scenarios 3 and 3n load the filter with one policy on
/// it, so every request is planned and none matches (the filter's own floor).
pub const NO_MATCH_ROUTE: &str = "GET /orders/{id}";

/// A policy document with one per-tenant policy on `route`, never denying at benchmark rates
/// (a billion units per second, a burst of a billion) unless `rate` is given.
pub struct PolicyDoc<'a> {
    pub route: &'a str,
    pub scope: &'a str,
    /// `(units, burst)`: `units` per [`Self::per`]; a windowed algorithm's document leaves the
    /// burst out.
    pub rate: (u64, u64),
    /// `rate.per` (`"1s"`; scenario 4l's sliding log counts over [`LOG_WINDOW`]).
    pub per: &'a str,
    /// `"algorithm"`; `None` leaves it out (the default, `token_bucket`).
    pub algorithm: Option<&'a str>,
    pub on_unavailable: &'a str,
    /// `limiter.lease_max` (`1` turns batching off); `None` keeps the default.
    pub lease_max: Option<u64>,
    /// `limiter.lease_horizon` (e.g. `"1s"`); `None` keeps the default.
    pub lease_horizon: Option<&'a str>,
    /// The route's constant cost (`"cost": {route: n}`); `None` keeps the default of 1.
    pub cost: Option<u64>,
    /// `"settle": {"from": {"header": h}}`: the actual cost, read from this response header
    /// when the response ends, settles the route's constant cost (the reservation).
    pub settle_header: Option<&'a str>,
    /// `"max_in_flight"`: most requests of one key in flight at once; `None` leaves it out.
    pub max_in_flight: Option<u32>,
}

/// Scenarios 4s and 5s: the response header the actual cost is read from, the reservation
/// (the route's constant cost) and the actual cost every answer carries. The actual cost is
/// below the reservation, so every request is refunded `SETTLE_RESERVED - SETTLE_ACTUAL`
/// units: each admitted request costs its key `SETTLE_ACTUAL` in the end, as in 4 and 5 (1),
/// and with the never-denying rate the admitted/denied mix is theirs (everything admitted).
pub const SETTLE_HEADER: &str = "x-usage-units";
pub const SETTLE_RESERVED: u64 = 10;
pub const SETTLE_ACTUAL: u64 = 1;

/// Scenarios 4f, 4w and 4l: S4's policy counted by each windowed `algorithm`, reported next to
/// S4 (the token bucket) from the same rounds. None may deny: the fixed and sliding windows
/// keep S4's rate (a billion per 1 s window); a sliding log keeps one entry per unit, at most
/// [`MAX_LOG_LIMIT`] (256) per window, so 4l's window is short instead (see [`LOG_WINDOW`]).
pub const ALGORITHMS: [(&str, &str); 3] = [
    ("4f", "fixed_window"),
    ("4w", "sliding_window"),
    ("4l", "sliding_log"),
];

/// Scenario 4l's window: [`MAX_LOG_LIMIT`] per 50 ms. The hottest of 100 Zipf tenants sends
/// 1/H(100) = 19.3 % of the requests (see [`hottest_tenant_share`]): about 2,300 req/s at S4's
/// ~11,700 (bench/results/latest.md), so ~113 per window, and 256 only once the whole load
/// passes ~26,500 req/s ([`log_full_at_rps`]), above what one Envoy worker answers here even
/// without a filter (S1, ~22,000). Short enough not to deny, long enough that the hottest log
/// holds ~100 entries (a shorter one would measure a smaller log than the policy allows).
pub const LOG_WINDOW: &str = "50ms";
pub const LOG_WINDOW_MS: u64 = 50;
pub use tollgate_core::window::MAX_LOG_LIMIT;

/// The share of the requests the hottest tenant sends: wrk's Zipf-like distribution weighs
/// rank `r` by `1/r` (`bench/wrk/tenants.lua`), so `1 / H(tenants)`; uniform, `1 / tenants`.
pub fn hottest_tenant_share(tenants: u32, zipf: bool) -> f64 {
    let tenants = tenants.max(1);
    if zipf {
        1.0 / (1..=tenants).map(|r| 1.0 / f64::from(r)).sum::<f64>()
    } else {
        1.0 / f64::from(tenants)
    }
}

/// Total req/s at which the hottest tenant sends, on average, [`MAX_LOG_LIMIT`] per
/// [`LOG_WINDOW`]: scenario 4l's sliding log denies only beyond it.
pub fn log_full_at_rps(tenants: u32, zipf: bool) -> f64 {
    MAX_LOG_LIMIT as f64 * 1_000.0 / LOG_WINDOW_MS as f64 / hottest_tenant_share(tenants, zipf)
}

/// The shipped global config's failure mode.
pub const SHIPPED_FAILURE: &str =
    r#"{ "mode": "local", "share": 0.34, "stale_ttl": "30s", "then": "closed" }"#;
pub const CLOSED: &str = r#"{ "mode": "closed" }"#;
/// Never denying.
pub const HUGE: (u64, u64) = (1_000_000_000, 1_000_000_000);

impl PolicyDoc<'_> {
    pub fn local(route: &str) -> PolicyDoc<'_> {
        PolicyDoc {
            route,
            scope: "local",
            rate: HUGE,
            per: "1s",
            algorithm: None,
            on_unavailable: CLOSED,
            lease_max: None,
            lease_horizon: None,
            cost: None,
            settle_header: None,
            max_in_flight: None,
        }
    }

    pub fn global(lease_max: Option<u64>) -> PolicyDoc<'static> {
        PolicyDoc {
            route: ROUTE,
            scope: "global",
            rate: HUGE,
            per: "1s",
            algorithm: None,
            on_unavailable: SHIPPED_FAILURE,
            lease_max,
            lease_horizon: None,
            cost: None,
            settle_header: None,
            max_in_flight: None,
        }
    }

    /// The same policy reserving [`SETTLE_RESERVED`] (the route's constant cost) and settling
    /// from the [`SETTLE_HEADER`] response header.
    pub fn settling(self) -> Self {
        PolicyDoc {
            cost: Some(SETTLE_RESERVED),
            settle_header: Some(SETTLE_HEADER),
            ..self
        }
    }

    /// The same policy counted by `algorithm` (`fixed_window`, `sliding_window`: its rate per
    /// its window, no burst; `sliding_log`: [`MAX_LOG_LIMIT`] per [`LOG_WINDOW`]).
    pub fn counted_by(self, algorithm: &'static str) -> Self {
        let log = algorithm == "sliding_log";
        PolicyDoc {
            algorithm: Some(algorithm),
            rate: if log { (MAX_LOG_LIMIT, 0) } else { self.rate },
            per: if log { LOG_WINDOW } else { self.per },
            ..self
        }
    }

    pub fn json(&self) -> String {
        let (units, burst) = self.rate;
        // A windowed algorithm admits `rate.units` per `rate.per` and takes no burst.
        let counting = match self.algorithm {
            Some(a) if a != "token_bucket" => format!("\n    \"algorithm\": \"{a}\","),
            Some(a) => format!("\n    \"algorithm\": \"{a}\",\n    \"burst\": {burst},"),
            None => format!("\n    \"burst\": {burst},"),
        };
        let cost = self
            .cost
            .map(|c| format!("\n    \"cost\": {{ \"{}\": {c} }},", self.route))
            .unwrap_or_default();
        let settle = self
            .settle_header
            .map(|h| format!(",\n    \"settle\": {{ \"from\": {{ \"header\": \"{h}\" }} }}"))
            .unwrap_or_default();
        let in_flight = self
            .max_in_flight
            .map(|m| format!(",\n    \"max_in_flight\": {m}"))
            .unwrap_or_default();
        let mut limiter = String::new();
        if self.scope == "global" {
            let lease_max = self
                .lease_max
                .map(|m| format!(", \"lease_max\": {m}"))
                .unwrap_or_default();
            let horizon = self
                .lease_horizon
                .map(|h| format!(", \"lease_horizon\": \"{h}\""))
                .unwrap_or_default();
            limiter = format!(
                ",\n  \"limiter\": {{ \"cluster\": \"tollgate_limiter\", \"timeout\": \"{LIMITER_TIMEOUT}\"{lease_max}{horizon} }}"
            );
        }
        format!(
            r#"{{
  "policies": [{{
    "name": "per-tenant",
    "match": {{ "routes": ["{route}"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "on_missing_key": "deny",
    "rate": {{ "units": {units}, "per": "{per}" }},{counting}{cost}
    "scope": "{scope}",
    "on_unavailable": {failure},
    "enforce": true{settle}{in_flight}
  }}]{limiter}
}}"#,
            route = self.route,
            per = self.per,
            scope = self.scope,
            failure = self.on_unavailable,
        )
    }
}

/// The global policies' `limiter.timeout`: the callout deadline of S5 and S6, and the
/// deadline S8 gives Envoy's ratelimit filter ([`rls_timeout`]).
pub const LIMITER_TIMEOUT: &str = "25ms";

/// The RateLimitService domain of the shipped `envoy/ratelimit-service.yaml`, which S8's
/// ratelimit configuration ([`rls_limits`]) limits.
pub const RLS_DOMAIN: &str = "edge";

/// The shipped ratelimit config's catch-all route (the one `GET /items/<n>` takes): to the
/// demo upstream, one descriptor per request, the tenant (`x-tenant-id` → `tenant`).
const RLS_TENANT_ROUTE: &str = r#"              - match: { prefix: "/" }
                route:
                  cluster: demo_upstream
                  rate_limits:
                  - actions:
                    - request_headers: { header_name: x-tenant-id, descriptor_key: tenant }
"#;

/// The shipped ratelimit filter's failure mode and deadline, as S8 changes them.
const RLS_FAIL_CLOSED: &str = "              failure_mode_deny: true\n";
const RLS_FAIL_OPEN: &str = "              failure_mode_deny: false\n";
const RLS_SHIPPED_TIMEOUT: &str = "              timeout: 0.5s\n";

/// S8's answer: Envoy's `fault` filter, after the ratelimit filter, aborts every request with
/// a 200 before the router forwards it. Envoy's ratelimit filter acts only on routes to a
/// cluster (it skips `direct_response` routes, whose route has no cluster), so the route keeps
/// its cluster and this filter answers in its place: the upstream is never called, as with the
/// other scenarios' `direct_response`.
const FAULT_ANSWER: &str = r#"          - name: envoy.filters.http.fault
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
              abort:
                http_status: 200
                percentage: { numerator: 100, denominator: HUNDRED }
"#;

/// [`LIMITER_TIMEOUT`] as Envoy's `timeout` of the ratelimit filter (`0.025s`).
pub fn rls_timeout() -> Result<String, String> {
    let ms = tollgate_core::duration::Millis::parse(LIMITER_TIMEOUT)
        .map_err(|e| format!("LIMITER_TIMEOUT `{LIMITER_TIMEOUT}`: {e}"))?
        .0;
    Ok(format!("{}.{:03}s", ms / 1_000, ms % 1_000))
}

/// S8's ratelimit configuration (envoyproxy/ratelimit's format): one bucket per tenant, never
/// denying at benchmark rates (S5's rate, a billion a second: `requests_per_unit` is a uint32).
pub fn rls_limits() -> String {
    format!(
        "# Scenario 8: one bucket per tenant (`request_headers: x-tenant-id` -> `tenant`), never\n\
         # denying at benchmark rates.\n\
         domain: {RLS_DOMAIN}\n\
         descriptors:\n  \
         - key: tenant\n    \
         rate_limit: {{ unit: second, requests_per_unit: {units} }}\n",
        units = HUGE.0
    )
}

/// The shipped `envoy/ratelimit-service.yaml` (`shipped`, its text) made ready for S8: listener
/// and admin on free ports, the demo upstream on `upstream_port`, the RateLimitService cluster
/// on `rls_port`; the filter failing open (`failure_mode_deny: false`) with S6's callout
/// deadline ([`rls_timeout`]); every request answered 200 by [`FAULT_ANSWER`] once the filter
/// has let it through. Each edit must apply exactly once.
pub fn ratelimit_service(
    shipped: &str,
    upstream_port: u16,
    rls_port: u16,
) -> Result<String, String> {
    let mut yaml = shipped.to_string();
    for (from, to) in [
        ("port_value: 10000 }", "port_value: 0 }".to_string()),
        ("port_value: 9901 }", "port_value: 0 }".to_string()),
        (
            "port_value: 10001 }",
            format!("port_value: {upstream_port} }}"),
        ),
        ("port_value: 8082 }", format!("port_value: {rls_port} }}")),
        (RLS_FAIL_CLOSED, RLS_FAIL_OPEN.to_string()),
        (
            RLS_SHIPPED_TIMEOUT,
            format!("              timeout: {}\n", rls_timeout()?),
        ),
        (ROUTER, format!("{FAULT_ANSWER}{ROUTER}")),
    ] {
        yaml = replace_once(&yaml, from, &to)?;
    }
    // What S8 measures: requests to the tenant's route, one descriptor each, in the domain
    // `rls_limits` configures.
    for expected in [
        RLS_TENANT_ROUTE.to_string(),
        format!("              domain: {RLS_DOMAIN}\n"),
        "          - name: envoy.filters.http.ratelimit\n".to_string(),
    ] {
        if yaml.matches(&expected).count() != 1 {
            return Err(format!(
                "expected `{}` once in the ratelimit config",
                expected.trim()
            ));
        }
    }
    Ok(yaml)
}

/// The filter's default `limiter.lease_horizon`, in ms (as `tollgate-core` parses it).
pub fn default_lease_horizon_ms() -> Option<u64> {
    let doc = PolicyDoc::global(None).json();
    let policies = tollgate_core::policy::Policies::from_json(doc.as_bytes()).ok()?;
    policies.limiter.map(|l| l.lease_horizon.0)
}

/// The horizon scenario 5h compares with the default: 1 s when the default is shorter, else
/// the former default, 250 ms.
pub fn contrasting_horizon(default_ms: u64) -> &'static str {
    if default_ms < 1_000 {
        "1s"
    } else {
        "250ms"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::duration::Millis;
    use tollgate_core::policy::Policies;

    fn shipped(name: &str) -> String {
        let root = tollgate_e2e::paths::workspace_root();
        std::fs::read_to_string(root.join(name)).unwrap_or_default()
    }

    #[test]
    fn edits_apply_to_the_shipped_configs() {
        for name in [
            "envoy/local.yaml",
            "envoy/global.yaml",
            "envoy/global-mtls.yaml",
        ] {
            let yaml = shipped(name);
            let direct = direct_response(&yaml).unwrap_or_default();
            assert!(direct.contains("direct_response: { status: 200"), "{name}");
            assert!(
                !direct.contains("route: { cluster: demo_upstream }"),
                "{name}"
            );
            let bare = without_wasm(&yaml).unwrap_or_default();
            assert!(!bare.contains("envoy.filters.http.wasm"), "{name}");
            assert!(!bare.contains("vm_config"), "{name}");
            assert!(bare.contains(ROUTER), "{name}");
            let native = with_native_local_ratelimit(&yaml).unwrap_or_default();
            assert!(
                native.contains("envoy.filters.http.local_ratelimit"),
                "{name}"
            );
            assert!(!native.contains("envoy.filters.http.wasm"), "{name}");
            let filters = native.find("local_ratelimit").unwrap_or(usize::MAX);
            let router = native.find(ROUTER).unwrap_or(0);
            assert!(
                filters < router,
                "{name}: the limit must come before the router"
            );
        }
        assert!(direct_response("nothing").is_err());
        assert!(without_wasm("nothing").is_err());
    }

    #[test]
    fn the_usage_header_goes_on_the_ingress_route() {
        let line = "                response_headers_to_add: [{ header: { key: x-usage-units, value: \"1\" } }]\n";
        for name in ["envoy/local.yaml", "envoy/global.yaml"] {
            let yaml = shipped(name);
            // On the direct response (what 4s and 5s run) and on the route to the upstream.
            let direct = direct_response(&yaml).unwrap_or_default();
            let with = with_response_header(&direct, SETTLE_HEADER, "1").unwrap_or_default();
            assert!(
                with.contains(&format!("{DIRECT_RESPONSE}{line}")),
                "{name}: {with}"
            );
            assert_eq!(with.matches("response_headers_to_add").count(), 1, "{name}");
            let upstream = with_response_header(&yaml, SETTLE_HEADER, "1").unwrap_or_default();
            assert!(
                upstream.contains(&format!("{UPSTREAM_ROUTE}{line}")),
                "{name}"
            );
            // Once only: a second edit finds no route it could tell apart.
            assert!(with_response_header(&format!("{direct}{yaml}"), "k", "v").is_err());
        }
        assert!(with_response_header("nothing", "k", "v").is_err());
    }

    #[test]
    fn the_ratelimit_service_config_calls_the_limiters_rls_port() {
        let shipped = shipped("envoy/ratelimit-service.yaml");
        let yaml = ratelimit_service(&shipped, 41_001, 42_002);
        let yaml = yaml.unwrap_or_else(|e| format!("error: {e}"));
        // Envoy's ratelimit filter, no tollgate filter, and its answer before the router.
        assert_eq!(
            yaml.matches("- name: envoy.filters.http.ratelimit\n")
                .count(),
            1,
            "{yaml}"
        );
        assert!(!yaml.contains("envoy.filters.http.wasm"), "{yaml}");
        assert!(!yaml.contains("dynamic_modules"), "{yaml}");
        let at = |what: &str| yaml.find(what).unwrap_or(usize::MAX);
        assert!(at("envoy.filters.http.ratelimit") < at("envoy.filters.http.fault"));
        assert!(at("envoy.filters.http.fault") < at(ROUTER));
        assert!(yaml.contains("http_status: 200"), "{yaml}");
        // The gRPC service is the `tollgate_rls` cluster, HTTP/2 (h2c), on the limiter's RLS
        // port; the demo upstream on its port; listener and admin on free ports.
        assert!(
            yaml.contains("envoy_grpc: { cluster_name: tollgate_rls }"),
            "{yaml}"
        );
        let (_, rls_cluster) = yaml
            .split_once("  - name: tollgate_rls\n")
            .unwrap_or_default();
        assert!(
            rls_cluster.contains("http2_protocol_options: {}"),
            "{rls_cluster}"
        );
        assert!(
            rls_cluster.contains("{ address: 127.0.0.1, port_value: 42002 }"),
            "{rls_cluster}"
        );
        assert!(!rls_cluster.contains("transport_socket"), "{rls_cluster}");
        assert!(yaml.contains("port_value: 41001 }"), "{yaml}");
        for gone in ["port_value: 8082", "port_value: 10000", "port_value: 9901"] {
            assert!(!yaml.contains(gone), "{gone}");
        }
        assert_eq!(yaml.matches("port_value: 0 }").count(), 2, "{yaml}");
        // Fails open, with S6's callout deadline; the tenant is the descriptor.
        assert!(yaml.contains("failure_mode_deny: false\n"), "{yaml}");
        assert!(!yaml.contains("failure_mode_deny: true"), "{yaml}");
        assert!(yaml.contains("              timeout: 0.025s\n"), "{yaml}");
        assert!(yaml.contains(RLS_TENANT_ROUTE), "{yaml}");
        assert!(yaml.contains("domain: edge\n"), "{yaml}");
        // An edit that does not apply is an error, not a config that measures something else.
        assert!(ratelimit_service("nothing", 1, 2).is_err());
        let twice = shipped.replace(ROUTER, &format!("{ROUTER}{ROUTER}"));
        assert!(ratelimit_service(&twice, 1, 2).is_err());
        let no_tenant = shipped.replace("descriptor_key: tenant", "descriptor_key: user");
        assert!(ratelimit_service(&no_tenant, 1, 2).is_err());
    }

    #[test]
    fn the_ratelimit_limits_never_deny_the_tenants() {
        assert_eq!(rls_timeout().ok().as_deref(), Some("0.025s"));
        assert!(PolicyDoc::global(Some(1))
            .json()
            .contains(&format!(r#""timeout": "{LIMITER_TIMEOUT}""#)));
        let limits = rls_limits();
        assert!(limits.contains("domain: edge\n"), "{limits}");
        assert!(
            limits.contains(
                "\n  - key: tenant\n    rate_limit: { unit: second, requests_per_unit: 1000000000 }\n"
            ),
            "{limits}"
        );
        // The limiter parses it as ratelimit's format (it refuses the file at start otherwise:
        // the run would fail there); `requests_per_unit` is a uint32.
        assert!(u32::try_from(HUGE.0).is_ok());
    }

    #[test]
    fn the_horizon_variant_differs_from_the_default() {
        let default = default_lease_horizon_ms().unwrap_or(0);
        assert!(default > 0);
        let other = tollgate_core::duration::Millis::parse(contrasting_horizon(default))
            .map(|m| m.0)
            .unwrap_or(default);
        assert_ne!(other, default);
    }

    #[test]
    fn policy_documents_are_valid() {
        for doc in [
            PolicyDoc::local(ROUTE),
            PolicyDoc::local(NO_MATCH_ROUTE),
            PolicyDoc::global(None),
            PolicyDoc::global(Some(1)),
            PolicyDoc {
                lease_horizon: Some("1s"),
                ..PolicyDoc::global(None)
            },
            PolicyDoc {
                rate: (100, 20),
                on_unavailable: CLOSED,
                ..PolicyDoc::global(None)
            },
            PolicyDoc::local(ROUTE).settling(),
            PolicyDoc::global(None).settling(),
            PolicyDoc::local(ROUTE).counted_by("fixed_window"),
            PolicyDoc::local(ROUTE).counted_by("sliding_window"),
            PolicyDoc::local(ROUTE).counted_by("sliding_log"),
            PolicyDoc::local(ROUTE).counted_by("token_bucket"),
            PolicyDoc {
                max_in_flight: Some(100),
                ..PolicyDoc::local(ROUTE)
            },
        ] {
            let json = doc.json();
            let parsed = Policies::from_json(json.as_bytes());
            assert!(
                parsed.is_ok(),
                "{json}: {:?}",
                parsed.err().map(|e| e.to_string())
            );
        }
        let no_batching = Policies::from_json(PolicyDoc::global(Some(1)).json().as_bytes());
        let lease_max = no_batching
            .ok()
            .and_then(|p| p.limiter.map(|l| l.lease_max));
        assert_eq!(lease_max, Some(1));
        let limited = PolicyDoc {
            max_in_flight: Some(100),
            ..PolicyDoc::local(ROUTE)
        }
        .json();
        let parsed = Policies::from_json(limited.as_bytes()).ok();
        let max = parsed
            .as_ref()
            .and_then(|p| p.policies.first())
            .and_then(|p| p.in_flight.map(|l| l.max));
        assert_eq!(max, Some(100), "{limited}");
        assert!(!PolicyDoc::local(ROUTE).json().contains("max_in_flight"));
    }

    #[test]
    fn settling_policies_reserve_the_route_cost_and_settle_from_the_header() {
        for doc in [
            PolicyDoc::local(ROUTE).settling(),
            PolicyDoc::global(None).settling(),
        ] {
            let json = doc.json();
            assert!(
                json.contains(r#""cost": { "GET /items/{id}": 10 },"#),
                "{json}"
            );
            assert!(
                json.contains(r#""settle": { "from": { "header": "x-usage-units" } }"#),
                "{json}"
            );
            let parsed = Policies::from_json(json.as_bytes()).ok();
            let policy = parsed.as_ref().and_then(|p| p.policies.first());
            assert!(policy.is_some_and(|p| p.settle.is_some() && p.reserve.is_none()));
        }
        // The plain ones neither settle nor list a cost (the route costs 1).
        let plain = PolicyDoc::local(ROUTE).json();
        assert!(
            !plain.contains("settle") && !plain.contains("cost"),
            "{plain}"
        );
        const { assert!(SETTLE_ACTUAL < SETTLE_RESERVED, "the bench must refund") };
    }

    #[test]
    fn windowed_policies_name_their_algorithm_and_leave_the_burst_out() {
        use tollgate_core::policy::Algorithm;
        for (id, algorithm) in ALGORITHMS {
            let json = PolicyDoc::local(ROUTE).counted_by(algorithm).json();
            assert!(
                json.contains(&format!(r#""algorithm": "{algorithm}","#)),
                "{id}: {json}"
            );
            assert!(!json.contains("burst"), "{id}: {json}");
            let parsed = Policies::from_json(json.as_bytes()).ok();
            let policy = parsed.as_ref().and_then(|p| p.policies.first());
            let (name, window) = policy
                .map(|p| (p.algorithm.name(), p.algorithm.window().copied()))
                .unwrap_or(("none", None));
            assert_eq!(name, algorithm, "{id}");
            let window = window.map(|w| (w.limit, w.window_ms));
            if algorithm == "sliding_log" {
                assert_eq!(window, Some((MAX_LOG_LIMIT, LOG_WINDOW_MS)), "{id}");
                assert!(json.contains(r#""rate": { "units": 256, "per": "50ms" },"#));
            } else {
                // S4's never-denying rate, as the window's limit.
                assert_eq!(window, Some((HUGE.0, 1_000)), "{id}");
            }
        }
        // The token bucket keeps its burst, named or not.
        let named = PolicyDoc::local(ROUTE).counted_by("token_bucket").json();
        assert!(named.contains(r#""burst": 1000000000,"#), "{named}");
        let parsed = Policies::from_json(named.as_bytes()).ok();
        let policy = parsed.as_ref().and_then(|p| p.policies.first());
        assert!(policy.is_some_and(|p| p.algorithm == Algorithm::TokenBucket));
        assert!(Millis::parse(LOG_WINDOW).is_ok_and(|m| m.0 == LOG_WINDOW_MS));
    }

    #[test]
    fn the_log_window_holds_the_hottest_tenant_at_full_load() {
        // 1 / H(100) = 1 / 5.187...
        let share = hottest_tenant_share(100, true);
        assert!((share - 0.1928).abs() < 1e-3, "{share}");
        assert!((hottest_tenant_share(100, false) - 0.01).abs() < 1e-12);
        assert!((hottest_tenant_share(1, true) - 1.0).abs() < 1e-12);
        // 256 per 50 ms for 19.3 % of the load: ~26,500 req/s in all, above S1 (an Envoy
        // worker with no filter, ~22,000 req/s on the bench machine).
        let full = log_full_at_rps(100, true);
        assert!((full - 256.0 * 20.0 / share).abs() < 1e-6, "{full}");
        assert!(full > 25_000.0, "{full}");
    }
}
