//! A PostgreSQL cluster of a test's own, for what a test cannot do to the
//! shared server: restart it, or start it with settings of its own.
//!
//! Each test that uses it uses a part of it.

#![allow(dead_code)]

use std::fs::OpenOptions;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

/// The PostgreSQL 15 server binaries of the machine (Debian's layout).
const SERVER_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A PostgreSQL cluster of the test's own, on a free port, in a temporary
/// directory; stopped when dropped, however the test ends. Its tools run as
/// the `postgres` user: `initdb` refuses to run as root.
pub struct Cluster {
    dir: TempDir,
    port: u16,
}

impl Cluster {
    /// Starts a cluster with the server settings `settings` (`name = value`).
    pub fn with(settings: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        run(Command::new("chown").arg("postgres:postgres").arg(dir.path()));
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("find a free port")
            .port();
        let cluster = Cluster { dir, port };
        let data = cluster.data();
        cluster.tool(
            "initdb",
            &["-D", &data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"],
        );
        // In the configuration file, not on the command line, so that
        // `ALTER SYSTEM` can still change them.
        let settings: String = settings.iter().map(|setting| format!("{setting}\n")).collect();
        let config = cluster.dir.path().join("data").join("postgresql.conf");
        let mut file = OpenOptions::new()
            .append(true)
            .open(&config)
            .unwrap_or_else(|error| panic!("open {}: {error}", config.display()));
        file.write_all(settings.as_bytes())
            .unwrap_or_else(|error| panic!("write {}: {error}", config.display()));
        cluster.start();
        cluster
    }

    /// Starts a cluster with the default settings.
    pub fn new() -> Cluster {
        Cluster::with(&[])
    }

    fn data(&self) -> String {
        self.path("data")
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().expect("utf-8 path").to_owned()
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs a server tool as `postgres` and panics with its output if it
    /// fails.
    fn tool(&self, name: &str, args: &[&str]) -> Output {
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(Path::new(SERVER_BIN).join(name))
            .args(args)
            .current_dir(self.dir.path()))
    }

    pub fn start(&self) {
        // Durability is not what this test is about: no fsync.
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let (data, log) = (self.data(), self.path("server.log"));
        self.tool(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-o", &options, "-w", "-t", "60", "start"],
        );
    }

    /// Stops the server the way a restart does: clients are disconnected,
    /// transactions in progress are rolled back.
    pub fn stop(&self) {
        let data = self.data();
        self.tool("pg_ctl", &["-D", &data, "-m", "fast", "-w", "-t", "60", "stop"]);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(PathBuf::from(SERVER_BIN).join("pg_ctl"))
            .args(["-D", &self.data(), "-m", "immediate", "-w", "stop"])
            .current_dir(self.dir.path())
            .output();
    }
}

fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("run {command:?}: {error}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
