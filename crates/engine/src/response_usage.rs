//! The response side of an admitted request: reads what each of its admissions really cost
//! from the response (a header, a trailer, a JSON body or the usage event of a
//! `text/event-stream`), as the response passes, without holding it up. Sans-IO: the glue
//! feeds it the response's headers, body chunks and trailers, and applies what it yields with
//! [`Engine::finish`](crate::engine::Engine::finish).
//!
//! Memory per request is bounded by the policies' `settle.from.body.max_bytes`, whatever the
//! upstream sends.

use crate::engine::{Admission, Engine, Usage};
use tollgate_core::policy::UnitsSource;
use tollgate_core::usage::{units_from_text, BodyFormat, BodyUnits};

enum Reader {
    /// Nothing to read: only an in-flight slot to release.
    Nothing,
    Header(String),
    Trailer(String),
    /// The body reader, once the response headers said what format the body has.
    Body(Option<Box<BodyUnits>>),
}

struct Entry {
    admission: Admission,
    reader: Reader,
    /// Settled already (by what the response said).
    settled: bool,
}

/// What the response has said so far about one request's admissions.
pub struct ResponseUsage {
    entries: Vec<Entry>,
}

/// An admission whose usage is known, to settle now.
pub type Known<'a> = (&'a Admission, Usage);

impl ResponseUsage {
    pub fn new(engine: &Engine, admissions: Vec<Admission>) -> Self {
        let entries = admissions
            .into_iter()
            .map(|admission| {
                let source = engine
                    .policy(admission.policy)
                    .and_then(|p| p.settle.as_ref())
                    .map(|s| &s.source);
                let reader = match source {
                    None => Reader::Nothing,
                    Some(UnitsSource::Header(name)) => Reader::Header(name.clone()),
                    Some(UnitsSource::Trailer(name)) => Reader::Trailer(name.clone()),
                    Some(UnitsSource::Body { .. }) => Reader::Body(None),
                };
                Entry {
                    admission,
                    settled: matches!(reader, Reader::Nothing),
                    reader,
                }
            })
            .collect();
        Self { entries }
    }

    /// Whether the body must be read (some usage is in it).
    pub fn wants_body(&self) -> bool {
        self.entries
            .iter()
            .any(|e| !e.settled && matches!(e.reader, Reader::Body(_)))
    }

    /// The response headers arrived. `header` reads one (lower-case name).
    pub fn on_headers(
        &mut self,
        engine: &Engine,
        header: impl Fn(&str) -> Option<Vec<u8>>,
        end_of_stream: bool,
    ) -> Vec<Known<'_>> {
        let format = if self.wants_body() {
            BodyFormat::from_content_type(header("content-type").as_deref())
        } else {
            BodyFormat::Json
        };
        let mut known = Vec::new();
        for entry in self.entries.iter_mut().filter(|e| !e.settled) {
            let usage = match &mut entry.reader {
                Reader::Header(name) => header(name).and_then(|v| units_from_text(&v)),
                Reader::Body(reader) => {
                    let source = engine
                        .policy(entry.admission.policy)
                        .and_then(|p| p.settle.as_ref())
                        .map(|s| &s.source);
                    if let Some(UnitsSource::Body { path, max_bytes }) = source {
                        *reader = Some(Box::new(BodyUnits::new(format, path.clone(), *max_bytes)));
                    }
                    if !end_of_stream {
                        continue;
                    }
                    None
                }
                Reader::Trailer(_) | Reader::Nothing if !end_of_stream => continue,
                Reader::Trailer(_) | Reader::Nothing => None,
            };
            known.push(settled(entry, usage));
        }
        known
    }

    /// A chunk of the response body; at the end of the stream (no trailers follow) whatever
    /// still waits is settled: a body's usage, a trailer that never came.
    pub fn on_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Vec<Known<'_>> {
        let mut known = Vec::new();
        for entry in self.entries.iter_mut().filter(|e| !e.settled) {
            let usage = match &mut entry.reader {
                Reader::Body(Some(reader)) => {
                    reader.feed(chunk);
                    if !end_of_stream {
                        continue;
                    }
                    reader.finish()
                }
                _ if !end_of_stream => continue,
                _ => None,
            };
            known.push(settled(entry, usage));
        }
        known
    }

    /// The response trailers arrived (the stream ends with them).
    pub fn on_trailers(&mut self, trailer: impl Fn(&str) -> Option<Vec<u8>>) -> Vec<Known<'_>> {
        let mut known = Vec::new();
        for entry in self.entries.iter_mut().filter(|e| !e.settled) {
            let usage = match &mut entry.reader {
                Reader::Trailer(name) => trailer(name).and_then(|v| units_from_text(&v)),
                Reader::Body(Some(reader)) => reader.finish(),
                _ => None,
            };
            known.push(settled(entry, usage));
        }
        known
    }

    /// The stream ended however it ended: every admission not settled yet has no usable actual
    /// cost. Returns each admission once, with its usage if it is still to be settled, for the
    /// glue to settle and release together.
    pub fn on_end(&mut self) -> Vec<(&Admission, Option<Usage>)> {
        self.entries
            .iter_mut()
            .map(|entry| {
                let usage = (!entry.settled).then_some(Usage::Missing);
                entry.settled = true;
                (&entry.admission, usage)
            })
            .collect()
    }
}

/// Marks an entry settled with what the response said (`None`: nothing usable).
fn settled(entry: &mut Entry, units: Option<u64>) -> Known<'_> {
    entry.settled = true;
    entry.reader = Reader::Nothing;
    let entry: &Entry = entry;
    (&entry.admission, units.map_or(Usage::Missing, Usage::Known))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Spent, SHARED_PREFIX};
    use crate::shared::MemorySharedData;
    use crate::table::SlotTable;
    use tollgate_core::policy::Policies;

    fn engine(from: &str) -> Engine {
        let doc = format!(
            r#"{{"policies":[{{"name":"p","key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":10,
               "settle":{{"from":{from}}}}},
               {{"name":"q","key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":10,"max_in_flight":1}}]}}"#
        );
        let store = MemorySharedData::default();
        let table = SlotTable::open(&store, SHARED_PREFIX, 16, 1).unwrap();
        Engine::new(Policies::from_json(doc.as_bytes()).unwrap(), table)
    }

    fn admissions() -> Vec<Admission> {
        [0, 1]
            .into_iter()
            .map(|policy| Admission {
                policy,
                bucket_id: format!("{policy}:all"),
                reserved: 5,
                spent: Spent::Bucket,
                slot: (policy == 1).then_some(0),
            })
            .collect()
    }

    fn headers(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<Vec<u8>> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.as_bytes().to_vec())
        }
    }

    fn usages(known: Vec<Known<'_>>) -> Vec<(usize, Usage)> {
        known.into_iter().map(|(a, u)| (a.policy, u)).collect()
    }

    #[test]
    fn a_header_settles_with_the_headers() {
        let e = engine(r#"{"header":"x-usage"}"#);
        let mut u = ResponseUsage::new(&e, admissions());
        let known = u.on_headers(&e, headers(&[("x-usage", "7")]), false);
        assert_eq!(usages(known), vec![(0, Usage::Known(7))]);
        assert!(!u.wants_body());
        // At the end only the slot is left to release; nothing is settled twice.
        let end: Vec<_> = u.on_end().into_iter().map(|(a, u)| (a.policy, u)).collect();
        assert_eq!(end, vec![(0, None), (1, None)]);
        let mut u = ResponseUsage::new(&e, admissions());
        let known = u.on_headers(&e, headers(&[("x-usage", "-1")]), true);
        assert_eq!(usages(known), vec![(0, Usage::Missing)]);
    }

    #[test]
    fn a_trailer_settles_with_the_trailers_or_is_missing_at_the_end() {
        let e = engine(r#"{"trailer":"x-usage"}"#);
        let mut u = ResponseUsage::new(&e, admissions());
        assert!(u.on_headers(&e, headers(&[]), false).is_empty());
        assert!(u.on_body(b"data", false).is_empty());
        let known = u.on_trailers(headers(&[("x-usage", "12")]));
        assert_eq!(usages(known), vec![(0, Usage::Known(12))]);
        let mut u = ResponseUsage::new(&e, admissions());
        u.on_headers(&e, headers(&[]), false);
        assert_eq!(usages(u.on_body(b"data", true)), vec![(0, Usage::Missing)]);
    }

    #[test]
    fn a_json_or_event_stream_body_settles_at_its_end() {
        let e = engine(r#"{"body":{"field":"usage.total_tokens","max_bytes":100}}"#);
        let mut u = ResponseUsage::new(&e, admissions());
        u.on_headers(&e, headers(&[("content-type", "application/json")]), false);
        assert!(u.wants_body());
        assert!(u.on_body(br#"{"usage":{"total"#, false).is_empty());
        let known = u.on_body(br#"_tokens":31}}"#, true);
        assert_eq!(usages(known), vec![(0, Usage::Known(31))]);
        assert!(!u.wants_body());

        let mut u = ResponseUsage::new(&e, admissions());
        u.on_headers(&e, headers(&[("content-type", "text/event-stream")]), false);
        for _ in 0..50 {
            // Far more than max_bytes in all: only the event at hand is held.
            assert!(u.on_body(b"data: {\"choices\":[]}\n\n", false).is_empty());
        }
        u.on_body(
            b"data: {\"usage\":{\"total_tokens\":9}}\n\ndata: [DONE]\n\n",
            false,
        );
        assert_eq!(usages(u.on_body(b"", true)), vec![(0, Usage::Known(9))]);

        // Reset before the body ended: missing, settled once, at the end.
        let mut u = ResponseUsage::new(&e, admissions());
        u.on_headers(&e, headers(&[]), false);
        u.on_body(b"{\"usage\":", false);
        let end: Vec<_> = u.on_end().into_iter().map(|(a, u)| (a.policy, u)).collect();
        assert_eq!(end, vec![(0, Some(Usage::Missing)), (1, None)]);
    }
}
