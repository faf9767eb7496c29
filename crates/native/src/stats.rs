//! The filter's metrics as Envoy stats of the dynamic module, with the names the wasm build
//! gives them (`tollgate_<what>.policy.<policy>`): one stats_tags entry in the bootstrap turns
//! the policy into a Prometheus label for either build.
//!
//! Stats belong to one filter configuration (a listener update creates another); the hooks
//! of a configuration set it as this thread's current one ([`enter`]) before the engine runs,
//! so the id the engine holds is always used with the configuration that defined it. An id
//! carries the stat's kind in its top bits.

use crate::abi::{self, ConfigEnvoyPtr, ModuleBuffer};
use std::cell::Cell;
use tollgate_engine::metrics::sink::Sink;
use tollgate_engine::metrics::MetricType;

const KIND_SHIFT: u32 = 30;
const COUNTER: u32 = 0;
const GAUGE: u32 = 1;
const HISTOGRAM: u32 = 2;

thread_local! {
    static CURRENT: Cell<ConfigEnvoyPtr> = const { Cell::new(std::ptr::null_mut()) };
}

/// Makes `config` the configuration whose stats this thread's metrics go to.
pub fn enter(config: ConfigEnvoyPtr) {
    CURRENT.with(|c| c.set(config));
}

fn current() -> Option<ConfigEnvoyPtr> {
    let config = CURRENT.with(Cell::get);
    (!config.is_null()).then_some(config)
}

/// The sink installed for the process (see `tollgate_engine::metrics::sink`).
pub struct EnvoyStats;

pub static ENVOY_STATS: EnvoyStats = EnvoyStats;

impl Sink for EnvoyStats {
    fn define(&self, kind: MetricType, name: &str) -> Result<u32, String> {
        let config = current().ok_or("no filter configuration on this thread")?;
        let mut id = 0usize;
        let name = ModuleBuffer::of(name.as_bytes());
        // SAFETY: `config` is the live configuration of the running hook; `name` outlives
        // the call; no labels are passed.
        let (result, tag) = unsafe {
            match kind {
                MetricType::Counter => (
                    abi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                        config,
                        name,
                        std::ptr::null_mut(),
                        0,
                        &mut id,
                    ),
                    COUNTER,
                ),
                MetricType::Gauge => (
                    abi::envoy_dynamic_module_callback_http_filter_config_define_gauge(
                        config,
                        name,
                        std::ptr::null_mut(),
                        0,
                        &mut id,
                    ),
                    GAUGE,
                ),
                MetricType::Histogram => (
                    abi::envoy_dynamic_module_callback_http_filter_config_define_histogram(
                        config,
                        name,
                        std::ptr::null_mut(),
                        0,
                        &mut id,
                    ),
                    HISTOGRAM,
                ),
            }
        };
        if result != abi::METRICS_SUCCESS {
            return Err(format!("Envoy refused the stat (result {result})"));
        }
        let id = u32::try_from(id)
            .ok()
            .filter(|id| *id < 1 << KIND_SHIFT)
            .ok_or("stat id out of range")?;
        Ok(tag << KIND_SHIFT | id)
    }

    fn increment(&self, id: u32, by: i64) {
        let Some(config) = current() else {
            return;
        };
        let envoy_id = (id & ((1 << KIND_SHIFT) - 1)) as usize;
        let value = by.unsigned_abs();
        // SAFETY: as in `define`; the id was defined on this configuration.
        unsafe {
            match id >> KIND_SHIFT {
                COUNTER => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                        config,
                        envoy_id,
                        std::ptr::null_mut(),
                        0,
                        value,
                    );
                }
                GAUGE if by >= 0 => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                        config,
                        envoy_id,
                        std::ptr::null_mut(),
                        0,
                        value,
                    );
                }
                GAUGE => {
                    abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                        config,
                        envoy_id,
                        std::ptr::null_mut(),
                        0,
                        value,
                    );
                }
                _ => {}
            }
        }
    }

    fn record(&self, id: u32, value: u64) {
        let Some(config) = current() else {
            return;
        };
        if id >> KIND_SHIFT != HISTOGRAM {
            return self.increment(id, i64::try_from(value).unwrap_or(i64::MAX));
        }
        let envoy_id = (id & ((1 << KIND_SHIFT) - 1)) as usize;
        // SAFETY: as in `define`.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
                config,
                envoy_id,
                std::ptr::null_mut(),
                0,
                value,
            );
        }
    }
}
