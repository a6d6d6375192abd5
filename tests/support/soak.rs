//! The soak tests' machinery (`tests/soak.rs`): a paced publisher that
//! sends some payments twice, two competing `payments` examples SIGKILLed
//! and restarted at random, broker cuts and terminated database backends,
//! then the settling and the verdict: every payment applied once or
//! dead-lettered, nothing doubled, nothing left in the queue, unacked or
//! pending in the outbox.
//!
//! `IDEMPO_SOAK_SECS` (default 30) is how long the load and the chaos last;
//! `IDEMPO_SOAK_RATE` (default 40) how many payments a second the publisher
//! sends; `IDEMPO_SOAK_SEED` replays a run's random choices.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

use super::Db;
use super::example::{Example, signal, spawn_example_to, wait_exit};

/// The examples' injected failure rate: 0.3 of the attempts roll back.
pub const FAIL_RATE: &str = "0.3";
/// The examples' retry delays (`PAYMENTS_RETRY_DELAYS`).
pub const RETRY_DELAYS: &str = "200ms,1s,2s";
/// The longest of [`RETRY_DELAYS`].
pub const LONGEST_DELAY: Duration = Duration::from_secs(2);
/// `PAYMENTS_MAX_ATTEMPTS`.
pub const MAX_ATTEMPTS: u32 = 4;
/// `PAYMENTS_CONCURRENCY` of each example: its pool holds 2 more, so two
/// examples and the test's own pool of [`TEST_POOL`] stay within the
/// suite's budget of two pools of [`super::POOL_SIZE`] per test.
pub const CONCURRENCY: &str = "3";
/// The test's own connections (checks, the chaos' terminations).
pub const TEST_POOL: u32 = 3;
/// The share of the payments published twice on purpose.
pub const DUPLICATE_SHARE: f64 = 0.1;

/// How long the load and the chaos last: `IDEMPO_SOAK_SECS`, 30 s by default.
pub fn duration() -> Duration {
    let secs = match std::env::var("IDEMPO_SOAK_SECS") {
        Ok(text) => text.trim().parse::<u64>().unwrap_or_else(|e| {
            panic!("IDEMPO_SOAK_SECS={text:?} is not a number of seconds: {e}")
        }),
        Err(_) => 30,
    };
    assert!(secs > 0, "IDEMPO_SOAK_SECS must be at least 1");
    Duration::from_secs(secs)
}

/// Payments a second: `IDEMPO_SOAK_RATE`, 40 by default.
pub fn rate() -> f64 {
    match std::env::var("IDEMPO_SOAK_RATE") {
        Ok(text) => {
            let rate = text
                .trim()
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("IDEMPO_SOAK_RATE={text:?} is not a rate: {e}"));
            assert!(
                rate > 0.0 && rate.is_finite(),
                "IDEMPO_SOAK_RATE must be positive"
            );
            rate
        }
        Err(_) => 40.0,
    }
}

/// The random source of a run, and its seed (`IDEMPO_SOAK_SEED` replays one).
pub fn rng() -> (StdRng, u64) {
    let seed = match std::env::var("IDEMPO_SOAK_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("IDEMPO_SOAK_SEED={text:?} is not a number: {e}")),
        Err(_) => rand::random(),
    };
    (StdRng::seed_from_u64(seed), seed)
}

/// How long the settling may take once the load and the chaos stop: every
/// retry delay of every attempt, a minute more, and `extra` (JetStream's
/// ack wait for what a last kill left in flight).
pub fn settle_bound(extra: Duration) -> Duration {
    LONGEST_DELAY * MAX_ATTEMPTS + Duration::from_secs(60) + extra
}

/// A payment of the soak: `soak-<n>`, its account and amount derived from `n`.
pub fn payment(n: u64) -> (String, String, i64) {
    (
        format!("soak-{n}"),
        format!("acct-{}", n % 8),
        (n % 97 + 1) as i64,
    )
}

/// The account and amount of the payment `id` (of [`payment`]).
fn payment_of(id: &str) -> Option<(String, i64)> {
    let n: u64 = id.strip_prefix("soak-")?.parse().ok()?;
    let (_, account, cents) = payment(n);
    Some((account, cents))
}

/// What one copy's publish took.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sent {
    /// Publishes repeated because the broker did not confirm (a cut).
    pub resends: usize,
    /// The broker took it as a duplicate and dropped it (JetStream's window).
    pub dropped: bool,
}

/// A broker the publisher sends payments to, with confirmation.
pub trait Publish {
    /// Publishes copy `copy` (1, 2, …) of the payment `id` until the broker
    /// confirms it, through cuts.
    fn publish(&mut self, id: &str, copy: u32, body: &[u8]) -> impl Future<Output = Sent>;
}

/// A broker (or the connections to it) that the chaos cuts.
pub trait Cut {
    /// Cuts; returns what it cut (connections closed, servers restarted).
    fn cut(&mut self) -> impl Future<Output = usize>;
}

/// What the publisher sent.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Each payment id, with how many copies of it may have reached the
    /// broker (duplicates and unconfirmed publishes included).
    pub copies: BTreeMap<String, u32>,
    /// Confirmed publishes, second copies included.
    pub publishes: usize,
    /// Payments published twice on purpose.
    pub duplicates: usize,
    /// Publishes repeated after the broker did not confirm them.
    pub resends: usize,
    /// Copies the broker dropped as duplicates (JetStream's window).
    pub dropped: usize,
}

/// Publishes payments at [`rate`] until `stop`, each with probability
/// [`DUPLICATE_SHARE`] a second time after `duplicate_delay` (zero: at once),
/// then publishes the duplicates still due and returns what it sent.
pub async fn publish_until<P: Publish>(
    publisher: &mut P,
    stop: &AtomicBool,
    rng: &mut StdRng,
    duplicate_delay: impl Fn(&mut StdRng) -> Duration,
) -> Ledger {
    let mut ledger = Ledger::default();
    let interval = Duration::from_secs_f64(1.0 / rate());
    let mut due: VecDeque<(Instant, String, Vec<u8>)> = VecDeque::new();
    let mut next = Instant::now();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if next > now {
            tokio::time::sleep_until(next.into()).await;
        } else if now - next > Duration::from_secs(1) {
            // Behind after a cut: carry on at the rate, without a burst.
            next = now;
        }
        next += interval;
        let (id, account, cents) = payment(n);
        n += 1;
        let body = super::payment_body(&account, cents);
        send(publisher, &mut ledger, &id, 1, &body).await;
        if rng.random_bool(DUPLICATE_SHARE) {
            ledger.duplicates += 1;
            let delay = duplicate_delay(rng);
            if delay.is_zero() {
                send(publisher, &mut ledger, &id, 2, &body).await;
            } else {
                // Kept in order of due time: the delays vary, so insert sorted.
                let at = Instant::now() + delay;
                let pos = due.partition_point(|(t, _, _)| *t <= at);
                due.insert(pos, (at, id, body));
            }
        }
        while due.front().is_some_and(|(t, _, _)| *t <= Instant::now()) {
            let (_, id, body) = due.pop_front().expect("checked");
            send(publisher, &mut ledger, &id, 2, &body).await;
        }
    }
    while let Some((at, id, body)) = due.pop_front() {
        tokio::time::sleep_until(at.into()).await;
        send(publisher, &mut ledger, &id, 2, &body).await;
    }
    ledger
}

async fn send<P: Publish>(
    publisher: &mut P,
    ledger: &mut Ledger,
    id: &str,
    copy: u32,
    body: &[u8],
) {
    let sent = publisher.publish(id, copy, body).await;
    ledger.publishes += 1;
    ledger.resends += sent.resends;
    if sent.dropped {
        ledger.dropped += 1;
    }
    *ledger.copies.entry(id.to_owned()).or_default() += 1 + sent.resends as u32;
}

/// The two competing `payments` examples, their logs in a directory of
/// their own (kept when the test fails).
pub struct Workers {
    url: String,
    queue: String,
    env: Vec<(String, String)>,
    procs: Vec<Option<Example>>,
    spawned: usize,
    pub logs: PathBuf,
    /// SIGKILLs the chaos sent.
    pub kills: usize,
    /// Processes that exited without being told to: their logs.
    pub crashes: Vec<String>,
}

impl Workers {
    /// Starts two examples on `queue` with `database_url` and `env` on top
    /// of the soak's settings.
    pub fn start(database_url: &str, queue: &str, env: &[(&str, &str)]) -> Workers {
        let logs = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target/tmp")
            .join(format!("soak-{queue}"));
        std::fs::create_dir_all(&logs).expect("create the soak's log directory");
        let mut all: Vec<(String, String)> = [
            ("PAYMENTS_FAIL_RATE", FAIL_RATE),
            ("PAYMENTS_RETRY_DELAYS", RETRY_DELAYS),
            ("PAYMENTS_DEAD_LETTERS", "table"),
            ("PAYMENTS_CONCURRENCY", CONCURRENCY),
            ("RUST_LOG", "warn"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        all.push(("PAYMENTS_MAX_ATTEMPTS".into(), MAX_ATTEMPTS.to_string()));
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let mut workers = Workers {
            url: database_url.to_owned(),
            queue: queue.to_owned(),
            env: all,
            procs: Vec::new(),
            spawned: 0,
            logs,
            kills: 0,
            crashes: Vec::new(),
        };
        for _ in 0..2 {
            let example = workers.spawn();
            workers.procs.push(Some(example));
        }
        workers
    }

    fn log_path(&self, n: usize) -> PathBuf {
        self.logs.join(format!("example-{n}.log"))
    }

    fn spawn(&mut self) -> Example {
        let path = self.log_path(self.spawned);
        self.spawned += 1;
        let log = std::fs::File::create(&path).expect("create an example's log");
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        spawn_example_to(&self.url, &self.queue, &env, log)
    }

    /// Records (and restarts) a process that exited on its own.
    pub async fn check(&mut self) {
        for i in 0..self.procs.len() {
            let exited = !self.procs[i].as_mut().expect("a process").is_running();
            if exited {
                let example = self.procs[i].take().expect("a process");
                let status = wait_exit(example).await;
                self.crashes.push(format!(
                    "an example exited by itself ({status}); its log: {}",
                    self.logs.display()
                ));
                self.procs[i] = Some(self.spawn());
            }
        }
    }

    /// SIGKILLs one of the two (at random) and starts it again.
    pub async fn kill_one(&mut self, rng: &mut StdRng) {
        self.check().await;
        let i = rng.random_range(0..self.procs.len());
        let example = self.procs[i].take().expect("a process");
        signal(&example, "-KILL");
        let status = wait_exit(example).await;
        assert!(!status.success(), "SIGKILL is not a clean exit");
        self.kills += 1;
        self.procs[i] = Some(self.spawn());
    }

    /// Stops both with SIGTERM: the exit statuses that were not 0.
    pub async fn stop(&mut self) -> Vec<String> {
        let mut bad = Vec::new();
        for example in self.procs.iter_mut().filter_map(Option::take) {
            signal(&example, "-TERM");
            let status = wait_exit(example).await;
            if status.code() != Some(0) {
                bad.push(format!("an example exited with {status} after SIGTERM"));
            }
        }
        bad
    }

    /// The last lines of the logs that say something (WARN and worse).
    pub fn log_tail(&self, lines: usize) -> String {
        let mut out = Vec::new();
        for n in 0..self.spawned {
            let Ok(text) = std::fs::read_to_string(self.log_path(n)) else {
                continue;
            };
            out.extend(
                text.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| format!("[{n}] {l}")),
            );
        }
        let skip = out.len().saturating_sub(lines);
        out[skip..].join("\n")
    }

    /// Removes the logs (after a passing soak).
    pub fn remove_logs(&self) {
        let _ = std::fs::remove_dir_all(&self.logs);
    }
}

/// Terminates every backend of the examples (their connections carry the
/// application name `app`); returns how many.
pub async fn cut_database(admin: &PgPool, app: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()) t",
    )
    .bind(app)
    .fetch_one(admin)
    .await
    .expect("terminate the examples' backends")
}

/// What the chaos did.
#[derive(Debug, Default)]
pub struct Chaos {
    pub kills: usize,
    pub broker_cuts: usize,
    /// Connections closed (RabbitMQ) or servers restarted (JetStream).
    pub cut: usize,
    pub db_cuts: usize,
    pub backends: i64,
}

fn secs(rng: &mut StdRng, range: std::ops::Range<f64>) -> Duration {
    Duration::from_secs_f64(rng.random_range(range))
}

/// Until `until`: SIGKILLs every 5–15 s, broker cuts about every 20 s,
/// database cuts about every 15 s. Sets `stop` when done.
pub async fn chaos<C: Cut>(
    until: Instant,
    stop: &AtomicBool,
    workers: &mut Workers,
    broker: &mut C,
    db: &Db,
    app: &str,
    rng: &mut StdRng,
) -> Chaos {
    let mut done = Chaos::default();
    let start = Instant::now();
    let mut next_kill = start + secs(rng, 5.0..15.0);
    let mut next_cut = start + secs(rng, 15.0..25.0);
    let mut next_db = start + secs(rng, 10.0..20.0);
    loop {
        let next = next_kill.min(next_cut).min(next_db).min(until);
        // Looks for crashed processes at least every second.
        let wake = next.min(Instant::now() + Duration::from_secs(1));
        tokio::time::sleep_until(wake.into()).await;
        workers.check().await;
        let now = Instant::now();
        if now >= until {
            break;
        }
        if now >= next_kill {
            workers.kill_one(rng).await;
            next_kill = Instant::now() + secs(rng, 5.0..15.0);
        }
        if now >= next_cut {
            done.cut += broker.cut().await;
            done.broker_cuts += 1;
            next_cut = Instant::now() + secs(rng, 15.0..25.0);
        }
        if now >= next_db {
            done.backends += cut_database(&db.pool, app).await;
            done.db_cuts += 1;
            next_db = Instant::now() + secs(rng, 10.0..20.0);
        }
    }
    stop.store(true, Ordering::SeqCst);
    done.kills = workers.kills;
    done
}

/// What the database says happened to the payments.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Payment id → rows in `payments`.
    pub applied: BTreeMap<String, i64>,
    /// Payment id → live dead letters and their reasons.
    pub lettered: BTreeMap<String, (i64, String)>,
    /// Outbox rows by state.
    pub outbox: BTreeMap<String, i64>,
}

impl Outcome {
    pub async fn read(db: &Db, queue: &str) -> Outcome {
        let applied = sqlx::query_as::<_, (String, i64)>(
            "SELECT message_id, count(*) FROM payments GROUP BY message_id",
        )
        .fetch_all(&db.pool)
        .await
        .expect("read the payments")
        .into_iter()
        .collect();
        let lettered = sqlx::query_as::<_, (Option<String>, i64, String)>(
            "SELECT message_id, count(*), string_agg(DISTINCT reason, '; ') \
             FROM dead_letters WHERE queue = $1 AND state = 'live' GROUP BY message_id",
        )
        .bind(queue)
        .fetch_all(&db.pool)
        .await
        .expect("read the dead letters")
        .into_iter()
        .map(|(id, n, reason)| (id.unwrap_or_else(|| "<no id>".into()), (n, reason)))
        .collect();
        let outbox =
            sqlx::query_as::<_, (String, i64)>("SELECT state, count(*) FROM outbox GROUP BY state")
                .fetch_all(&db.pool)
                .await
                .expect("read the outbox")
                .into_iter()
                .collect();
        Outcome {
            applied,
            lettered,
            outbox,
        }
    }

    /// Published ids neither applied nor dead-lettered.
    pub fn missing<'a>(&self, ledger: &'a Ledger) -> Vec<&'a str> {
        ledger
            .copies
            .keys()
            .filter(|id| !self.applied.contains_key(*id) && !self.lettered.contains_key(*id))
            .map(String::as_str)
            .collect()
    }

    pub fn outbox(&self, state: &str) -> i64 {
        self.outbox.get(state).copied().unwrap_or(0)
    }
}

/// Waits, at most `bound`, until every published payment is applied or
/// dead-lettered, the outbox has nothing pending and `idle` says the broker
/// holds nothing (ready or unacked). Returns how long it took, or what was
/// still wrong at the bound.
pub async fn settle<F, Fut>(
    db: &Db,
    queue: &str,
    ledger: &Ledger,
    bound: Duration,
    mut idle: F,
) -> Result<Duration, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = (bool, String)>,
{
    let start = Instant::now();
    loop {
        let outcome = Outcome::read(db, queue).await;
        let missing = outcome.missing(ledger);
        let pending = outcome.outbox("pending");
        let (empty, broker) = idle().await;
        if missing.is_empty() && pending == 0 && empty {
            return Ok(start.elapsed());
        }
        if start.elapsed() > bound {
            return Err(format!(
                "not settled after {bound:?}: {} payment(s) neither applied nor dead-lettered \
                 (first: {:?}); outbox {:?}; broker: {broker}",
                missing.len(),
                &missing[..missing.len().min(20)],
                outcome.outbox,
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What the forward destination holds: each message id, with its copies.
pub type Forwarded = BTreeMap<String, usize>;

/// The soak's findings: empty when every payment is applied once or
/// dead-lettered and nothing is left behind.
pub async fn verdict(
    db: &Db,
    queue: &str,
    ledger: &Ledger,
    forwarded: Option<&Forwarded>,
) -> (Outcome, Vec<String>) {
    let outcome = Outcome::read(db, queue).await;
    let mut problems = Vec::new();
    let sample = |ids: &[&str]| format!("{:?}", &ids[..ids.len().min(20)]);

    let missing = outcome.missing(ledger);
    if !missing.is_empty() {
        problems.push(format!(
            "{} payment(s) neither applied nor dead-lettered (lost or stuck): {}",
            missing.len(),
            sample(&missing)
        ));
    }
    let doubled: Vec<&str> = outcome
        .applied
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id.as_str())
        .collect();
    if !doubled.is_empty() {
        problems.push(format!(
            "{} payment(s) applied more than once: {}",
            doubled.len(),
            sample(&doubled)
        ));
    }
    let doubled_rows = super::example::doubled_payments(db).await;
    if doubled_rows as usize != doubled.len() {
        problems.push(format!(
            "the example's doubled check counts {doubled_rows}, the ledger {}",
            doubled.len()
        ));
    }
    // Applied and dead-lettered: a copy that failed out before another copy
    // of the same payment was applied is the one way a sound run gets
    // there (letters are per delivery; the later copy is a new delivery).
    // A payment published once has no such second copy.
    let both: Vec<&str> = outcome
        .lettered
        .keys()
        .filter(|id| outcome.applied.contains_key(*id))
        .filter(|id| ledger.copies.get(*id).is_none_or(|n| *n < 2))
        .map(String::as_str)
        .collect();
    if !both.is_empty() {
        let reasons: Vec<&str> = both
            .iter()
            .map(|id| outcome.lettered[*id].1.as_str())
            .collect();
        problems.push(format!(
            "{} payment(s) published once were both applied and dead-lettered: {} (reasons {:?})",
            both.len(),
            sample(&both),
            &reasons[..reasons.len().min(5)]
        ));
    }
    let unknown: Vec<&str> = outcome
        .applied
        .keys()
        .chain(outcome.lettered.keys())
        .filter(|id| !ledger.copies.contains_key(*id))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        problems.push(format!(
            "{} applied or dead-lettered id(s) were never published: {}",
            unknown.len(),
            sample(&unknown)
        ));
    }
    let letter_rows: Vec<&str> = outcome
        .lettered
        .iter()
        .filter(|(_, (n, _))| *n > 1)
        .map(|(id, _)| id.as_str())
        .collect();
    if !letter_rows.is_empty() {
        problems.push(format!(
            "{} payment(s) have more than one live dead letter (same body: one row expected): {}",
            letter_rows.len(),
            sample(&letter_rows)
        ));
    }
    // The ledger adds up: the balances are the sums of the applied payments.
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for id in outcome.applied.keys() {
        if let Some((account, cents)) = payment_of(id) {
            *expected.entry(account).or_default() += cents;
        }
    }
    let balances = db.balances().await;
    if balances != expected {
        problems.push(format!(
            "the balances do not add up to the applied payments: {balances:?}, expected {expected:?}"
        ));
    }
    // A processing's claim per applied payment; a letter holds its
    // message's claim too (marked `lettered`), one per lettered payment.
    let (processed, held): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE NOT lettered), count(*) FILTER (WHERE lettered) \
         FROM processed_messages",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count the claims");
    if processed as usize != outcome.applied.len() {
        problems.push(format!(
            "{processed} claims of processings in processed_messages for {} applied payments",
            outcome.applied.len()
        ));
    }
    if held as usize != outcome.lettered.len() {
        problems.push(format!(
            "{held} claims held by letters for {} lettered payments",
            outcome.lettered.len()
        ));
    }
    for state in ["pending", "failed"] {
        let n = outcome.outbox(state);
        if n > 0 {
            problems.push(format!("{n} outbox row(s) {state}"));
        }
    }
    if let Some(forwarded) = forwarded {
        let want: BTreeMap<String, &str> = outcome
            .applied
            .keys()
            .map(|id| (crate::support::derived_id(id, "forward"), id.as_str()))
            .collect();
        let absent: Vec<&str> = want
            .iter()
            .filter(|(derived, _)| !forwarded.contains_key(*derived))
            .map(|(_, id)| *id)
            .collect();
        if !absent.is_empty() {
            problems.push(format!(
                "{} applied payment(s) never reached the forward destination: {}",
                absent.len(),
                sample(&absent)
            ));
        }
        let foreign: Vec<&str> = forwarded
            .keys()
            .filter(|id| !want.contains_key(*id))
            .map(String::as_str)
            .collect();
        if !foreign.is_empty() {
            problems.push(format!(
                "{} forwarded message(s) are no applied payment's: {}",
                foreign.len(),
                sample(&foreign)
            ));
        }
    }
    (outcome, problems)
}

/// The copies beyond the first at the forward destination.
pub fn extra_copies(forwarded: &Forwarded) -> usize {
    forwarded.values().map(|n| n.saturating_sub(1)).sum()
}

/// Payments applied although one of their copies was dead-lettered (a
/// later copy of a payment published twice).
pub fn applied_after_a_letter(outcome: &Outcome) -> usize {
    outcome
        .lettered
        .keys()
        .filter(|id| outcome.applied.contains_key(*id))
        .count()
}

/// The one-line summary of a soak, also kept in
/// `$CARGO_TARGET_TMPDIR/soak-figures-<transport>.txt`.
#[allow(clippy::too_many_arguments)]
pub fn summary(
    transport: &str,
    soaked: Duration,
    seed: u64,
    ledger: &Ledger,
    outcome: &Outcome,
    forwarded: Option<&Forwarded>,
    chaos: &Chaos,
    settled: Option<Duration>,
) -> String {
    let forward = match forwarded {
        Some(f) => format!(
            ", forwarded {} (+{} extra copies)",
            f.len(),
            extra_copies(f)
        ),
        None => String::new(),
    };
    let settled = match settled {
        Some(d) => format!("{:.1} s", d.as_secs_f64()),
        None => "NOT settled".into(),
    };
    let lettered: BTreeSet<&String> = outcome.lettered.keys().collect();
    let line = format!(
        "soak {transport}: {} s, seed {seed}; published {} payments ({} publishes: {} duplicates, \
         {} resends after cuts, {} dropped by the broker); applied {}, dead-lettered {} \
         ({} of them applied by a later copy){forward}; {} SIGKILLs, {} broker cuts ({} cut), \
         {} database cuts ({} backends); settled in {settled}",
        soaked.as_secs(),
        ledger.copies.len(),
        ledger.publishes,
        ledger.duplicates,
        ledger.resends,
        ledger.dropped,
        outcome.applied.len(),
        lettered.len(),
        applied_after_a_letter(outcome),
        chaos.kills,
        chaos.broker_cuts,
        chaos.cut,
        chaos.db_cuts,
        chaos.backends,
    );
    let path =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("soak-figures-{transport}.txt"));
    let _ = std::fs::write(&path, format!("{line}\n"));
    line
}

/// RabbitMQ's side of the soak: a confirming publisher that reconnects, the
/// management API (cuts, unacked counts), the forward queue's contents.
pub mod amqp {
    use std::time::{Duration, Instant};

    use futures::StreamExt;
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

    use super::{Cut, Forwarded, Publish, Sent};
    use crate::support::{Broker, ServiceUrl};

    const START_RABBIT: &str = "start it with `rabbitmq-server -detached` (or `docker compose \
         up -d rabbitmq`), or point AMQP_URL at a running broker";
    const ENABLE_MANAGEMENT: &str = "enable RabbitMQ's management plugin with \
         `rabbitmq-plugins enable rabbitmq_management` (the soak reads unacked counts and \
         cuts connections through it, on port 15672 of AMQP_URL's host)";

    /// Publishes through the default exchange with confirms (mandatory,
    /// persistent), on a connection named after the queue, so that the
    /// soak's broker cuts close it too; reconnects after a cut.
    pub struct Publisher {
        url: String,
        name: String,
        queue: String,
        link: Option<(Connection, Channel)>,
    }

    impl Publisher {
        pub fn new(queue: &str) -> Publisher {
            Publisher {
                url: crate::support::amqp_url(),
                name: format!("idempo-soak-publisher:{queue}"),
                queue: queue.to_owned(),
                link: None,
            }
        }

        async fn connect(&self) -> lapin::Result<(Connection, Channel)> {
            let properties =
                ConnectionProperties::default().with_connection_name(self.name.as_str().into());
            let connection = Connection::connect(&self.url, properties).await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok((connection, channel))
        }

        async fn try_publish(&mut self, id: &str, copy: u32, body: &[u8]) -> Result<(), String> {
            if self.link.is_none() {
                self.link = Some(self.connect().await.map_err(|e| e.to_string())?);
            }
            let (_, channel) = self.link.as_ref().expect("connected");
            let mut headers = FieldTable::default();
            headers.insert(
                "soak-copy".into(),
                AMQPValue::LongString(copy.to_string().into()),
            );
            let properties = BasicProperties::default()
                .with_message_id(id.into())
                .with_delivery_mode(2)
                .with_headers(headers);
            let options = BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            };
            let confirm = channel
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    options,
                    body,
                    properties,
                )
                .await
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())?;
            match confirm {
                Confirmation::Ack(None) => Ok(()),
                other => Err(format!("not confirmed: {other:?}")),
            }
        }
    }

    impl Publish for Publisher {
        async fn publish(&mut self, id: &str, copy: u32, body: &[u8]) -> Sent {
            let started = Instant::now();
            let mut sent = Sent::default();
            loop {
                match self.try_publish(id, copy, body).await {
                    Ok(()) => return sent,
                    Err(e) => {
                        assert!(
                            started.elapsed() < Duration::from_secs(120),
                            "RabbitMQ has not confirmed a publish for 2 minutes at {}: {e}\n\
                             {START_RABBIT}",
                            self.url
                        );
                        if let Some((connection, _)) = self.link.take() {
                            let _ = connection.close(200, "soak: publish again".into()).await;
                        }
                        sent.resends += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
    }

    /// A queue as the management API counts it.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Counts {
        pub messages: u64,
        pub ready: u64,
        pub unacked: u64,
        pub consumers: u64,
    }

    /// RabbitMQ's management HTTP API on AMQP_URL's host, port 15672, as
    /// AMQP_URL's user.
    pub struct Management {
        base: String,
        vhost: String,
        user: String,
        password: String,
        client: reqwest::Client,
    }

    impl Management {
        /// Fails the test, saying how to enable it, when the API does not answer.
        pub async fn connect() -> Management {
            let amqp = ServiceUrl::amqp();
            let addr = amqp.addr();
            let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
            let path = url::Url::parse(amqp.as_str())
                .map(|u| u.path().trim_start_matches('/').to_owned())
                .unwrap_or_default();
            let vhost = if path.is_empty() {
                "%2F".to_owned()
            } else {
                path
            };
            let management = Management {
                base: format!("http://{host}:15672/api"),
                vhost,
                user: amqp.user(),
                password: amqp.password().unwrap_or_default(),
                client: reqwest::Client::builder()
                    .timeout(Duration::from_secs(10))
                    .build()
                    .expect("an HTTP client"),
            };
            if let Err(e) = management.get("/overview").await {
                panic!(
                    "RabbitMQ's management API does not answer at {}: {e}\n{ENABLE_MANAGEMENT}",
                    management.base
                );
            }
            management
        }

        async fn get(&self, path: &str) -> Result<serde_json::Value, String> {
            let response = self
                .client
                .get(format!("{}{path}", self.base))
                .basic_auth(&self.user, Some(&self.password))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("GET {path}: HTTP {status}"));
            }
            response.json().await.map_err(|e| e.to_string())
        }

        /// A queue's counts (`None` when it does not exist or the API fails).
        pub async fn queue(&self, name: &str) -> Option<Counts> {
            let q = self
                .get(&format!("/queues/{}/{}", self.vhost, encode(name)))
                .await
                .ok()?;
            let n = |key: &str| q[key].as_u64().unwrap_or(0);
            Some(Counts {
                messages: n("messages"),
                ready: n("messages_ready"),
                unacked: n("messages_unacknowledged"),
                consumers: n("consumers"),
            })
        }

        /// The queues whose name starts with `prefix`.
        pub async fn queues(&self, prefix: &str) -> Vec<String> {
            let Ok(all) = self
                .get(&format!("/queues/{}?columns=name", self.vhost))
                .await
            else {
                return Vec::new();
            };
            all.as_array()
                .into_iter()
                .flatten()
                .filter_map(|q| q["name"].as_str())
                .filter(|name| name.starts_with(prefix))
                .map(str::to_owned)
                .collect()
        }

        /// Closes, from the broker's side, every connection whose name
        /// contains `needle`; returns how many.
        pub async fn close_connections(&self, needle: &str) -> usize {
            let listing = self
                .get("/connections?columns=name,client_properties")
                .await
                .unwrap_or_else(|e| {
                    panic!("list RabbitMQ's connections: {e}\n{ENABLE_MANAGEMENT}")
                });
            let names: Vec<String> = listing
                .as_array()
                .into_iter()
                .flatten()
                .filter(|c| {
                    c["client_properties"]["connection_name"]
                        .as_str()
                        .is_some_and(|n| n.contains(needle))
                })
                .filter_map(|c| c["name"].as_str().map(str::to_owned))
                .collect();
            let mut closed = 0;
            for name in names {
                let response = self
                    .client
                    .delete(format!("{}/connections/{}", self.base, encode(&name)))
                    .basic_auth(&self.user, Some(&self.password))
                    .header("X-Reason", "soak: broker cut")
                    .send()
                    .await;
                // Gone already (a process just killed) is no cut, and no failure.
                if response.is_ok_and(|r| r.status().is_success()) {
                    closed += 1;
                }
            }
            closed
        }
    }

    /// Percent-encodes everything but unreserved characters (a path segment).
    fn encode(text: &str) -> String {
        text.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    }

    /// The soak's RabbitMQ cut: every connection of its processes and of its
    /// publisher (their names carry the queue's).
    pub struct CloseConnections<'a> {
        pub management: &'a Management,
        pub queue: &'a str,
    }

    impl Cut for CloseConnections<'_> {
        async fn cut(&mut self) -> usize {
            self.management.close_connections(self.queue).await
        }
    }

    /// Takes every message off `queue` (nothing publishes to it any more):
    /// each message id with its copies.
    pub async fn drain(broker: &Broker, queue: &str, count: u32) -> Forwarded {
        let channel = broker
            .connection
            .create_channel()
            .await
            .expect("a channel to drain the forward queue");
        channel
            .basic_qos(1000, BasicQosOptions::default())
            .await
            .expect("qos");
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "soak-drain".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume the forward queue");
        let mut forwarded = Forwarded::new();
        let mut taken = 0u32;
        while taken < count {
            let next = tokio::time::timeout(Duration::from_secs(30), consumer.next()).await;
            let Ok(Some(Ok(delivery))) = next else {
                panic!("the forward queue {queue} gave {taken} of its {count} messages");
            };
            taken += 1;
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map_or_else(|| "<no id>".to_owned(), |s| s.to_string());
            *forwarded.entry(id).or_default() += 1;
        }
        let _ = channel.close(200, "drained".into()).await;
        forwarded
    }
}

/// JetStream's side of the soak: a publisher that carries on through
/// server restarts, the restarts, the durable consumer's counts and the
/// forward stream's contents.
#[cfg(feature = "nats")]
pub mod nats {
    use std::time::{Duration, Instant};

    use futures::StreamExt;
    use idempo::nats::async_nats;
    use idempo::nats::async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    use idempo::nats::async_nats::jetstream::{self, Context};
    use rand::Rng;
    use rand::rngs::StdRng;

    use super::{Cut, Forwarded, Publish, Sent};
    use crate::support::nats::{OwnServer, START_NATS};

    /// Publishes to the subject of the stream, `Nats-Msg-Id` the payment's
    /// id, and waits for the PubAck; publishes again until one comes.
    pub struct Publisher {
        pub js: Context,
        pub subject: String,
    }

    impl Publish for Publisher {
        async fn publish(&mut self, id: &str, copy: u32, body: &[u8]) -> Sent {
            let started = Instant::now();
            let mut sent = Sent::default();
            loop {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id);
                headers.insert("soak-copy", copy.to_string().as_str());
                let error = match self
                    .js
                    .publish_with_headers(self.subject.clone(), headers, body.to_vec().into())
                    .await
                {
                    Ok(ack) => match ack.await {
                        Ok(ack) => {
                            sent.dropped = ack.duplicate;
                            return sent;
                        }
                        Err(e) => e.to_string(),
                    },
                    Err(e) => e.to_string(),
                };
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "JetStream has not acknowledged a publish for 2 minutes: {error}; {START_NATS}"
                );
                sent.resends += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// Waits until the server listens on its port.
    pub async fn listening(server: &OwnServer) {
        crate::support::eventually(
            &format!("nats-server listens on {}", server.port),
            Duration::from_secs(30),
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", server.port))
                    .await
                    .is_ok()
            },
        )
        .await;
    }

    /// The soak's JetStream cut: the server killed, down for 0.5–3 s, and
    /// started again on the same store.
    pub struct Restart<'a> {
        pub server: &'a mut OwnServer,
        pub rng: StdRng,
    }

    impl Cut for Restart<'_> {
        async fn cut(&mut self) -> usize {
            self.server.kill();
            let down = Duration::from_secs_f64(self.rng.random_range(0.5..3.0));
            tokio::time::sleep(down).await;
            self.server.restart();
            listening(self.server).await;
            1
        }
    }

    /// The durable consumer's pending and unacknowledged messages, or why
    /// they cannot be read.
    pub async fn consumer_counts(
        js: &Context,
        stream: &str,
        durable: &str,
    ) -> Result<(u64, usize, u64), String> {
        let stream = js.get_stream(stream).await.map_err(|e| e.to_string())?;
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .get_consumer(durable)
            .await
            .map_err(|e| e.to_string())?;
        let info = consumer.info().await.map_err(|e| e.to_string())?;
        Ok((
            info.num_pending,
            info.num_ack_pending,
            info.num_redelivered as u64,
        ))
    }

    /// Every message of `stream`: each `Nats-Msg-Id` with its copies.
    pub async fn read_all(js: &Context, stream: &str) -> Forwarded {
        let mut handle = js.get_stream(stream).await.expect("the forward stream");
        let count = handle.info().await.expect("its info").state.messages;
        let consumer = handle
            .create_consumer(pull::Config {
                ack_policy: AckPolicy::None,
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .expect("a consumer to read the forward stream");
        let mut messages = consumer.messages().await.expect("its messages");
        let mut forwarded = Forwarded::new();
        let mut taken = 0u64;
        while taken < count {
            let next = tokio::time::timeout(Duration::from_secs(30), messages.next()).await;
            let Ok(Some(Ok(message))) = next else {
                panic!("the forward stream {stream} gave {taken} of its {count} messages");
            };
            taken += 1;
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map_or_else(|| "<no id>".to_owned(), |v| v.as_str().to_owned());
            *forwarded.entry(id).or_default() += 1;
        }
        forwarded
    }
}
