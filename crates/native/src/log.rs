//! The `log` crate's records go to Envoy's log (component `dynamic_modules`).

use crate::abi::{self, ModuleBuffer};
use log::{Level, LevelFilter, Metadata, Record};

struct EnvoyLog;

static LOGGER: EnvoyLog = EnvoyLog;

fn level(level: Level) -> u32 {
    match level {
        Level::Error => abi::LOG_ERROR,
        Level::Warn => abi::LOG_WARN,
        Level::Info => abi::LOG_INFO,
        Level::Debug => abi::LOG_DEBUG,
        Level::Trace => abi::LOG_TRACE,
    }
}

impl log::Log for EnvoyLog {
    fn enabled(&self, metadata: &Metadata) -> bool {
        // SAFETY: a plain query of Envoy's log level.
        unsafe { abi::envoy_dynamic_module_callback_log_enabled(level(metadata.level())) }
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let message = format!("tollgate: {}", record.args());
        // SAFETY: the message outlives the call.
        unsafe {
            abi::envoy_dynamic_module_callback_log(
                level(record.level()),
                ModuleBuffer::of(message.as_bytes()),
            )
        }
    }

    fn flush(&self) {}
}

/// Installs the logger (once per process; later calls do nothing).
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Trace);
    }
}

/// The start check's refusal: to Envoy's log if the host has its log callback (the others
/// are not resolved then), else to stderr.
pub fn refusal(line: &str) {
    let message = format!("tollgate: {line}");
    let log = abi::lookup("envoy_dynamic_module_callback_log");
    if log.is_null() {
        eprintln!("{message}");
        return;
    }
    // SAFETY: the host's `envoy_dynamic_module_callback_log`, declared as in abi.h.
    unsafe {
        let log: unsafe extern "C" fn(u32, ModuleBuffer) = std::mem::transmute(log);
        log(abi::LOG_ERROR, ModuleBuffer::of(message.as_bytes()));
    }
}
