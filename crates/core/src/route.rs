//! Route templates (`POST /payments/transfers/{id}`) and request-path normalization.
//!
//! Requests are matched to declared templates; a rate-limit key carries the template text,
//! never the raw path or query, so IDs in URLs cannot create unbounded key cardinality.

use std::fmt;

/// Longest template or request path we look at; longer paths never match.
pub const MAX_PATH_BYTES: usize = 4096;

/// One `/`-separated piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{name}`: any one non-empty segment.
    Param(String),
}

/// A parsed route template: optional method plus path segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTemplate {
    method: Option<String>,
    segments: Vec<Segment>,
    text: String,
}

impl RouteTemplate {
    /// Parses `METHOD /a/{b}/c` or `/a/{b}/c` (any method).
    pub fn parse(text: &str) -> Result<Self, String> {
        let trimmed = text.trim();
        let (method, path) = match trimmed.split_once(' ') {
            Some((method, path)) => (Some(method), path.trim()),
            None => (None, trimmed),
        };
        if let Some(method) = method {
            if !is_method(method) {
                return Err(format!(
                    "route `{text}`: `{method}` is not an HTTP method (use upper case, e.g. GET)"
                ));
            }
        }
        if !path.starts_with('/') {
            return Err(format!("route `{text}`: path must start with `/`"));
        }
        if path.len() > MAX_PATH_BYTES {
            return Err(format!(
                "route `{text}`: longer than {MAX_PATH_BYTES} bytes"
            ));
        }
        if path.contains(['?', '#', ' ']) {
            return Err(format!(
                "route `{text}`: a template is a path only (no query, fragment or spaces)"
            ));
        }
        let mut segments = Vec::new();
        for piece in split_path(path) {
            if piece.starts_with('{') || piece.ends_with('}') {
                let name = piece
                    .strip_prefix('{')
                    .and_then(|p| p.strip_suffix('}'))
                    .filter(|n| {
                        !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    })
                    .ok_or_else(|| {
                        format!("route `{text}`: `{piece}` must be a whole segment like `{{id}}`")
                    })?;
                segments.push(Segment::Param(name.to_string()));
            } else if piece.contains(['{', '}']) {
                return Err(format!(
                    "route `{text}`: `{piece}` mixes text and a parameter; use a whole segment"
                ));
            } else {
                segments.push(Segment::Literal(piece.to_string()));
            }
        }
        let canonical = match method {
            Some(m) => format!("{m} {path}"),
            None => path.to_string(),
        };
        Ok(Self {
            method: method.map(str::to_string),
            segments,
            text: canonical,
        })
    }

    /// The template as written (canonical spacing): what keys and costs refer to.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether a request with this method and (raw) path matches.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        if let Some(expected) = &self.method {
            if expected != method {
                return false;
            }
        }
        // The pieces `request_segments` gives, walked in place (one pass over the path, as
        // every policy's templates are tried on every request).
        let Some(path) = normalize_path(path) else {
            return false;
        };
        let body = path.strip_prefix('/').unwrap_or(path);
        let mut rest = body.strip_suffix('/').unwrap_or(body).as_bytes();
        if rest.is_empty() {
            return self.segments.is_empty();
        }
        for (i, segment) in self.segments.iter().enumerate() {
            if i > 0 {
                match rest.split_first() {
                    Some((b'/', after)) => rest = after,
                    _ => return false,
                }
            }
            let end = rest.iter().position(|b| *b == b'/').unwrap_or(rest.len());
            let (piece, after) = rest.split_at(end);
            let fits = match segment {
                Segment::Literal(lit) => lit.as_bytes() == piece,
                Segment::Param(_) => !piece.is_empty(),
            };
            if !fits {
                return false;
            }
            rest = after;
        }
        rest.is_empty()
    }

    /// Position of the `{name}` parameter among the template's segments (what
    /// [`path_segment`] reads from a request the template matched).
    pub fn param_position(&self, name: &str) -> Option<usize> {
        self.segments
            .iter()
            .position(|s| matches!(s, Segment::Param(n) if n == name))
    }

    /// Names of the template's parameters, in order.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Param(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }
}

/// The pieces of a request path that templates match: query cut, one leading and one trailing
/// `/` dropped, split at `/` as bytes (`/` is ASCII: the same pieces as `split_path`, without a
/// char search). `None` for a path that never matches.
fn request_segments(path: &str) -> Option<impl Iterator<Item = &[u8]>> {
    let path = normalize_path(path)?;
    let body = path.strip_prefix('/').unwrap_or(path);
    let body = body.strip_suffix('/').unwrap_or(body).as_bytes();
    let empty = body.is_empty();
    Some(body.split(|b| *b == b'/').filter(move |_| !empty))
}

/// The `index`-th segment of a request path (as it arrived: not percent-decoded), counted as
/// [`RouteTemplate::matches`] counts them: the value of the parameter at
/// [`RouteTemplate::param_position`] `index` of a template the path matched.
pub fn path_segment(path: &str, index: usize) -> Option<&[u8]> {
    request_segments(path)?.nth(index)
}

impl fmt::Display for RouteTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The path part of a request target: query and fragment cut, bounded in length.
/// `None` for something that is not an origin-form path.
pub fn normalize_path(raw: &str) -> Option<&str> {
    // Both are ASCII, so a byte search finds the same (char boundary) position.
    let end = raw
        .bytes()
        .position(|b| b == b'?' || b == b'#')
        .unwrap_or(raw.len());
    let path = raw.get(..end)?;
    if !path.starts_with('/') || path.len() > MAX_PATH_BYTES {
        return None;
    }
    Some(path)
}

/// Segments of a path; one trailing `/` is ignored (`/a/b/` is `/a/b`), `//` gives an empty
/// segment (which never matches a parameter).
fn split_path(path: &str) -> impl Iterator<Item = &str> {
    let body = path.strip_prefix('/').unwrap_or(path);
    let body = body.strip_suffix('/').unwrap_or(body);
    let empty = body.is_empty();
    body.split('/').filter(move |_| !empty)
}

fn is_method(text: &str) -> bool {
    !text.is_empty() && text.len() <= 16 && text.bytes().all(|b| b.is_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_templates() {
        let t = RouteTemplate::parse("GET /payments/transfers/{id}").unwrap();
        assert!(t.matches("GET", "/payments/transfers/42"));
        assert!(t.matches("GET", "/payments/transfers/42?expand=1"));
        assert!(t.matches("GET", "/payments/transfers/42/"));
        assert!(!t.matches("POST", "/payments/transfers/42"));
        assert!(!t.matches("GET", "/payments/transfers"));
        assert!(!t.matches("GET", "/payments/transfers/42/x"));
        assert!(!t.matches("GET", "/payments/transfers//"));
        assert!(!t.matches("GET", "payments/transfers/42"));
        assert_eq!(t.as_str(), "GET /payments/transfers/{id}");
    }

    #[test]
    fn parameters_are_read_from_the_segments_the_template_matched() {
        let t = RouteTemplate::parse("PUT /users/{user}/items/{id}").unwrap();
        assert_eq!(t.param_names().collect::<Vec<_>>(), ["user", "id"]);
        assert_eq!(t.param_position("user"), Some(1));
        assert_eq!(t.param_position("id"), Some(3));
        assert_eq!(t.param_position("items"), None);
        let path = "/users/a%3Ab/items/42/?x=/y";
        assert!(t.matches("PUT", path));
        assert_eq!(path_segment(path, 1), Some(&b"a%3Ab"[..]), "not decoded");
        assert_eq!(path_segment(path, 3), Some(&b"42"[..]), "query cut");
        assert_eq!(path_segment(path, 4), None);
        assert_eq!(path_segment("/", 0), None);
        assert_eq!(path_segment("*", 0), None);
    }

    #[test]
    fn any_method_and_root() {
        let t = RouteTemplate::parse("/").unwrap();
        assert!(t.matches("GET", "/"));
        assert!(t.matches("PUT", "/?q=1"));
        assert!(!t.matches("GET", "/a"));
        let t = RouteTemplate::parse("/a/b").unwrap();
        assert!(t.matches("DELETE", "/a/b"));
    }

    #[test]
    fn rejects_bad_templates() {
        for bad in [
            "get /a",
            "GET a",
            "GET /a?x=1",
            "GET /a/{}",
            "GET /a/x{id}",
            "GET /a/{id",
            "GET /a/{i-d}",
        ] {
            assert!(RouteTemplate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn normalize_cuts_query_and_bounds_length() {
        assert_eq!(normalize_path("/a?b#c"), Some("/a"));
        assert_eq!(normalize_path("*"), None);
        assert_eq!(normalize_path(&"/a".repeat(3000)), None);
    }

    /// The matcher walks the path in place; it decides as the pieces of
    /// `request_segments` (what `path_segment` reads parameters from) say, for any path.
    fn by_pieces(t: &RouteTemplate, path: &str) -> bool {
        let Some(mut pieces) = request_segments(path) else {
            return false;
        };
        for segment in &t.segments {
            match (segment, pieces.next()) {
                (Segment::Literal(lit), Some(piece)) if lit.as_bytes() == piece => {}
                (Segment::Param(_), Some(piece)) if !piece.is_empty() => {}
                _ => return false,
            }
        }
        pieces.next().is_none()
    }

    proptest::proptest! {
        #[test]
        fn walking_the_path_matches_as_its_pieces_do(path in "[/ab?{}]{0,12}") {
            for text in ["/", "/a", "/a/b", "/a/{p}", "/{p}/b", "/{p}", "/{p}/{q}", "/a/b/{p}"] {
                let t = RouteTemplate::parse(text).unwrap();
                proptest::prop_assert_eq!(t.matches("GET", &path), by_pieces(&t, &path), "{} {}", text, path);
            }
        }
    }
}
