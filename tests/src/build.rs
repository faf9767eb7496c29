//! The two builds of the filter the end-to-end suites run against: the proxy-wasm filter
//! (`tollgate.wasm`, loaded by `envoy.filters.http.wasm`) and the native dynamic module
//! (`libtollgate_native.so`, loaded by `envoy.filters.http.dynamic_modules`). The shipped
//! configs use the wasm filter; [`native_config`] turns one into the native build's, the way an
//! operator switches: the filter block changes, the policy document and clusters do not.

use crate::paths;

/// Which build of the filter an Envoy loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    Wasm,
    Native,
}

impl Build {
    /// The config `rendered` (a wasm-filter config made test-ready) for this build.
    pub fn config(self, rendered: String) -> String {
        match self {
            Build::Wasm => rendered,
            Build::Native => native_config(&rendered),
        }
    }

    /// The stat name of a filter metric in this build (`tollgate_allowed.policy.p` becomes
    /// `wasmcustom.tollgate_allowed.policy.p` or `dynamicmodulescustom.…`).
    pub fn stat(self, name: &str) -> String {
        match self {
            Build::Wasm => format!("wasmcustom.{name}"),
            Build::Native => format!("dynamicmodulescustom.{name}"),
        }
    }
}

/// The Envoy config `wasm_config` with its tollgate wasm filter replaced by the native
/// module, same policy document (the `value: |` block) and the same stats tags.
pub fn native_config(wasm_config: &str) -> String {
    let lines: Vec<&str> = wasm_config.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim() == "- name: envoy.filters.http.wasm")
        .expect("the config has no wasm filter");
    let end = start
        + lines[start..]
            .iter()
            .position(|l| l.trim() == "value: |")
            .expect("the wasm filter has no `value: |` configuration");
    let indent = " ".repeat(lines[start].len() - lines[start].trim_start().len());
    let filter = [
        "- name: envoy.filters.http.dynamic_modules",
        "  typed_config:",
        "    \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
        "    dynamic_module_config:",
        "      # libtollgate_native.so, from ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
        "      name: tollgate_native",
        "    filter_name: tollgate",
        "    filter_config:",
        "      \"@type\": type.googleapis.com/google.protobuf.StringValue",
        "      value: |",
    ];
    let mut out: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    out.extend(filter.iter().map(|l| format!("{indent}{l}")));
    out.extend(lines[end + 1..].iter().map(|l| l.to_string()));
    out.join("\n").replace(
        r"regex: '^wasmcustom\.tollgate_",
        r"regex: '^dynamicmodulescustom\.tollgate_",
    ) + "\n"
}

/// The directory holding `libtollgate_native.so`: `$TOLLGATE_NATIVE_DIR`, else the workspace's
/// `native` profile build, built first if it is missing or older than the sources.
pub fn native_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("TOLLGATE_NATIVE_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            paths::cargo_build(&["--profile", "native", "-p", "tollgate-native"]);
            paths::target_dir().join("native")
        });
    assert!(
        dir.join("libtollgate_native.so").is_file(),
        "libtollgate_native.so not found in {}: build it with `just build-native` \
         (or set TOLLGATE_NATIVE_DIR)",
        dir.display()
    );
    dir
}

/// `libtollgate_native.so` built with the test-only feature `panic-injection` (a request
/// header makes a hook panic; `$TOLLGATE_TEST_ABI_VERSION` replaces the ABI version it reports),
/// in a target directory of its own (`target/panic-injection`) so it never replaces the
/// production module; built first if missing or stale. Without LTO, to build faster: a test
/// build, unwinding like the production one.
pub fn panic_injection_module() -> std::path::PathBuf {
    let target = paths::target_dir().join("panic-injection");
    let target_arg = target.to_string_lossy().into_owned();
    paths::cargo_build(&[
        "--profile",
        "native",
        "-p",
        "tollgate-native",
        "--features",
        "panic-injection",
        "--config",
        "profile.native.lto=false",
        "--config",
        "profile.native.codegen-units=16",
        "--target-dir",
        &target_arg,
    ]);
    let module = target.join("native").join("libtollgate_native.so");
    assert!(module.is_file(), "{} was not built", module.display());
    module
}

/// The native build's config `native` (from [`native_config`]) loading the module at `module`
/// by its path instead of by name from the search path.
pub fn with_module_file(native: &str, module: &std::path::Path) -> String {
    let line = native
        .lines()
        .find(|l| l.trim() == "name: tollgate_native")
        .expect("the config loads no module named tollgate_native");
    let indent = &line[..line.len() - line.trim_start().len()];
    native.replace(
        line,
        &format!(
            "{indent}module:\n{indent}  local:\n{indent}    filename: {}",
            module.display()
        ),
    )
}

/// Runs end-to-end tests against both builds: each named test function takes a [`Build`];
/// modules `wasm` and `native` each get a test of that name calling it with their build.
/// Async tests run on a two-thread runtime, like the suites' other tests.
#[macro_export]
macro_rules! both_builds {
    (async: [$($async_test:ident),* $(,)?], sync: [$($sync_test:ident),* $(,)?] $(,)?) => {
        $crate::both_builds!(@one wasm, Wasm, [$($async_test),*], [$($sync_test),*]);
        $crate::both_builds!(@one native, Native, [$($async_test),*], [$($sync_test),*]);
    };
    (@one $module:ident, $build:ident, [$($async_test:ident),*], [$($sync_test:ident),*]) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $async_test() {
                    super::$async_test($crate::build::Build::$build).await
                }
            )*
            $(
                #[test]
                fn $sync_test() {
                    super::$sync_test($crate::build::Build::$build)
                }
            )*
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_config_swaps_only_the_filter() {
        let wasm =
            std::fs::read_to_string(paths::workspace_root().join("envoy/local.yaml")).unwrap();
        let native = native_config(&wasm);
        assert!(!native.contains("envoy.filters.http.wasm"));
        assert!(native.contains("envoy.filters.http.dynamic_modules"));
        assert!(native.contains(r"regex: '^dynamicmodulescustom\.tollgate_"));
        let (_, wasm_block, _) = crate::tollgate::policy_block(&wasm);
        let (_, native_block, _) = crate::tollgate::policy_block(&native);
        assert_eq!(wasm_block, native_block);
        let clusters = |c: &str| c.split_once("\n  clusters:\n").unwrap().1.to_string();
        assert_eq!(clusters(&wasm), clusters(&native));
    }
}
