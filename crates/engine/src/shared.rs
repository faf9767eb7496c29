//! The host's shared data (proxy-wasm's one process-wide map per `vm_id`, shared by every
//! Envoy worker) as a small trait: the wasm build implements it with hostcalls, the native
//! build with process memory, unit tests with [`MemorySharedData`].
//!
//! Envoy's semantics, which the table relies on and [`MemorySharedData`] reproduces:
//! a read returns the value with its CAS stamp (never 0 for a present key); a write with CAS 0
//! is unconditional; a write with a non-zero CAS to a *present* key fails with `CasMismatch`
//! unless the stamps match; a write to a *missing* key succeeds whatever CAS is passed.
//! There is no delete.
//!
//! [`StoreAt`] is what the engine and the table are handed for one host event: the store and
//! the event's time, the two things every decision and table transaction needs together.

/// Why a shared-data write did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteError {
    /// Another worker wrote the key since we read it.
    CasMismatch,
    /// The host refused the call.
    Host,
}

/// The host refused a shared-data read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadError;

/// The host's shared key-value map.
pub trait SharedData {
    /// The value and its CAS stamp; `Ok((None, _))` for a missing key.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), ReadError>;
    /// The value into `value` (emptied first; a host that lets the filter copy reuses its
    /// buffer) and its CAS stamp; `Ok(None)` for a missing key.
    fn get_into(&self, key: &str, value: &mut Vec<u8>) -> Result<Option<u32>, ReadError> {
        let (bytes, cas) = self.get(key)?;
        match bytes {
            Some(bytes) => *value = bytes,
            None => value.clear(),
        }
        Ok(cas)
    }
    /// Writes `value` if the key's stamp is still `cas` (see module docs for `None` and
    /// missing keys).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), WriteError>;
}

/// The shared data as one host event sees it: the store the table lives in and the time of the
/// event. Named for what it is, the store *at* a moment: every decision, credit, settlement and
/// table transaction reads and writes the store as of one `now_ms`, so the two travel together
/// (passed by value: two words, no allocation, no extra indirection).
pub struct StoreAt<'a, S: SharedData> {
    pub store: &'a S,
    pub now_ms: u64,
}

impl<'a, S: SharedData> StoreAt<'a, S> {
    pub fn new(store: &'a S, now_ms: u64) -> Self {
        Self { store, now_ms }
    }
}

// By hand: a derive would ask `S: Clone + Copy` of the store itself.
impl<S: SharedData> Clone for StoreAt<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S: SharedData> Copy for StoreAt<'_, S> {}

/// An in-process stand-in with Envoy's semantics, for unit tests and benchmarks of the table
/// logic (feature `memory-shared-data` outside this crate's tests).
#[cfg(any(test, feature = "memory-shared-data"))]
#[derive(Debug, Default)]
pub struct MemorySharedData {
    map: std::cell::RefCell<std::collections::HashMap<String, (Vec<u8>, u32)>>,
    next_cas: std::cell::Cell<u32>,
    /// When set, the next write to this key fails with `CasMismatch` once (simulates a race).
    pub interfere_once: std::cell::RefCell<Option<String>>,
}

#[cfg(any(test, feature = "memory-shared-data"))]
impl MemorySharedData {
    fn stamp(&self) -> u32 {
        let next = self.next_cas.get().wrapping_add(1).max(1);
        self.next_cas.set(next);
        next
    }

    pub fn entries(&self) -> usize {
        self.map.borrow().len()
    }

    pub fn bytes(&self) -> usize {
        self.map
            .borrow()
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

#[cfg(any(test, feature = "memory-shared-data"))]
impl SharedData for MemorySharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), ReadError> {
        Ok(match self.map.borrow().get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn get_into(&self, key: &str, value: &mut Vec<u8>) -> Result<Option<u32>, ReadError> {
        value.clear();
        Ok(match self.map.borrow().get(key) {
            Some((stored, cas)) => {
                value.extend_from_slice(stored);
                Some(*cas)
            }
            None => None,
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), WriteError> {
        if self.interfere_once.borrow().as_deref() == Some(key) {
            self.interfere_once.replace(None);
            let stamp = self.stamp();
            if let Some(entry) = self.map.borrow_mut().get_mut(key) {
                entry.1 = stamp;
            }
            return Err(WriteError::CasMismatch);
        }
        let stamp = self.stamp();
        let mut map = self.map.borrow_mut();
        match map.get_mut(key) {
            Some(entry) => {
                if let Some(cas) = cas.filter(|c| *c != 0) {
                    if cas != entry.1 {
                        return Err(WriteError::CasMismatch);
                    }
                }
                // The value's buffer is reused, as the native build's process store does.
                entry.0.clear();
                entry.0.extend_from_slice(value);
                entry.1 = stamp;
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), stamp));
            }
        }
        Ok(())
    }
}
