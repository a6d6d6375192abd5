//! What the overview's charts show: the dashboard samples the queues' depth,
//! the live dead letters and the claims inserted (every 10 s unless
//! `--sample-every` says otherwise), and keeps 15 minutes of samples, in
//! this process only.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempo::ops::{Services, StatusOptions};

/// How far back the charts look.
const KEEP: Duration = Duration::from_secs(15 * 60);

/// One sample.
#[derive(Clone, Default)]
struct Point {
    at: Option<Instant>,
    /// Per queue: ready messages, messages in its RabbitMQ DLQ.
    queues: BTreeMap<String, (u32, u32)>,
    /// Per queue: live dead letters in the table.
    letters: BTreeMap<String, i64>,
    /// Claims ever inserted (PostgreSQL's statistics).
    claims: Option<i64>,
    outbox_pending: i64,
}

/// The samples of the last 15 minutes.
#[derive(Default)]
pub(crate) struct Samples {
    points: Mutex<VecDeque<Point>>,
}

impl Samples {
    /// Takes one sample (a failure leaves a gap).
    pub(crate) async fn take(&self, services: &Services) {
        let Ok(status) = idempo::ops::status(services, &StatusOptions::default()).await else {
            return;
        };
        let mut point = Point {
            at: Some(Instant::now()),
            outbox_pending: status.outbox.map_or(0, |o| o.pending),
            ..Point::default()
        };
        for q in &status.queues {
            point.queues.insert(
                q.queue.clone(),
                (q.ready.unwrap_or(0), q.dlq_ready.unwrap_or(0)),
            );
        }
        for l in status.dead_letters.iter().flatten() {
            *point.letters.entry(l.queue.clone()).or_default() += l.count;
        }
        if let Ok(pool) = services.database().await {
            point.claims = idempo::inbox::claims_inserted(pool).await.ok();
        }
        let mut points = self.points.lock().unwrap_or_else(|p| p.into_inner());
        points.push_back(point);
        while points
            .front()
            .and_then(|p| p.at)
            .is_some_and(|at| at.elapsed() > KEEP)
        {
            points.pop_front();
        }
    }

    /// The charts' HTML: per queue, ready and dead letters; claims per second; outbox pending.
    pub(crate) fn charts(&self) -> String {
        let points = self.points.lock().unwrap_or_else(|p| p.into_inner());
        if points.len() < 2 {
            return "<p class=rule>charts: sampled for 15 minutes; they appear after the second sample</p>".into();
        }
        let mut out = String::from(
            "<section><h2>Last 15 minutes</h2><p class=rule>sampled by this dashboard process</p><table>\
             <tr><th>series</th><th>chart</th><th>now</th></tr>",
        );
        let mut row = |name: &str, values: Vec<f64>| {
            let now = values.last().copied().unwrap_or_default();
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{now:.1}</td></tr>",
                html_escape::encode_text(name),
                sparkline(&values)
            );
        };
        let queues: Vec<String> = points
            .back()
            .map(|p| p.queues.keys().cloned().collect())
            .unwrap_or_default();
        for queue in &queues {
            row(
                &format!("{queue}: ready"),
                points
                    .iter()
                    .map(|p| p.queues.get(queue).map_or(0.0, |q| f64::from(q.0)))
                    .collect(),
            );
            row(
                &format!("{queue}: dead letters"),
                points
                    .iter()
                    .map(|p| {
                        p.queues.get(queue).map_or(0.0, |q| f64::from(q.1))
                            + p.letters.get(queue).copied().unwrap_or(0) as f64
                    })
                    .collect(),
            );
        }
        let rates: Vec<f64> = points
            .iter()
            .zip(points.iter().skip(1))
            .map(|(a, b)| match (a.claims, b.claims, a.at, b.at) {
                (Some(x), Some(y), Some(s), Some(t)) if y >= x => {
                    (y - x) as f64 / t.duration_since(s).as_secs_f64().max(0.001)
                }
                _ => 0.0,
            })
            .collect();
        row("claims/s (all consumers)", rates);
        row(
            "outbox pending",
            points.iter().map(|p| p.outbox_pending as f64).collect(),
        );
        out.push_str("</table></section>");
        out
    }
}

/// A small SVG line of `values`, scaled to its own maximum.
fn sparkline(values: &[f64]) -> String {
    let max = values.iter().copied().fold(0.0f64, f64::max).max(1.0);
    let step = 160.0 / (values.len().max(2) - 1) as f64;
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{:.1},{:.1}", i as f64 * step, 30.0 - v / max * 28.0))
        .collect();
    format!(
        "<svg class=chart viewBox=\"0 0 160 32\" role=img aria-label=\"max {max:.0}\"><polyline points=\"{}\"/></svg>",
        points.join(" ")
    )
}
