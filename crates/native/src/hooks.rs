//! The event hooks Envoy calls, by the names of the ABI. Each runs its body under
//! `catch_unwind`: a panic (there is none on purpose) becomes a logged error, never an unwind
//! into Envoy's C++ frames. A panic in a hook that decides a request (request headers, body,
//! trailers) takes the failure mode of the policies the request matches (`filter::after_panic`:
//! `closed` answers 503, `open` lets it on), never "unlimited", and counts in `tollgate_panics`
//! and the policies' `fail_open` / `fail_closed`; so does one in the scheduled hook of a request
//! still held (waiting for a lease or its shaped turn), which would otherwise stay held until
//! Envoy's timeout; elsewhere (the response, the stream end, the
//! configuration's events) there is nothing left to decide and the hook does nothing more.
//!
//! Pointers: a configuration is an `Arc<NativeConfig>` handed to Envoy with `into_raw` and
//! taken back at `config_destroy`; a filter is a `Box<NativeFilter>` taken back at `destroy`.

#![allow(clippy::missing_safety_doc)]

use crate::abi::{self, ConfigEnvoyPtr, EnvoyBuffer, EnvoyHttpHeader, FilterEnvoyPtr};
use crate::config::{callout_answer, NativeConfig};
use crate::filter::{self, NativeFilter};
use crate::stats;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use tollgate_engine::stream::Flow;

fn guard<T>(default: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(_) => {
            ::log::error!("a tollgate hook panicked (caught); it returns its default");
            default
        }
    }
}

/// Loaded: checks that the host offers every callback the module uses, and refuses to
/// initialise (Envoy unloads the module and rejects the configuration) rather than fail at
/// the first request on a host that lacks one.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    guard(std::ptr::null(), || {
        if let Err(missing) = abi::resolve() {
            let line = format!(
                "refusing to initialise: this host lacks {} of the dynamic-module callbacks the \
                 module was built for (Envoy 1.40, ABI {}): {}",
                missing.len(),
                abi_version(),
                missing.join(", ")
            );
            crate::log::refusal(&line);
            return std::ptr::null();
        }
        crate::log::install();
        if !tollgate_engine::metrics::sink::install(&stats::ENVOY_STATS) {
            ::log::warn!("metrics sink already installed");
        }
        ::log::info!(
            "native module initialised: {} host callbacks present (ABI {})",
            abi::CALLBACKS.len(),
            abi_version()
        );
        reported_abi_version()
    })
}

/// The ABI version string handed to Envoy: [`abi::ABI_VERSION`]; in a test build
/// (feature `panic-injection`) `$TOLLGATE_TEST_ABI_VERSION` when set, so the end-to-end
/// suite can show what Envoy does with a version that is not its own.
fn reported_abi_version() -> *const c_char {
    #[cfg(feature = "panic-injection")]
    {
        static TEST_VERSION: std::sync::OnceLock<Option<std::ffi::CString>> =
            std::sync::OnceLock::new();
        let test_version = TEST_VERSION.get_or_init(|| {
            std::env::var("TOLLGATE_TEST_ABI_VERSION")
                .ok()
                .and_then(|v| std::ffi::CString::new(v).ok())
        });
        if let Some(version) = test_version {
            return version.as_ptr();
        }
    }
    abi::ABI_VERSION.as_ptr().cast()
}

fn abi_version() -> &'static str {
    std::str::from_utf8(abi::ABI_VERSION)
        .unwrap_or_default()
        .trim_end_matches('\0')
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: ConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: Envoy's buffer, valid during this hook.
        let bytes = unsafe { config.bytes() };
        match NativeConfig::new(envoy, bytes) {
            Ok(config) => {
                ::log::info!(
                    "{} policies loaded (version {}), shared table of {} slots",
                    config.engine.policies.policies.len(),
                    config.engine.policies.version,
                    config.engine.policies.local_table.slots
                );
                Arc::into_raw(config).cast()
            }
            Err(reason) => {
                ::log::error!("invalid plugin configuration: {reason}");
                std::ptr::null()
            }
        }
    })
}

/// The configuration behind a module pointer, without taking ownership.
///
/// # Safety
/// `ptr` must come from `config_new` and not be destroyed yet.
unsafe fn config_ref<'a>(ptr: *const c_void) -> Option<&'a NativeConfig> {
    // SAFETY: the caller's guarantee.
    unsafe { ptr.cast::<NativeConfig>().as_ref() }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(ptr: *const c_void) {
    guard((), || {
        if ptr.is_null() {
            return;
        }
        // SAFETY: `ptr` came from `Arc::into_raw` in `config_new`; Envoy destroys it once.
        let config = unsafe { Arc::from_raw(ptr.cast::<NativeConfig>()) };
        stats::enter(config.envoy.0);
        config.shutdown();
        stats::enter(std::ptr::null_mut());
    })
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    event: u64,
) {
    guard((), || {
        // SAFETY: Envoy passes the live configuration.
        if let Some(config) = unsafe { config_ref(ptr) } {
            stats::enter(envoy);
            config.on_scheduled(event);
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    callout: u64,
    result: u32,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
) {
    guard((), || {
        // SAFETY: Envoy passes the live configuration.
        let Some(config) = (unsafe { config_ref(ptr) }) else {
            return;
        };
        stats::enter(envoy);
        let (status, body) = if result == abi::CALLOUT_SUCCESS {
            // SAFETY: Envoy's arrays, valid during this hook.
            unsafe { callout_answer(headers, headers_size, chunks, chunks_size) }
        } else {
            (None, Vec::new())
        };
        config.on_callout_done(callout, status, &body);
    })
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    ptr: *const c_void,
    _envoy: FilterEnvoyPtr,
) -> *const c_void {
    guard(std::ptr::null(), || {
        if ptr.is_null() {
            return std::ptr::null();
        }
        // SAFETY: `ptr` came from `Arc::into_raw`; the count goes up for the filter's clone.
        let config = unsafe {
            Arc::increment_strong_count(ptr.cast::<NativeConfig>());
            Arc::from_raw(ptr.cast::<NativeConfig>())
        };
        Box::into_raw(Box::new(NativeFilter::new(config)))
            .cast_const()
            .cast()
    })
}

/// The filter behind a module pointer, borrowed mutably for the running hook.
///
/// That borrow is unique because of how Envoy 1.40 drives a dynamic-module filter
/// (`DynamicModuleHttpFilter`), which every caller relies on:
/// - one thread: all hooks of a filter run on the worker thread that owns its stream,
///   `scheduled` included (a commit posts the event to that worker's dispatcher); the main
///   thread and the ticker never touch a filter, only its scheduler (`config::Scheduler`);
/// - lifetime: the pointer is ours from `filter_new` until `filter_destroy`, the last hook
///   Envoy calls with it (a scheduled event that arrives later is dropped by Envoy, which
///   checks that the filter is still alive before calling `scheduled`);
/// - no hook inside a hook of the same filter, for the calls the module makes: after
///   `send_response` Envoy runs none of this filter's encode hooks for the local reply (it
///   skips them once the filter sent one), and the `local_reply` hook it does call inline
///   ignores the filter pointer. `continue_decoding` runs the rest of the filter chain inline
///   (a router that answers at once sends its reply through this filter's response hooks
///   within that call), so the `scheduled` hook calls it only after its borrow of the filter
///   has ended.
///
/// # Safety
/// `ptr` must come from `filter_new` and not be destroyed yet, and the caller must be one of
/// the filter's hooks, on Envoy's thread for it, under the rules above.
unsafe fn filter_mut<'a>(ptr: *const c_void) -> Option<&'a mut NativeFilter> {
    // SAFETY: the caller's guarantee: a live `Box<NativeFilter>` from `filter_new`, borrowed by
    // no other hook while this one runs.
    unsafe { ptr.cast::<NativeFilter>().cast_mut().as_mut() }
}

/// Runs `body` on the filter with its configuration's stats current, or `none` when there is
/// no filter (a null pointer).
///
/// # Safety
/// As for [`filter_mut`].
unsafe fn with_filter<T>(
    ptr: *const c_void,
    body: impl FnOnce(&mut NativeFilter) -> T,
    none: impl FnOnce() -> T,
) -> T {
    // SAFETY: the caller's guarantee.
    match unsafe { filter_mut(ptr) } {
        Some(filter) => {
            stats::enter(filter.config.envoy.0);
            body(filter)
        }
        None => none(),
    }
}

/// Runs `body` on the filter, with its configuration's stats current; `default` if it panics.
///
/// # Safety
/// As for [`filter_mut`].
unsafe fn on_filter<T: Copy>(
    ptr: *const c_void,
    default: T,
    body: impl FnOnce(&mut NativeFilter) -> T,
) -> T {
    // SAFETY: the caller's guarantee.
    guard(default, || unsafe { with_filter(ptr, body, || default) })
}

/// Runs the decision of hook `hook` on the filter; a panic gives the request its policies'
/// failure mode ([`filter::after_panic`]).
///
/// # Safety
/// As for [`filter_mut`]; `envoy` is this filter's Envoy pointer, in its own hook.
unsafe fn decide(
    ptr: *const c_void,
    envoy: FilterEnvoyPtr,
    hook: &str,
    body: impl FnOnce(&mut NativeFilter) -> Flow,
) -> Flow {
    let decided = catch_unwind(AssertUnwindSafe(|| {
        let run = |filter: &mut NativeFilter| {
            #[cfg(feature = "panic-injection")]
            filter::inject_panic(envoy, hook);
            body(filter)
        };
        // SAFETY: the caller's guarantee.
        unsafe { with_filter(ptr, run, || Flow::Continue) }
    }));
    if let Ok(flow) = decided {
        return flow;
    }
    ::log::error!(
        "the tollgate {hook} hook panicked; the request takes its policies' failure mode"
    );
    let failed = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller's guarantee (the filter outlives its hooks, a panic or not).
        unsafe {
            with_filter(
                ptr,
                |f| filter::after_panic(&f.config, envoy),
                || filter::refuse_after_panic(envoy),
            )
        }
    }));
    failed.unwrap_or_else(|_| {
        ::log::error!("applying the failure mode panicked too; the request is refused");
        catch_unwind(|| filter::refuse_after_panic(envoy)).unwrap_or(Flow::Pause)
    })
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy passes this filter's pointers.
    let flow = unsafe {
        decide(ptr, envoy, "request_headers", |f| {
            f.on_request_headers(envoy, end_of_stream)
        })
    };
    match flow {
        Flow::Continue => abi::HEADERS_CONTINUE,
        Flow::Pause => abi::HEADERS_STOP_ITERATION,
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy passes this filter's pointers.
    let flow = unsafe {
        decide(ptr, envoy, "request_body", |f| {
            f.on_request_body(envoy, end_of_stream)
        })
    };
    match flow {
        Flow::Continue => abi::BODY_CONTINUE,
        Flow::Pause => abi::BODY_STOP_ITERATION_AND_BUFFER,
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
) -> u32 {
    // SAFETY: Envoy passes this filter's pointers.
    let flow = unsafe {
        decide(ptr, envoy, "request_trailers", |f| {
            f.on_request_trailers(envoy)
        })
    };
    match flow {
        Flow::Continue => abi::TRAILERS_CONTINUE,
        Flow::Pause => abi::TRAILERS_STOP_ITERATION,
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy passes this filter's pointers.
    unsafe {
        on_filter(ptr, abi::HEADERS_CONTINUE, |f| {
            f.on_response_headers(envoy, end_of_stream);
            abi::HEADERS_CONTINUE
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy passes this filter's pointers.
    unsafe {
        on_filter(ptr, abi::BODY_CONTINUE, |f| {
            f.on_response_body(envoy, end_of_stream);
            abi::BODY_CONTINUE
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
) -> u32 {
    // SAFETY: Envoy passes this filter's pointers.
    unsafe {
        on_filter(ptr, abi::TRAILERS_CONTINUE, |f| {
            f.on_response_trailers(envoy);
            abi::TRAILERS_CONTINUE
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
) {
    // SAFETY: Envoy passes this filter's pointers.
    unsafe { on_filter(ptr, (), |f| f.finish(envoy)) }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    envoy: FilterEnvoyPtr,
    ptr: *const c_void,
    _event: u64,
) {
    // The hook of a held request (waiting for a lease or its shaped turn): a panic here must
    // not leave it held until Envoy's timeout. The filter is borrowed only inside each closure:
    // continuing the request runs the rest of the chain, which may call this filter's hooks.
    let ran = catch_unwind(AssertUnwindSafe(|| {
        let run = |filter: &mut NativeFilter| {
            #[cfg(feature = "panic-injection")]
            filter::inject_panic(envoy, "scheduled");
            filter.on_scheduled(envoy)
        };
        // SAFETY: Envoy passes this filter's pointers.
        unsafe { with_filter(ptr, run, || false) }
    }));
    let resume = match ran {
        Ok(resume) => resume,
        Err(_) => {
            ::log::error!(
                "the tollgate scheduled hook panicked; a request still held takes its policies' failure mode"
            );
            let failed = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: as above (the filter outlives its hooks, a panic or not).
                unsafe { with_filter(ptr, |f| f.release_after_panic(envoy), || false) }
            }));
            failed.unwrap_or_else(|_| {
                ::log::error!("applying the failure mode after a panic panicked too");
                false
            })
        }
    };
    if resume {
        // SAFETY: `envoy` is this filter, in its own hook; nothing borrows the filter now.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(ptr: *const c_void) {
    guard((), || {
        if ptr.is_null() {
            return;
        }
        // SAFETY: `ptr` came from `Box::into_raw` in `filter_new`; Envoy destroys it once.
        let mut filter = unsafe { Box::from_raw(ptr.cast::<NativeFilter>().cast_mut()) };
        stats::enter(filter.config.envoy.0);
        // A stream that never completed (a reset) still frees its slots and its scheduler.
        filter.finish(std::ptr::null_mut());
    })
}

// Hooks of features the module does not use: Envoy requires every one of them.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    ::log::error!("tollgate has no per-route configuration");
    std::ptr::null()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _ptr: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _callout: u64,
    _result: u32,
    _headers: *const EnvoyHttpHeader,
    _headers_size: usize,
    _chunks: *const EnvoyBuffer,
    _chunks_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _headers: *const EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _trailers: *const EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _envoy: ConfigEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _headers: *const EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _envoy: ConfigEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _envoy: ConfigEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _trailers: *const EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _envoy: ConfigEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _envoy: ConfigEnvoyPtr,
    _ptr: *const c_void,
    _stream: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
) {
}

/// A local reply goes out as Envoy built it.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _envoy: FilterEnvoyPtr,
    _ptr: *const c_void,
    _code: u32,
    _details: EnvoyBuffer,
    _reset_imminent: bool,
) -> u32 {
    0
}
