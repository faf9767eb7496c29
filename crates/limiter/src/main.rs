//! The `tollgate-limiter` binary: flags → [`ServerConfig`], logging, serve until SIGTERM or
//! SIGINT, then drain and exit; or `check-policies FILE...` to validate policy documents, or
//! `import-ratelimit CONFIG.yaml...` to convert envoyproxy/ratelimit configurations.

#![forbid(unsafe_code)]

use clap::Parser;
use tollgate_limiter::config::{init_logging, Cli, Command};
use tollgate_limiter::{check, import, serve};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Some(Command::CheckPolicies {
        files,
        explain,
        method,
        path,
        host,
        headers,
        client_ip,
        claims,
    }) = &cli.command
    {
        let sample = explain.then(|| tollgate_limiter::explain::SampleRequest {
            method: method.clone(),
            path: path.clone(),
            host: host.clone(),
            headers: headers.clone(),
            client_ip: client_ip.clone(),
            claims: claims.clone(),
        });
        let report = check::check_files_explaining(files, sample.as_ref());
        print!("{}", report.text);
        return if report.ok {
            std::process::ExitCode::SUCCESS
        } else {
            std::process::ExitCode::FAILURE
        };
    }
    if let Some(Command::ImportRatelimit {
        headers,
        when,
        limiter_cluster,
        trusted_hops,
        files,
    }) = &cli.command
    {
        let mut conditions = std::collections::BTreeMap::<_, Vec<_>>::new();
        for (key, value, condition) in when {
            conditions
                .entry((key.clone(), value.clone()))
                .or_default()
                .push(condition.clone());
        }
        let options = import::Options {
            sources: headers.iter().cloned().collect(),
            conditions,
            limiter_cluster: limiter_cluster.clone(),
            trusted_hops: *trusted_hops,
        };
        let outcome = import::run(files, &options);
        print!("{}", outcome.stdout);
        eprint!("{}", outcome.stderr);
        return if outcome.ok {
            std::process::ExitCode::SUCCESS
        } else {
            std::process::ExitCode::FAILURE
        };
    }
    init_logging(cli.log_format, &cli.log);
    // Before the listener opens: a stop sent as soon as the limiter answers (a readiness
    // probe, then SIGTERM) must find the handlers, not the default action (death by signal).
    let mut signals = ShutdownSignals::install();
    let mut running = match serve(cli.server_config()).await {
        Ok(running) => running,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            eprintln!("tollgate-limiter: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    tokio::select! {
        signal = signals.recv() => {
            tracing::info!(signal, "shutting down");
            running.shutdown().await;
            std::process::ExitCode::SUCCESS
        }
        () = running.stopped() => {
            tracing::error!("HTTP server stopped unexpectedly");
            std::process::ExitCode::FAILURE
        }
    }
}

/// SIGTERM and SIGINT handlers (`None`: they could not be installed).
struct ShutdownSignals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

impl ShutdownSignals {
    fn install() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Self(Some((term, int))),
            _ => {
                tracing::error!("cannot install signal handlers; stop with SIGKILL");
                Self(None)
            }
        }
    }

    /// Resolves on SIGTERM or SIGINT, with the signal's name.
    async fn recv(&mut self) -> &'static str {
        let Some((term, int)) = &mut self.0 else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    }
}
