//! A test that runs itself again as a child process: a worker, a relay or a
//! job that the parent kills mid-flight with SIGKILL, as a crash would, or
//! runs under another clock. The child is this test binary, started with
//! `--exact` and the test's name; it tells itself apart by the url of its
//! parent's database in its environment ([`parent_database`]), and reports
//! on stdout.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use super::wait::PATIENCE;

/// The variable by which a child learns the url of its parent's database.
const PARENT_DATABASE: &str = "IDEMPOTENCY_TEST_PARENT_DATABASE";

/// In the child that a [`Child`] started: the url of the parent's database;
/// `None` in a test that runs as itself.
pub fn parent_database() -> Option<String> {
    std::env::var(PARENT_DATABASE).ok()
}

/// The child process; killed and reaped when dropped, however the test
/// ends, so that none outlives it (a child left alive would keep its
/// transaction open and block dropping the test's database).
pub struct Child {
    process: std::process::Child,
    lines: Receiver<String>,
}

impl Child {
    /// Runs test `test` (its full name, see [`super::test_path`]) as a
    /// child on the database at `database`, which the child finds with
    /// [`parent_database`].
    pub fn start(test: &str, database: &str) -> Child {
        Child::start_with(test, database, |_| {})
    }

    /// As [`Child::start`], with the command set up further by `setup`.
    pub fn start_with(test: &str, database: &str, setup: impl FnOnce(&mut Command)) -> Child {
        let mut command = Command::new(std::env::current_exe().expect("the test binary"));
        command
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(PARENT_DATABASE, database)
            .stdout(Stdio::piped());
        setup(&mut command);
        let mut process = command
            .spawn()
            .unwrap_or_else(|error| panic!("start the child {test}: {error}"));
        // Read to its end on a thread of its own, so that the child's output
        // never fails on a closed pipe while it lives, and a wait for a line
        // can end.
        let stdout = process.stdout.take().expect("the child's stdout");
        let (sender, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Child { process, lines }
    }

    /// The first value `pick` finds in a line of the child's output, from
    /// the line after the last one read; fails if the child ends without
    /// one, or prints none within `within`. `what` names it for the failure.
    pub fn wait_for_within<T>(&mut self, what: &str, within: Duration, mut pick: impl FnMut(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(found) = pick(&line) {
                        return found;
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!("the child did not report {what} within {within:?}"),
                Err(RecvTimeoutError::Disconnected) => panic!("the child ended before it reported {what}"),
            }
        }
    }

    /// [`Child::wait_for_within`] [`PATIENCE`].
    pub fn wait_for<T>(&mut self, what: &str, pick: impl FnMut(&str) -> Option<T>) -> T {
        self.wait_for_within(what, PATIENCE, pick)
    }

    /// Kills the child with SIGKILL and reaps it.
    pub fn kill(&mut self) -> ExitStatus {
        self.process.kill().expect("SIGKILL the child");
        self.wait()
    }

    /// Waits for the child to end, at most [`PATIENCE`].
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.process.try_wait().expect("poll the child") {
                return status;
            }
            assert!(Instant::now() < deadline, "the child did not end within {PATIENCE:?}");
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// In the child: prints `line` on a line of its own for the parent, and
/// waits to be killed.
pub fn report_and_wait_for_the_kill(line: &str) -> ! {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n{line}").expect("write to the parent");
    out.flush().expect("flush to the parent");
    drop(out);
    loop {
        thread::park();
    }
}
