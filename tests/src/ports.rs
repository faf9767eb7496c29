//! Free loopback ports for processes that cannot bind port 0 themselves (redis-server).
//!
//! A port that was free when we asked can be taken before the child binds it (another test,
//! an outgoing connection's ephemeral port). Callers therefore treat a bind failure as "try
//! again with another port" and verify they reached *their* process (see `redis`). Prefer
//! port 0 wherever the program supports it (Envoy, the in-process upstream).

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Mutex, OnceLock};

/// A TCP port on 127.0.0.1 that was free a moment ago and has not been handed out before by
/// this process (so parallel tests in one binary never get the same port from us).
pub fn free_port() -> u16 {
    static HANDED_OUT: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let handed_out = HANDED_OUT.get_or_init(|| Mutex::new(HashSet::new()));
    for _ in 0..1000 {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0: {e}"));
        let mut set = handed_out.lock().unwrap_or_else(|p| p.into_inner());
        if set.insert(port) {
            return port;
        }
    }
    panic!("no fresh free port after 1000 attempts")
}

/// Is `port` free on 127.0.0.1 right now?
pub fn is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_and_bindable() {
        let a = free_port();
        let b = free_port();
        assert_ne!(a, b);
        assert!(is_free(a));
    }
}
