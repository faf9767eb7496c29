//! The proxy-wasm host behind the engine's host traits: Envoy's shared data for the slot table
//! and Envoy's metrics for the engine's stats.

use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;
use tollgate_engine::metrics::{sink::Sink, MetricType};
use tollgate_engine::shared::{ReadError, SharedData, WriteError};

/// Shared data of the Envoy process, through `proxy_wasm::hostcalls`.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostSharedData;

impl SharedData for HostSharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), ReadError> {
        hostcalls::get_shared_data(key).map_err(|_| ReadError)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), WriteError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|status| {
            if status == Status::CasMismatch {
                WriteError::CasMismatch
            } else {
                WriteError::Host
            }
        })
    }
}

/// The VM's metrics as Envoy stats (`wasmcustom.<name>`).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMetrics;

impl Sink for HostMetrics {
    fn define(&self, kind: MetricType, name: &str) -> Result<u32, String> {
        let kind = match kind {
            MetricType::Counter => proxy_wasm::types::MetricType::Counter,
            MetricType::Gauge => proxy_wasm::types::MetricType::Gauge,
            MetricType::Histogram => proxy_wasm::types::MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).map_err(|status| format!("{status:?}"))
    }

    fn increment(&self, id: u32, by: i64) {
        let _ = hostcalls::increment_metric(id, by);
    }

    fn record(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}
