//! The `idempo` binary as a process, for the tests of its commands.

use std::process::{Command, Output, Stdio};

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
