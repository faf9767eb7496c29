//! A tiny blocking HTTP/1.1 client for control-plane calls (Envoy admin, `/metrics`,
//! `/healthz`): one request per connection, `Connection: close`, bounded by a timeout.
//!
//! Blocking on purpose: it works from sync tests, from `Drop`, and while a test's runtime is
//! busy. Data-plane traffic uses the async [`crate::client`] instead.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};

/// Default timeout for control-plane calls.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// A response: status, headers (lowercased names, in order), body as text.
#[derive(Debug, Clone)]
pub struct BlockingResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

/// `GET http://127.0.0.1:<port><path>`.
pub fn get(port: u16, path: &str, timeout: Duration) -> Result<BlockingResponse> {
    request(port, "GET", path, &[], "", timeout)
}

/// `POST http://127.0.0.1:<port><path>` with a body.
pub fn post(port: u16, path: &str, body: &str, timeout: Duration) -> Result<BlockingResponse> {
    request(port, "POST", path, &[], body, timeout)
}

/// Any request to 127.0.0.1:`port`.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    timeout: Duration,
) -> Result<BlockingResponse> {
    let what = || format!("{method} 127.0.0.1:{port}{path}");
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| HarnessError::new(format!("{}: connect: {e}", what())))?;
    stream.set_nodelay(true).ok();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream
        .set_write_timeout(Some(timeout))
        .and_then(|()| stream.write_all(req.as_bytes()))
        .map_err(|e| HarnessError::new(format!("{}: write: {e}", what())))?;

    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HarnessError::new(format!(
                "{}: no complete response within {timeout:?}",
                what()
            )));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| HarnessError::new(format!("{}: {e}", what())))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(buf.get(..n).unwrap_or_default()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(HarnessError::new(format!("{}: read: {e}", what()))),
        }
    }
    parse_response(&raw).map_err(|e| HarnessError::new(format!("{}: {e}", what())))
}

fn parse_response(raw: &[u8]) -> std::result::Result<BlockingResponse, String> {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("response has no header terminator")?;
    let head = String::from_utf8_lossy(raw.get(..head_end).unwrap_or_default()).into_owned();
    let body_raw = raw.get(head_end + 4..).unwrap_or_default();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or("empty response")?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        decode_chunked(body_raw)?
    } else {
        body_raw.to_vec()
    };
    Ok(BlockingResponse {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn decode_chunked(mut data: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk size")?;
        let size_line = String::from_utf8_lossy(data.get(..line_end).unwrap_or_default());
        let size_hex = size_line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| format!("bad chunk size {size_hex:?}"))?;
        data = data.get(line_end + 2..).unwrap_or_default();
        if size == 0 {
            return Ok(out);
        }
        let chunk = data.get(..size).ok_or("truncated chunk")?;
        out.extend_from_slice(chunk);
        data = data.get(size + 2..).unwrap_or_default();
    }
}

/// Sends `request` as raw bytes on a fresh connection to `127.0.0.1:<port>` (hostile header
/// bytes go out exactly as given) and returns the status code of the answer (0 if none could
/// be read). Panics on a connection or I/O error: a test helper.
pub fn raw_status(port: u16, request: &[u8]) -> u16 {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    stream.write_all(request).expect("write the request");
    let mut buf = [0u8; 512];
    let n = stream.read(&mut buf).expect("read the answer");
    let head = String::from_utf8_lossy(&buf[..n]);
    head.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let r =
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\nhi").unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "hi");
        assert!(r.headers.contains(&("x-a".into(), "b".into())));

        let r = parse_response(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.body, "hello world");
    }
}
