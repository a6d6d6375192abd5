//! The `idempo` binary as a process, for the tests of its commands.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

use super::Db;

/// `idempo` on the schema of `db` and the test broker, stdin closed.
pub fn idempo(db: &Db) -> Command {
    // Known at compile time only to the tests that require feature `cli`.
    let Some(binary) = option_env!("CARGO_BIN_EXE_idempo") else {
        panic!("the idempo binary is built with feature cli (cargo test --all-features)");
    };
    let mut command = Command::new(binary);
    command
        .env("DATABASE_URL", &db.url)
        .env("AMQP_URL", super::amqp_url())
        .stdin(Stdio::null());
    command
}

/// Runs `idempo args`, printing what it said (shown when a test fails).
pub fn run(db: &Db, args: &[&str]) -> Output {
    let out = idempo(db).args(args).output().expect("run idempo");
    eprintln!(
        "idempo {args:?} -> {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Each line of its output as JSON.
pub fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

/// A schema with idempo's and the payments tables and a small pool (the
/// example and the binary run beside it); the example built first (a build
/// while a broker connection is open could miss its heartbeats).
pub async fn payments_db() -> Db {
    super::payments_example_binary();
    let db = Db::with_pool_size(4).await;
    idempo::migrate(&db.pool).await.unwrap();
    super::payments::create_tables(&db.pool).await.unwrap();
    db
}

/// A running dashboard, killed when dropped.
pub struct Dashboard {
    child: Child,
    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub url: String,
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `idempo dashboard` on a free loopback port with `args`, once it listens.
pub fn dashboard(db: &Db, args: &[&str]) -> Dashboard {
    let mut child = idempo(db)
        .args(["dashboard", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start idempo dashboard");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .trim_end_matches('/')
        .to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{line:?}");
    Dashboard { child, url }
}
