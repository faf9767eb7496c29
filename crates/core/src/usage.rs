//! Units a request or response actually costs, read from headers, trailers and bodies.
//!
//! The filter reserves an estimated cost when it admits a request and settles the actual cost
//! when the response ends. This module reads that cost ("units") from a header or trailer
//! value, from a field of a JSON document, or from the events of a `text/event-stream`
//! response. Everything read here comes from clients or upstreams, so nothing panics, memory
//! is bounded by the configured `max_bytes`, and work is linear in the bytes seen.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// Most segments of a field path.
pub const MAX_PATH_SEGMENTS: usize = 16;
/// Longest text of a field path, in bytes.
pub const MAX_PATH_BYTES: usize = 256;

/// A dot-separated path into a JSON document, e.g. `usage.total_tokens` or
/// `choices.0.usage.total_tokens`.
///
/// A segment of only ASCII digits indexes an array when the value there is an array (else it
/// is an object key). Object keys containing `.` cannot be named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldPath {
    /// Validated text; segments are its `.`-separated pieces.
    text: String,
}

impl FieldPath {
    /// Parses a path. Err(reason) for empty text, an empty segment (`a..b`, a leading or
    /// trailing dot), more than [`MAX_PATH_SEGMENTS`] segments or more than
    /// [`MAX_PATH_BYTES`] bytes.
    pub fn parse(text: &str) -> Result<FieldPath, String> {
        let problem = match text {
            "" => "is empty".to_string(),
            _ if text.len() > MAX_PATH_BYTES => format!("is longer than {MAX_PATH_BYTES} bytes"),
            _ if text.split('.').any(str::is_empty) => "has an empty segment".to_string(),
            _ if text.split('.').nth(MAX_PATH_SEGMENTS).is_some() => {
                format!("has more than {MAX_PATH_SEGMENTS} segments")
            }
            _ => {
                return Ok(FieldPath {
                    text: text.to_string(),
                })
            }
        };
        Err(format!("field path `{text}` {problem}"))
    }

    /// The path as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// Units from a header or trailer value.
///
/// ASCII whitespace is trimmed; the rest must be a non-negative decimal integer (`42`) or
/// decimal fraction (`12.5`), with digits on both sides of the dot; a fraction rounds up
/// (`12.5` → 13, `12.0` → 12). Signs, exponents (`1e3`), `NaN`/`inf`, empty and non-ASCII
/// values are None. Integers beyond `u64` saturate to `u64::MAX` (callers clamp).
pub fn units_from_text(value: &[u8]) -> Option<u64> {
    let mut parts = value.trim_ascii().splitn(2, |&b| b == b'.');
    let whole = parts.next()?;
    let fraction = parts.next();
    let digits = |s: &[u8]| !s.is_empty() && s.iter().all(u8::is_ascii_digit);
    if !digits(whole) || fraction.is_some_and(|f| !digits(f)) {
        return None;
    }
    let units = whole.iter().fold(0u64, |acc, b| {
        acc.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    });
    let round_up = fraction.is_some_and(|f| f.iter().any(|&b| b != b'0'));
    Some(units.saturating_add(u64::from(round_up)))
}

/// Units at `path` in a JSON document.
///
/// The value there must be a JSON number ≥ 0; fractions round up and numbers beyond `u64`
/// saturate to `u64::MAX`. None for a document that is not JSON, a missing path, a value that
/// is not a number (`"30"` included) or a negative one. The document is walked, not built in
/// memory: serde_json skips values off `path` without recursing, and the walk along `path` is
/// at most [`MAX_PATH_SEGMENTS`] deep, so hostile nesting cannot exhaust the stack.
pub fn units_from_json(body: &[u8], path: &FieldPath) -> Option<u64> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let units = At(path.text.split('.')).deserialize(&mut de).ok()?;
    de.end().ok()?;
    units
}

/// The value reached so far; the iterator holds the segments still to follow.
struct At<'p>(std::str::Split<'p, char>);

impl At<'_> {
    fn at_end(&self) -> bool {
        self.0.clone().next().is_none()
    }
}

impl<'de> DeserializeSeed<'de> for At<'_> {
    type Value = Option<u64>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<u64>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for At<'_> {
    type Value = Option<u64>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Option<u64>, E> {
        Ok(Some(v).filter(|_| self.at_end()))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Option<u64>, E> {
        Ok(u64::try_from(v).ok().filter(|_| self.at_end()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Option<u64>, E> {
        // `as` saturates: values beyond u64 become u64::MAX.
        let ok = self.at_end() && v.is_finite() && v >= 0.0;
        Ok(ok.then(|| v.ceil() as u64))
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Option<u64>, A::Error> {
        let key = self.0.next();
        let mut found = None;
        while let Some(hit) = map.next_key_seed(KeyIs(key))? {
            if hit {
                found = map.next_value_seed(At(self.0.clone()))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Option<u64>, A::Error> {
        let index = (self.0.next())
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<usize>().ok());
        let (mut found, mut i) = (None, 0usize);
        loop {
            let element = if Some(i) == index {
                seq.next_element_seed(At(self.0.clone()))?
            } else {
                seq.next_element::<IgnoredAny>()?.map(|_| None)
            };
            match element {
                Some(units) => found = found.or(units),
                None => return Ok(found),
            }
            i = i.saturating_add(1);
        }
    }
}

/// Whether an object key equals the segment (None: no segment left, nothing matches).
struct KeyIs<'p>(Option<&'p str>);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<bool, D::Error> {
        de.deserialize_str(self)
    }
}

impl Visitor<'_> for KeyIs<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E>(self, v: &str) -> Result<bool, E> {
        Ok(self.0 == Some(v))
    }
}

/// How a response body carries its usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// One JSON document.
    Json,
    /// A `text/event-stream`: each event's data is a JSON document.
    EventStream,
}

impl BodyFormat {
    /// From a `content-type` header value: `text/event-stream` (case-insensitive, parameters
    /// after `;` ignored) is [`BodyFormat::EventStream`]; anything else, or no header, is
    /// [`BodyFormat::Json`].
    pub fn from_content_type(value: Option<&[u8]>) -> BodyFormat {
        let media = value.and_then(|v| v.split(|&b| b == b';').next());
        if media.is_some_and(|m| m.trim_ascii().eq_ignore_ascii_case(b"text/event-stream")) {
            BodyFormat::EventStream
        } else {
            BodyFormat::Json
        }
    }
}

/// Where the event-stream parser is within the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Reading the field name; the count is how many bytes of `data` it matches so far.
    /// `Name(0)` is the start of a line.
    Name(u8),
    /// Just after `data:`: one space here is dropped.
    Space,
    /// In the value of a `data` line.
    Data,
    /// In a comment or a field other than `data`: ignored to the end of the line.
    Other,
}

/// Reads units from a body that arrives in chunks, keeping at most `max_bytes` of it.
///
/// [`BodyFormat::Json`]: the chunks are kept up to `max_bytes`; a longer body reads as None
/// (never a partial parse).
///
/// [`BodyFormat::EventStream`]: parsed incrementally. Lines end in `\n`, `\r\n` or `\r`, and may
/// be split across chunks; the values of `data:` lines (one space after the colon dropped) are
/// joined with `\n`; a blank line ends an event; comments (`:` lines) and other fields are
/// ignored. Each event's data is read with [`units_from_json`], and the answer is the units of
/// the last event that carries them, so `data: [DONE]` or events without usage do not erase
/// it. An event whose data exceeds `max_bytes` is skipped whole. A last event without its
/// terminating blank line (even mid-line) still counts at [`BodyUnits::finish`]. A leading
/// byte-order mark is not stripped.
///
/// Only the body (Json) or the current event's data (EventStream) is held, and its buffer never
/// grows beyond `max_bytes`, whatever the stream length.
#[derive(Debug)]
pub struct BodyUnits {
    format: BodyFormat,
    path: FieldPath,
    max_bytes: usize,
    /// Json: the body so far. EventStream: the current event's data so far.
    held: Vec<u8>,
    /// `held` outgrew `max_bytes` and was dropped: the body (Json) or event is skipped.
    overflow: bool,
    line: Line,
    /// The last byte was `\r`: a `\n` right after it ends no further line.
    after_cr: bool,
    /// The current event has had a `data` line (Json: a chunk came).
    has_data: bool,
    units: Option<u64>,
}

impl BodyUnits {
    /// A reader for a body in `format`, looking for units at `path`.
    pub fn new(format: BodyFormat, path: FieldPath, max_bytes: usize) -> BodyUnits {
        BodyUnits {
            format,
            path,
            max_bytes,
            held: Vec::new(),
            overflow: false,
            line: Line::Name(0),
            after_cr: false,
            has_data: false,
            units: None,
        }
    }

    /// Takes the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.format {
            BodyFormat::Json => {
                self.has_data = true;
                self.push_data(chunk);
            }
            BodyFormat::EventStream => self.feed_events(chunk),
        }
    }

    /// The units the body carried, if any. Call it after the last chunk; it releases the held
    /// bytes, and calling it again gives the same answer.
    pub fn finish(&mut self) -> Option<u64> {
        if self.line != Line::Name(0) {
            self.end_line();
        }
        self.end_event();
        self.held = Vec::new();
        self.units
    }

    /// Bytes currently held: never more than `max_bytes` (nor is the buffer's capacity).
    pub fn held_bytes(&self) -> usize {
        self.held.len()
    }

    fn feed_events(&mut self, mut rest: &[u8]) {
        while let Some((&b, tail)) = rest.split_first() {
            let after_cr = std::mem::replace(&mut self.after_cr, b == b'\r');
            match (b, self.line) {
                (b'\n', _) if after_cr => {}
                (b'\n' | b'\r', _) => self.end_line(),
                (_, Line::Data) => {
                    // Take the whole run up to the next line end at once.
                    let run = rest.iter().position(|&c| c == b'\n' || c == b'\r');
                    let (value, after) = rest
                        .split_at_checked(run.unwrap_or(rest.len()))
                        .unwrap_or((rest, &[]));
                    self.push_data(value);
                    rest = after;
                    continue;
                }
                (b' ', Line::Space) => self.line = Line::Data,
                (_, Line::Space) => {
                    self.line = Line::Data;
                    continue; // `b` is the value's first byte
                }
                (b':', Line::Name(4)) => self.start_data_line(),
                (_, Line::Name(n)) if b"data".get(usize::from(n)) == Some(&b) => {
                    self.line = Line::Name(n.saturating_add(1));
                }
                (_, Line::Name(_) | Line::Other) => self.line = Line::Other,
            }
            rest = tail;
        }
    }

    fn start_data_line(&mut self) {
        if std::mem::replace(&mut self.has_data, true) {
            self.push_data(b"\n");
        }
        self.line = Line::Space;
    }

    fn push_data(&mut self, bytes: &[u8]) {
        if !self.overflow && !append(&mut self.held, bytes, self.max_bytes) {
            self.overflow = true;
            self.held.clear();
        }
    }

    fn end_line(&mut self) {
        match self.line {
            Line::Name(0) => self.end_event(),
            Line::Name(4) => self.start_data_line(), // `data` without a colon: an empty value
            _ => {}
        }
        self.line = Line::Name(0);
    }

    fn end_event(&mut self) {
        if self.has_data && !self.overflow {
            if let Some(units) = units_from_json(&self.held, &self.path) {
                self.units = Some(units);
            }
        }
        self.held.clear();
        self.has_data = false;
        self.overflow = false;
    }
}

/// Appends `bytes` unless `buf` would then exceed `max` bytes; the capacity never exceeds `max`.
fn append(buf: &mut Vec<u8>, bytes: &[u8], max: usize) -> bool {
    let Some(need) = buf.len().checked_add(bytes.len()).filter(|n| *n <= max) else {
        return false;
    };
    if need > buf.capacity() {
        let target = need.max(buf.capacity().saturating_mul(2)).min(max);
        buf.reserve_exact(target.saturating_sub(buf.len()));
    }
    buf.extend_from_slice(bytes);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    const SSE: BodyFormat = BodyFormat::EventStream;
    const JSON: BodyFormat = BodyFormat::Json;

    fn path(text: &str) -> FieldPath {
        FieldPath::parse(text).unwrap()
    }

    fn json(body: &str, at: &str) -> Option<u64> {
        units_from_json(body.as_bytes(), &path(at))
    }

    /// Feeds `chunks`, checking the memory bound after each one.
    fn read(format: BodyFormat, max: usize, chunks: &[&[u8]]) -> Option<u64> {
        let mut body = BodyUnits::new(format, path("usage.total_tokens"), max);
        for chunk in chunks {
            body.feed(chunk);
            assert!(body.held_bytes() <= max && body.held.capacity() <= max);
        }
        body.finish()
    }

    fn sse_max(max: usize, stream: &str) -> Option<u64> {
        read(SSE, max, &[stream.as_bytes()])
    }

    fn sse(stream: &str) -> Option<u64> {
        sse_max(1024, stream)
    }

    fn usage(n: u64) -> String {
        format!("data: {{\"usage\":{{\"total_tokens\":{n}}}}}\n\n")
    }

    const OPENAI: &str = concat!(
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\r\n\r\n",
        ": keep-alive\r\n\r\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\r\n\r\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,",
        "\"completion_tokens\":12,\"total_tokens\":21}}\r\n\r\n",
        "data: [DONE]\r\n\r\n",
    );

    #[test]
    fn field_paths() {
        assert_eq!(path("choices.0.usage").as_str(), "choices.0.usage");
        for bad in ["", "a..b", ".a", "a.", "."] {
            assert!(FieldPath::parse(bad).is_err(), "{bad:?}");
        }
        assert!(FieldPath::parse(&["a"; MAX_PATH_SEGMENTS].join(".")).is_ok());
        assert!(FieldPath::parse(&["a"; MAX_PATH_SEGMENTS + 1].join(".")).is_err());
        assert!(FieldPath::parse(&"a".repeat(MAX_PATH_BYTES)).is_ok());
        assert!(FieldPath::parse(&"a".repeat(MAX_PATH_BYTES + 1)).is_err());
    }

    #[test]
    fn header_values() {
        let good = ["42", " 7 ", "\t8\r\n", "12.5", "12.000", "0"];
        for (value, want) in good.iter().zip([42, 7, 8, 13, 12, 0]) {
            assert_eq!(units_from_text(value.as_bytes()), Some(want), "{value:?}");
        }
        let bad = [
            "-1", "+1", "abc", "", "1e3", "12.", ".5", "1 2", "NaN", "inf",
        ];
        for value in bad {
            assert_eq!(units_from_text(value.as_bytes()), None, "{value:?}");
        }
        assert_eq!(units_from_text(b"99999999999999999999999"), Some(u64::MAX));
        assert_eq!(units_from_text(b"\xff\xfe"), None);
        assert_eq!(units_from_text(b"4\xff"), None);
    }

    #[test]
    fn json_fields() {
        let openai = r#"{"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}"#;
        assert_eq!(json(openai, "usage.total_tokens"), Some(30));
        assert_eq!(json(openai, "usage.prompt_tokens"), Some(10));
        let arr = r#"{"choices":[{"usage":{"n":1}},{"usage":{"n":2}}],"x":{"1":7}}"#;
        assert_eq!(json(arr, "choices.1.usage.n"), Some(2));
        assert_eq!(json(arr, "choices.2.usage.n"), None);
        assert_eq!(json(arr, "x.1"), Some(7), "digits are a key in an object");
        assert_eq!(json(r#"[[5,6]]"#, "0.1"), Some(6));
        assert_eq!(json(r#"{"us\u0061ge":3}"#, "usage"), Some(3));
        assert_eq!(json(openai, "usage.missing"), None);
        assert_eq!(json(openai, "usage.total_tokens.deeper"), None);
        assert_eq!(json(openai, "usage"), None, "an object is not a number");
        assert_eq!(json(r#"{"n":"30"}"#, "n"), None);
        assert_eq!(json(r#"{"n":-3}"#, "n"), None);
        assert_eq!(json(r#"{"n":-0.5}"#, "n"), None);
        assert_eq!(json(r#"{"n":12.5}"#, "n"), Some(13));
        assert_eq!(json(r#"{"n":1e3}"#, "n"), Some(1000));
        assert_eq!(json(r#"{"n":1e30}"#, "n"), Some(u64::MAX));
        assert_eq!(json(r#"{"n":null}"#, "n"), None);
        assert_eq!(json(r#"{"n":5} trailing"#, "n"), None);
        assert_eq!(json(r#"{"n":5,"m":[1,"#, "n"), None, "truncated");
        assert_eq!(json("not json", "n"), None);
        assert_eq!(json("", "n"), None);
    }

    #[test]
    fn deeply_nested_json_does_not_overflow_the_stack() {
        let deep = "[".repeat(100_000);
        assert_eq!(json(&deep, "0.0.0"), None);
        assert_eq!(json(&deep, &["0"; MAX_PATH_SEGMENTS].join(".")), None);
        assert_eq!(json(&r#"{"a":"#.repeat(100_000), "a.a"), None);
        let (open, close) = ("[".repeat(5000), "]".repeat(5000));
        let skipped = format!(r#"{{"pad":{open}{close},"n":4}}"#);
        assert_eq!(json(&skipped, "n"), Some(4)); // skipping is not recursive
    }

    #[test]
    fn content_types() {
        let of = |v: &[u8]| BodyFormat::from_content_type(Some(v));
        assert_eq!(of(b"text/event-stream"), SSE);
        assert_eq!(of(b" Text/Event-Stream ; charset=utf-8"), SSE);
        assert_eq!(of(b"application/json"), JSON);
        assert_eq!(of(b"text/event-streamx"), JSON);
        assert_eq!(BodyFormat::from_content_type(None), JSON);
    }

    #[test]
    fn json_body_in_chunks_and_over_the_limit() {
        let body = br#"{"usage":{"total_tokens":30},"pad":"xxxxxxxxxxxxxxxx"}"#;
        let (head, tail) = body.split_at(10);
        assert_eq!(read(JSON, body.len(), &[head, tail]), Some(30));
        assert_eq!(read(JSON, body.len() - 1, &[head, tail]), None);
        assert_eq!(read(JSON, 40, &[body]), None); // though the field is in the first 40
        assert_eq!(read(JSON, 40, &[]), None);
    }

    #[test]
    fn event_stream_openai_shape() {
        assert_eq!(sse(OPENAI), Some(21));
        assert_eq!(sse(&OPENAI.replace("\r\n", "\n")), Some(21));
        assert_eq!(sse(&OPENAI.replace("\r\n", "\r")), Some(21));
        assert_eq!(sse(&OPENAI.replace("total_tokens", "other")), None);
    }

    #[test]
    fn event_stream_split_at_every_byte_boundary() {
        let bytes = OPENAI.as_bytes();
        for k in 0..=bytes.len() {
            let (a, b) = bytes.split_at(k);
            assert_eq!(read(SSE, 256, &[a, b]), Some(21), "at {k}");
        }
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(read(SSE, 256, &singles), Some(21));
    }

    #[test]
    fn event_stream_skips_events_larger_than_the_limit() {
        let pad = "x".repeat(200);
        let big = format!("data: {{\"usage\":{{\"total_tokens\":999}},\"pad\":\"{pad}\"}}\n\n");
        assert_eq!(sse_max(40, &format!("{big}{}", usage(9))), Some(9));
        let stream = format!("{}{big}", usage(5));
        assert_eq!(sse_max(40, &stream), Some(5));
        let singles: Vec<&[u8]> = stream.as_bytes().chunks(1).collect();
        assert_eq!(read(SSE, 40, &singles), Some(5));
        // The limit counts the joined data, `\n` between lines included.
        let two_lines = "data: {\"usage\":\ndata: {\"total_tokens\":4}}\n\n";
        let joined = "{\"usage\":\n{\"total_tokens\":4}}".len();
        assert_eq!(sse_max(joined - 1, two_lines), None);
        assert_eq!(sse_max(joined, two_lines), Some(4));
    }

    #[test]
    fn event_stream_fields_comments_and_multi_line_data() {
        let multi = "event: u\nid: 3\n: c\ndata: {\"usage\":\ndata: {\"total_tokens\":4}}\n\n";
        assert_eq!(sse(multi), Some(4));
        let event = &usage(6);
        assert_eq!(sse(&format!(":{event}")), None, "a comment");
        assert_eq!(sse(&event.replace("data: ", "data:")), Some(6));
        assert_eq!(sse(&event.replace("data: ", "data:  ")), Some(6));
        assert_eq!(sse(&event.replace("data: ", "datax: ")), None);
        assert_eq!(sse(&event.replace("data: ", "dat: ")), None);
        assert_eq!(sse(&format!("data\n{event}")), Some(6)); // `data` alone: an empty line
        assert_eq!(sse(&multi.replace("\ndata: {", "\n\ndata: {")), None);
        assert_eq!(sse(&format!("{}{}", usage(2), usage(3))), Some(3));
    }

    #[test]
    fn event_stream_last_event_without_blank_line() {
        let event = usage(6);
        for end in ["\n", "", "\r"] {
            assert_eq!(sse(&event.replace("\n\n", end)), Some(6), "{end:?}");
        }
        let mut body = BodyUnits::new(SSE, path("usage.total_tokens"), 64);
        body.feed(event.trim_end().as_bytes());
        assert_eq!((body.finish(), body.finish()), (Some(6), Some(6)));
        assert_eq!(body.held_bytes(), 0);
    }

    /// Bytes that often form meaningful streams, mixed with arbitrary ones.
    fn stream() -> impl Strategy<Value = Vec<u8>> {
        let tokens = "data: |data:|data|{\"usage\":{\"total_tokens\":|7|.5|}}|\n|\r\n|\r|: c| |[";
        let tokens: Vec<Vec<u8>> = tokens.split('|').map(|t| t.as_bytes().to_vec()).collect();
        let token = prop_oneof![
            any::<u8>().prop_map(|b| vec![b]),
            prop::sample::select(tokens)
        ];
        prop::collection::vec(token, 0..60).prop_map(|t| t.concat())
    }

    proptest! {
        #[test]
        fn arbitrary_chunks_never_exceed_the_limit(
            json in any::<bool>(),
            chunks in prop::collection::vec(stream(), 0..8),
            max in 0usize..128,
        ) {
            let chunks: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
            read(if json { JSON } else { SSE }, max, &chunks); // asserts held_bytes() <= max after every feed
        }

        #[test]
        fn text_and_json_never_panic(bytes in stream(), at in "[a-z0-9]{1,3}(\\.[a-z0-9]{1,3}){0,3}") {
            units_from_text(&bytes);
            units_from_json(&bytes, &path(&at));
        }

        #[test]
        fn splitting_an_event_stream_changes_nothing(
            bytes in stream(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
            max in 0usize..96,
        ) {
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks = Vec::new();
            let mut start = 0;
            for p in points.into_iter().chain([bytes.len()]) {
                chunks.push(&bytes[start..p]);
                start = p;
            }
            prop_assert_eq!(read(SSE, max, &chunks), read(SSE, max, &[&bytes]));
        }
    }
}
