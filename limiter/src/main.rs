//! The `tollgate-limiter` binary: flags → [`ServerConfig`], logging, serve until SIGTERM or
//! SIGINT, then drain and exit; or `check-policies FILE...` to validate policy documents.

use clap::Parser;
use tollgate_limiter::config::{init_logging, Cli, Command};
use tollgate_limiter::{check, serve};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Some(Command::CheckPolicies { files }) = &cli.command {
        let report = check::check_files(files);
        print!("{}", report.text);
        return if report.ok {
            std::process::ExitCode::SUCCESS
        } else {
            std::process::ExitCode::FAILURE
        };
    }
    init_logging(cli.log_format, &cli.log);
    let mut running = match serve(cli.server_config()).await {
        Ok(running) => running,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            eprintln!("tollgate-limiter: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    tokio::select! {
        signal = shutdown_signal() => {
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

/// Resolves on SIGTERM or SIGINT, with the signal's name.
async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
