//! Redis URLs fit to print: a password in the user information or the query replaced by
//! `<redacted>`.

use super::REDACTED;

/// `url` fit to print: the password of `user:password@` and a `pass=` query value replaced
/// by `<redacted>`.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    // The user information ends at the last '@' (not at the first '/': a password with an
    // unescaped '/', '?' or '#' makes an invalid URL, which is printed in the error).
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => (format!("{user}:{REDACTED}@"), host),
            None => (format!("{userinfo}@"), host),
        },
        None => (String::new(), rest),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, tail) = rest.split_at(authority_end);
    let authority = format!("{userinfo}{host}");
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, Some(f)),
                None => (query, None),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some(("pass" | "password", _)) => {
                        format!("{}={REDACTED}", pair.split('=').next().unwrap_or(""))
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            let mut tail = format!("{path}?{}", query.join("&"));
            if let Some(f) = fragment {
                tail.push('#');
                tail.push_str(f);
            }
            tail
        }
        None => tail.to_owned(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{authority}{tail}"),
        None => format!("{authority}{tail}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_print_without_passwords() {
        assert_eq!(
            redact_url("rediss://alice:s3cr%40t@redis.example:6380/2"),
            "rediss://alice:<redacted>@redis.example:6380/2"
        );
        assert_eq!(
            redact_url("redis://:pw@127.0.0.1:6379"),
            "redis://:<redacted>@127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("redis://alice@127.0.0.1"),
            "redis://alice@127.0.0.1"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?db=1&pass=pw&user=u"),
            "redis+unix:///run/redis.sock?db=1&pass=<redacted>&user=u"
        );
        // A password containing '@', ':' or '/' (unencoded): everything before the last '@'.
        assert_eq!(
            redact_url("redis://u:a:b@c@host:1"),
            "redis://u:<redacted>@host:1"
        );
        assert_eq!(
            redact_url("redis://u:pa/ss?x#y@host:1/0"),
            "redis://u:<redacted>@host:1/0"
        );
    }
}
