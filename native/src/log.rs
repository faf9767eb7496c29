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

/// Logs before the logger may be installed (the start checks).
pub fn write(level_: Level, message: &str) {
    let message = format!("tollgate: {message}");
    // SAFETY: the caller checked that the log callback exists; the message outlives the call.
    unsafe {
        abi::envoy_dynamic_module_callback_log(level(level_), ModuleBuffer::of(message.as_bytes()))
    }
}
