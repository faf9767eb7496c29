//! `match`: the hosts, routes and methods a policy applies to.

use super::Cx;
use crate::policy::matching::HostPattern;
use crate::route::RouteTemplate;

/// A validated `match`.
pub(super) struct Matcher {
    pub(super) hosts: Vec<HostPattern>,
    pub(super) routes: Vec<RouteTemplate>,
    pub(super) methods: Vec<String>,
}

pub(super) fn compile_match(cx: &mut Cx<'_>) -> Matcher {
    let spec = cx.spec;
    let matcher = &spec.matcher;
    let mut hosts = Vec::new();
    for (i, host) in matcher.hosts.iter().enumerate() {
        match HostPattern::parse(host) {
            Ok(h) => hosts.push(h),
            Err(reason) => cx.push(&format!("match.hosts[{i}]"), reason),
        }
    }
    let mut routes = Vec::new();
    for (i, route) in matcher.routes.iter().enumerate() {
        match RouteTemplate::parse(route) {
            Ok(r) => routes.push(r),
            Err(reason) => cx.push(&format!("match.routes[{i}]"), reason),
        }
    }
    let mut methods = Vec::new();
    for (i, method) in matcher.methods.iter().enumerate() {
        if method.is_empty() || method.len() > 16 || !method.bytes().all(|b| b.is_ascii_uppercase())
        {
            cx.push(
                &format!("match.methods[{i}]"),
                format!("`{method}` is not an upper-case HTTP method"),
            );
        } else {
            methods.push(method.clone());
        }
    }
    Matcher {
        hosts,
        routes,
        methods,
    }
}
