//! The bytes of the wasm build's table in shared data: a record's encoding (tagged, with flags
//! for the parts a record carries, so a local policy's record stays small) and a group's (its
//! slots' entries, spliced so that a write re-encodes only the slots that changed).

use super::*;

/// Words of a lease.
pub(super) const LEASE_FIELDS: usize = 23;
/// Bytes of in-flight slots: the epoch and a count per epoch.
pub(super) const SLOTS_BYTES: usize = 8 + 4 * EPOCHS;
/// After the id, at most: flags, the bucket (2 words), the lease, the slots, `evictable_at_ms`.
pub(super) const FIXED_BYTES: usize = 1 + 16 + LEASE_FIELDS * 8 + SLOTS_BYTES + 8;
/// Flags: the record has a bucket / a lease other than the default / slots in flight. A local
/// policy's record has no lease, so it takes 1 + 16 + 8 bytes after its id instead of
/// `FIXED_BYTES`.
pub(super) const HAS_BUCKET: u8 = 1;
pub(super) const HAS_LEASE: u8 = 2;
pub(super) const HAS_SLOTS: u8 = 4;
pub(super) const HAS_COUNTERS: u8 = 8;
pub(super) const HAS_LOG: u8 = 16;
/// Bytes of window counters.
pub(super) const COUNTERS_BYTES: usize = 24;

#[cfg(test)]
pub(super) fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 2 + record.id.len() + FIXED_BYTES);
    encode_into(record, &mut out);
    out
}

/// Appends the record's encoding to `out` (a group is written in one buffer).
pub(super) fn encode_into(record: &Record, out: &mut Vec<u8>) {
    let id = record.id.as_bytes();
    let len = u16::try_from(id.len()).unwrap_or(u16::MAX);
    let id = id.get(..usize::from(len)).unwrap_or(id);
    out.reserve(1 + 2 + id.len() + FIXED_BYTES);
    out.push(TAG_RECORD);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(id);
    let l = &record.lease;
    let has_lease = *l != Lease::default();
    let mut flags = 0;
    if record.bucket.is_some() {
        flags |= HAS_BUCKET;
    }
    if has_lease {
        flags |= HAS_LEASE;
    }
    let has_slots = record.in_flight != Slots::default();
    if has_slots {
        flags |= HAS_SLOTS;
    }
    if record.counters.is_some() {
        flags |= HAS_COUNTERS;
    }
    if record.log.is_some() {
        flags |= HAS_LOG;
    }
    out.push(flags);
    if let Some(bucket) = record.bucket {
        out.extend_from_slice(&bucket.tokens.to_le_bytes());
        out.extend_from_slice(&bucket.updated_ms.to_le_bytes());
    }
    if has_lease {
        encode_lease(l, out);
    }
    if has_slots {
        out.extend_from_slice(&record.in_flight.epoch.to_le_bytes());
        for count in record.in_flight.counts {
            out.extend_from_slice(&count.to_le_bytes());
        }
    }
    if let Some(c) = record.counters {
        for value in [c.window, c.count, c.previous] {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    if let Some(log) = &record.log {
        // At most MAX_LOG_LIMIT entries (the policy's limit bounds it).
        let len = u16::try_from(log.times.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&log.seen_ms.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        for t in log.times.iter().take(usize::from(len)) {
            out.extend_from_slice(&t.to_le_bytes());
        }
    }
    out.extend_from_slice(&record.evictable_at_ms.to_le_bytes());
}

pub(super) fn encode_lease(l: &Lease, out: &mut Vec<u8>) {
    for value in [
        l.tokens,
        l.expires_ms,
        l.seq,
        l.granted,
        l.pending_until_ms,
        l.denied_until_ms,
        l.unavailable_since_ms,
        l.unavailable_until_ms,
        l.window_start_ms,
        l.window_units,
        l.drip_from_ms,
        l.drip_until_ms,
        l.assigned_until_ms,
        l.renew_at_ms,
        l.assigned_at_ms,
        l.prev_seq,
        l.prev_tokens,
        l.prev_expires_ms,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    for value in [
        l.rate_per_s,
        l.drip_per_ms,
        l.drip_carry,
        l.asked_demand_per_s,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.extend_from_slice(&l.debt.to_le_bytes());
}

/// `None` for an empty slot, or bytes that are not a record of this version (treated as empty).
pub(super) fn decode(bytes: &[u8]) -> Option<Record> {
    let mut record = Record::fresh("");
    decode_into(bytes, None, &mut record)?;
    Some(record)
}

/// Decodes into `out`, reusing its id's buffer (a transaction's records are kept per thread).
/// `known_id`: the id the caller has already compared with the record's bytes, copied without
/// checking its UTF-8 again. On `None` (not a record of this version) `out` is left partly
/// written: the caller discards it.
pub(super) fn decode_into(bytes: &[u8], known_id: Option<&str>, out: &mut Record) -> Option<()> {
    let (&tag, rest) = bytes.split_first()?;
    if tag != TAG_RECORD {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    let rest = rest.get(2..)?;
    let id_bytes = rest.get(..len)?;
    let id = match known_id {
        Some(known) if known.as_bytes() == id_bytes => known,
        _ => std::str::from_utf8(id_bytes).ok()?,
    };
    let (&flags, fixed) = rest.get(len..)?.split_first()?;
    let bucket_words = if flags & HAS_BUCKET != 0 { 2 } else { 0 };
    let lease_words = if flags & HAS_LEASE != 0 {
        LEASE_FIELDS
    } else {
        0
    };
    let slots_bytes = if flags & HAS_SLOTS != 0 {
        SLOTS_BYTES
    } else {
        0
    };
    let counters_bytes = if flags & HAS_COUNTERS != 0 {
        COUNTERS_BYTES
    } else {
        0
    };
    let head = (bucket_words + lease_words) * 8 + slots_bytes + counters_bytes;
    let log_bytes = if flags & HAS_LOG != 0 {
        let at = head + 8;
        let len = u16::from_le_bytes(fixed.get(at..at + 2)?.try_into().ok()?);
        10 + usize::from(len) * 8
    } else {
        0
    };
    if flags & !(HAS_BUCKET | HAS_LEASE | HAS_SLOTS | HAS_COUNTERS | HAS_LOG) != 0
        || fixed.len() != head + log_bytes + 8
    {
        return None;
    }
    let word = |i: usize| -> Option<[u8; 8]> { fixed.get(i * 8..i * 8 + 8)?.try_into().ok() };
    let u = |i: usize| word(i).map(u64::from_le_bytes);
    let bucket = if bucket_words > 0 {
        Some(BucketState {
            tokens: f64::from_le_bytes(word(0)?),
            updated_ms: u(1)?,
        })
    } else {
        None
    };
    let lease = if lease_words > 0 {
        decode_lease(fixed.get(bucket_words * 8..)?)?
    } else {
        Lease::default()
    };
    let slots_at = (bucket_words + lease_words) * 8;
    let in_flight = if slots_bytes > 0 {
        decode_slots(fixed.get(slots_at..slots_at + SLOTS_BYTES)?)?
    } else {
        Slots::default()
    };
    let counters_at = slots_at + slots_bytes;
    let counters = if counters_bytes > 0 {
        let word = |i: usize| -> Option<u64> {
            let at = counters_at + i * 8;
            Some(u64::from_le_bytes(fixed.get(at..at + 8)?.try_into().ok()?))
        };
        Some(Counters {
            window: word(0)?,
            count: word(1)?,
            previous: word(2)?,
        })
    } else {
        None
    };
    let log_at = counters_at + counters_bytes;
    let log = if log_bytes > 0 {
        let bytes = fixed.get(log_at..log_at + log_bytes)?;
        let seen_ms = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let times = bytes
            .get(10..)?
            .chunks_exact(8)
            .map(|c| <[u8; 8]>::try_from(c).map(u64::from_le_bytes))
            .collect::<Result<Vec<u64>, _>>()
            .ok()?;
        Some(Log { times, seen_ms })
    } else {
        None
    };
    let last = fixed.get(log_at + log_bytes..)?;
    let evictable_at_ms = u64::from_le_bytes(last.try_into().ok()?);
    // Every field by name: a field added to `Record` fails to compile here until it is decoded.
    let Record {
        id: out_id,
        bucket: out_bucket,
        lease: out_lease,
        in_flight: out_in_flight,
        counters: out_counters,
        log: out_log,
        evictable_at_ms: out_evictable_at_ms,
    } = out;
    out_id.clear();
    out_id.push_str(id);
    *out_bucket = bucket;
    *out_lease = lease;
    *out_in_flight = in_flight;
    *out_counters = counters;
    *out_log = log;
    *out_evictable_at_ms = evictable_at_ms;
    Some(())
}

pub(super) fn decode_slots(bytes: &[u8]) -> Option<Slots> {
    let mut slots = Slots {
        epoch: u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?),
        counts: [0; EPOCHS],
    };
    for (i, count) in slots.counts.iter_mut().enumerate() {
        let at = 8 + i * 4;
        *count = u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?);
    }
    Some(slots)
}

/// A lease from its [`LEASE_FIELDS`] words at the start of `words`.
pub(super) fn decode_lease(words: &[u8]) -> Option<Lease> {
    let word = |i: usize| -> Option<[u8; 8]> { words.get(i * 8..i * 8 + 8)?.try_into().ok() };
    let u = |i: usize| word(i).map(u64::from_le_bytes);
    Some(Lease {
        tokens: u(0)?,
        expires_ms: u(1)?,
        seq: u(2)?,
        granted: u(3)?,
        pending_until_ms: u(4)?,
        denied_until_ms: u(5)?,
        unavailable_since_ms: u(6)?,
        unavailable_until_ms: u(7)?,
        window_start_ms: u(8)?,
        window_units: u(9)?,
        drip_from_ms: u(10)?,
        drip_until_ms: u(11)?,
        assigned_until_ms: u(12)?,
        renew_at_ms: u(13)?,
        assigned_at_ms: u(14)?,
        prev_seq: u(15)?,
        prev_tokens: u(16)?,
        prev_expires_ms: u(17)?,
        rate_per_s: f64::from_le_bytes(word(18)?),
        drip_per_ms: f64::from_le_bytes(word(19)?),
        drip_carry: f64::from_le_bytes(word(20)?),
        asked_demand_per_s: f64::from_le_bytes(word(21)?),
        debt: u(22)?,
    })
}

/// A slot's entry: its length, then the record's bytes (a length of 0 for an empty slot, or
/// a record too long to encode).
pub(super) fn push_entry(out: &mut Vec<u8>, record: Option<&Record>) {
    let at = out.len();
    out.extend_from_slice(&0u16.to_le_bytes());
    let Some(record) = record else {
        return;
    };
    encode_into(record, out);
    match u16::try_from(out.len() - at - 2) {
        Ok(len) => {
            if let Some(prefix) = out.get_mut(at..at + 2) {
                prefix.copy_from_slice(&len.to_le_bytes());
            }
        }
        Err(_) => out.truncate(at + 2),
    }
}

pub(super) fn encode_group(slots: &[Option<Record>]) -> Vec<u8> {
    let mut out = vec![TAG_GROUP];
    for slot in slots {
        push_entry(&mut out, slot.as_ref());
    }
    out
}

/// The group `raw` with the slots `replace` gives a record for re-encoded, and every other
/// slot's entry copied as it was read (an unreadable group's other slots become empty, as
/// they read).
pub(super) fn splice_group<'a>(
    out: &mut Vec<u8>,
    raw: &[u8],
    replace: impl Fn(usize) -> Option<&'a Record>,
) {
    let spans = slot_spans(raw);
    out.clear();
    out.reserve(raw.len() + 64);
    out.push(TAG_GROUP);
    for (slot, span) in spans.iter().enumerate() {
        match replace(slot) {
            Some(record) => push_entry(out, Some(record)),
            None => match span.clone().and_then(|span| raw.get(span)) {
                Some(entry) => {
                    let len = u16::try_from(entry.len()).unwrap_or(0);
                    out.extend_from_slice(&len.to_le_bytes());
                    if len > 0 {
                        out.extend_from_slice(entry);
                    }
                }
                None => out.extend_from_slice(&0u16.to_le_bytes()),
            },
        }
    }
}

/// Where each slot's record bytes are in a group's value, as [`decode_group`] reads them:
/// `None` for an empty slot, and for every slot from the first one that is cut short (or
/// all of them, in a value that is no group).
pub(super) fn slot_spans(bytes: &[u8]) -> [Option<std::ops::Range<usize>>; GROUP_SLOTS] {
    let mut spans: [Option<std::ops::Range<usize>>; GROUP_SLOTS] = Default::default();
    if bytes.first() != Some(&TAG_GROUP) {
        return spans;
    }
    let mut at = 1;
    for span in spans.iter_mut() {
        let Some(len) = bytes
            .get(at..at + 2)
            .and_then(|l| <[u8; 2]>::try_from(l).ok())
        else {
            break;
        };
        let len = usize::from(u16::from_le_bytes(len));
        if bytes.get(at + 2..at + 2 + len).is_none() {
            break;
        }
        if len > 0 {
            *span = Some(at + 2..at + 2 + len);
        }
        at += 2 + len;
    }
    spans
}

/// The id of a record's bytes, without decoding the rest (`None`: not a record of this
/// version).
pub(super) fn entry_id(entry: &[u8]) -> Option<&[u8]> {
    let (&tag, rest) = entry.split_first()?;
    if tag != TAG_RECORD {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    rest.get(2..2 + len)
}

/// The slots of a group; anything unreadable reads as empty slots.
pub(super) fn decode_group(bytes: &[u8]) -> Vec<Option<Record>> {
    let mut slots = vec![None; GROUP_SLOTS];
    let Some((&TAG_GROUP, mut rest)) = bytes.split_first() else {
        return slots;
    };
    for slot in slots.iter_mut() {
        let Some(len) = rest.get(..2).and_then(|l| <[u8; 2]>::try_from(l).ok()) else {
            break;
        };
        let len = usize::from(u16::from_le_bytes(len));
        let Some(entry) = rest.get(2..2 + len) else {
            break;
        };
        *slot = decode(entry);
        rest = rest.get(2 + len..).unwrap_or_default();
    }
    slots
}
