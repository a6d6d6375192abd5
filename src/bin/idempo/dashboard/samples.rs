//! What the overview shows: the dashboard samples [`Services::status`](idempo::ops::Services::status)
//! (queues, claims, dead letters, outbox, and the consumers' heartbeats with
//! their counters), RabbitMQ's management API when it answers, and
//! PostgreSQL's insert count, every 10 s unless `--sample-every` says
//! otherwise. The overview renders the latest sample (so a page costs no
//! query), and its charts the last 15 minutes of them, kept in this process.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempo::consumer::StatsSnapshot;
use idempo::ops::management::{ManagedQueue, Management};
use idempo::ops::{Services, Status, StatusOptions};

/// How far back the charts look.
const KEEP: Duration = Duration::from_secs(15 * 60);

/// Per second, over the time between two heartbeats of each instance.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Rates {
    pub(crate) deliveries: f64,
    /// Deliveries settled with an ack: processed, duplicates, payload
    /// mismatches, dead-lettered.
    pub(crate) acks: f64,
    pub(crate) retries: f64,
    pub(crate) dead_letters: f64,
    /// Claims committed (handlers that ran and committed).
    pub(crate) claims: f64,
    pub(crate) duplicates: f64,
}

impl Rates {
    fn add(&mut self, a: &StatsSnapshot, b: &StatsSnapshot, secs: f64) {
        // A counter never goes down within one instance; guard anyway.
        let per = |x: u64, y: u64| y.saturating_sub(x) as f64 / secs;
        self.deliveries += per(a.deliveries, b.deliveries);
        self.acks += per(
            a.processed + a.duplicates + a.payload_mismatches + a.dead_lettered,
            b.processed + b.duplicates + b.payload_mismatches + b.dead_lettered,
        );
        self.retries += per(a.retried, b.retried);
        self.dead_letters += per(a.dead_lettered, b.dead_lettered);
        self.claims += per(a.processed, b.processed);
        self.duplicates += per(a.duplicates, b.duplicates);
    }
}

/// One queue in one sample.
#[derive(Debug, Clone, Default)]
pub(crate) struct QueuePoint {
    pub(crate) ready: f64,
    pub(crate) unacked: Option<f64>,
    /// In its RabbitMQ DLQ plus live in the table.
    pub(crate) dead: f64,
    pub(crate) rates: Rates,
}

/// One sample, as the charts need it.
#[derive(Debug, Clone)]
struct Point {
    at: Instant,
    queues: BTreeMap<String, QueuePoint>,
    /// Rows inserted into `processed_messages` per second (PostgreSQL's
    /// statistics): every inbox user, also worker loops without a heartbeat.
    inserts: Option<f64>,
    outbox_pending: f64,
}

/// The latest sample whole: what the overview renders.
#[derive(Debug)]
pub(crate) struct Latest {
    pub(crate) taken: Instant,
    pub(crate) status: Status,
    /// Per queue, this sample's figures.
    pub(crate) queues: BTreeMap<String, QueuePoint>,
    /// The management API's answer, or why there is none.
    pub(crate) management: Result<(String, Vec<ManagedQueue>), String>,
}

/// The samples of the last 15 minutes.
pub(crate) struct Samples {
    management: Result<Management, String>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    points: VecDeque<Point>,
    latest: Option<Arc<Latest>>,
    /// Each instance's last counters and when its heartbeat wrote them.
    beats: HashMap<String, (Instant, StatsSnapshot)>,
    /// PostgreSQL's insert count and when it was read.
    inserted: Option<(Instant, i64)>,
}

impl Samples {
    /// Samples asking `management` (or not, with why) besides `status`.
    pub(crate) fn new(management: Result<Management, String>) -> Self {
        Samples {
            management,
            state: Mutex::default(),
        }
    }

    /// The latest sample, taking one first if there is none yet.
    pub(crate) async fn latest(&self, services: &Services) -> Result<Arc<Latest>, String> {
        if let Some(latest) = self.lock().latest.clone() {
            return Ok(latest);
        }
        self.take(services).await?;
        self.lock().latest.clone().ok_or_else(|| "no sample".into())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one sample (a failure leaves a gap in the charts and keeps the
    /// previous sample on the overview).
    pub(crate) async fn take(&self, services: &Services) -> Result<(), String> {
        let management = async {
            match &self.management {
                Ok(api) => api
                    .queues()
                    .await
                    .map(|queues| (api.url().to_owned(), queues))
                    .map_err(|e| e.to_string()),
                Err(why) => Err(why.clone()),
            }
        };
        let inserted = async {
            match services.database().await {
                Ok(pool) => idempo::inbox::ConsumerClaims::inserted_total(pool)
                    .await
                    .ok(),
                Err(_) => None,
            }
        };
        let options = StatusOptions::default();
        let (status, management, inserted) =
            tokio::join!(services.status(&options), management, inserted);
        let status = status.map_err(|e| e.to_string())?;
        let now = Instant::now();
        let mut state = self.lock();

        let mut queues: BTreeMap<String, QueuePoint> = BTreeMap::new();
        for q in &status.queues {
            let point = queues.entry(q.queue.clone()).or_default();
            point.ready = f64::from(q.ready.unwrap_or(0));
            // JetStream says it with the depth; RabbitMQ's below, if asked.
            point.unacked = q.unacked.map(f64::from);
            point.dead += f64::from(q.dlq_ready.unwrap_or(0));
        }
        for l in status.dead_letters.iter().flatten() {
            queues.entry(l.queue.clone()).or_default().dead += l.count as f64;
        }
        if let Ok((_, managed)) = &management {
            for m in managed {
                if let Some(point) = queues.get_mut(&m.name) {
                    point.unacked = Some(m.unacked as f64);
                }
            }
        }
        let mut beats = HashMap::new();
        for i in status.instances.iter().flatten() {
            let beat = now - Duration::from_secs_f64(i.seen_secs_ago);
            if let Some((before, counters)) = state.beats.get(&i.instance) {
                let secs = beat.saturating_duration_since(*before).as_secs_f64();
                if secs > 0.5 {
                    queues.entry(i.queue.clone()).or_default().rates.add(
                        counters,
                        &i.counters,
                        secs,
                    );
                    beats.insert(i.instance.clone(), (beat, i.counters));
                    continue;
                }
                // The same heartbeat as last time: keep its time, and rate
                // it at the next one.
                beats.insert(i.instance.clone(), (*before, *counters));
                continue;
            }
            beats.insert(i.instance.clone(), (beat, i.counters));
        }
        state.beats = beats;
        let inserts = match (state.inserted, inserted) {
            (Some((t, x)), Some(y)) if y >= x => {
                Some((y - x) as f64 / now.duration_since(t).as_secs_f64().max(0.001))
            }
            _ => None,
        };
        state.inserted = inserted.map(|n| (now, n));
        state.points.push_back(Point {
            at: now,
            queues: queues.clone(),
            inserts,
            outbox_pending: status.outbox.map_or(0.0, |o| o.pending as f64),
        });
        while state.points.front().is_some_and(|p| p.at.elapsed() > KEEP) {
            state.points.pop_front();
        }
        state.latest = Some(Arc::new(Latest {
            taken: now,
            status,
            queues,
            management,
        }));
        Ok(())
    }

    /// The charts: per queue, its rates and depths; then every inbox's
    /// inserts and the outbox's pending messages. Each series with its
    /// latest value.
    pub(crate) fn charts(&self) -> Vec<(String, Vec<f64>)> {
        let state = self.lock();
        let points = &state.points;
        if points.len() < 2 {
            return Vec::new();
        }
        let queues: Vec<String> = points
            .back()
            .map(|p| p.queues.keys().cloned().collect())
            .unwrap_or_default();
        let mut series = Vec::new();
        let mut add = |name: String, get: &dyn Fn(&Point) -> Option<f64>| {
            let values: Vec<f64> = points
                .iter()
                .skip(1)
                .map(|p| get(p).unwrap_or(0.0))
                .collect();
            series.push((name, values));
        };
        for queue in &queues {
            let q = |p: &Point| p.queues.get(queue).cloned();
            add(format!("{queue}: deliveries/s"), &|p| {
                q(p).map(|q| q.rates.deliveries)
            });
            add(format!("{queue}: acks/s"), &|p| q(p).map(|q| q.rates.acks));
            add(format!("{queue}: retries/s"), &|p| {
                q(p).map(|q| q.rates.retries)
            });
            add(format!("{queue}: dead letters/s"), &|p| {
                q(p).map(|q| q.rates.dead_letters)
            });
            add(format!("{queue}: claims/s"), &|p| {
                q(p).map(|q| q.rates.claims)
            });
            add(format!("{queue}: duplicates/s"), &|p| {
                q(p).map(|q| q.rates.duplicates)
            });
            add(format!("{queue}: ready"), &|p| q(p).map(|q| q.ready));
            if points
                .back()
                .and_then(q)
                .is_some_and(|q| q.unacked.is_some())
            {
                add(format!("{queue}: unacked"), &|p| {
                    q(p).and_then(|q| q.unacked)
                });
            }
            add(format!("{queue}: dead letters"), &|p| q(p).map(|q| q.dead));
        }
        add("inbox inserts/s (PostgreSQL, all consumers)".into(), &|p| {
            p.inserts
        });
        add("outbox pending".into(), &|p| Some(p.outbox_pending));
        series
    }
}
