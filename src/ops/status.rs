//! [`status()`]: claims, queues, outbox, HTTP keys and window entries at a
//! glance, and the [`Warning`]s among them.

use std::time::Duration;

use serde::{Serialize, Serializer};

use super::warning::Warning;
use super::{OpsError, Result, Services, close, missing_table, queue_depth, undefined_table};
use crate::amqp::topology::delay_queue;
use crate::cleanup::StateCount;
use crate::consumer::RedeliveryPolicy;
use crate::outbox::OutboxStatus;

/// What [`Services::status`] looks at.
///
/// # Default
/// Every consumer with claims, one queue per such consumer (named like it),
/// the default [`RedeliveryPolicy`]'s delays, RabbitMQ's default
/// `consumer_timeout` of 30 minutes, no retention check, DLQs not warned about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusOptions {
    /// Only these consumers (all when empty).
    pub consumers: Vec<String>,
    /// The queues to inspect (when empty: one per consumer with claims, and
    /// a missing one is reported, not an error).
    pub queues: Vec<String>,
    /// The consumers' retry delays (the default policy's when empty): their
    /// delay queues are inspected, and they make up the redelivery horizon.
    pub retry_delays: Vec<Duration>,
    /// The consumers' `max_attempts` (the default policy's when `None`): the
    /// horizon counts every retry at the longest delay.
    pub max_attempts: Option<u32>,
    /// The broker's `consumer_timeout`: the longest a delivery can stay
    /// unacknowledged before the broker redelivers it.
    pub consumer_timeout: Duration,
    /// The claims' retention (the reaper's `older_than`), checked against the
    /// redelivery horizon.
    pub retention: Option<Duration>,
    /// Warn when a DLQ holds messages.
    pub fail_on_dlq: bool,
}

impl Default for StatusOptions {
    fn default() -> Self {
        StatusOptions {
            consumers: Vec::new(),
            queues: Vec::new(),
            retry_delays: Vec::new(),
            max_attempts: None,
            consumer_timeout: Duration::from_secs(30 * 60),
            retention: None,
            fail_on_dlq: false,
        }
    }
}

/// What [`Services::status`] found. Serialises as the `idempo status --json` object
/// (durations in seconds, fields named `..._secs`).
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Status {
    /// The claims of each consumer, by name.
    pub consumers: Vec<ConsumerStatus>,
    /// The queues inspected.
    pub queues: Vec<QueueStatus>,
    /// The outbox (`None`: its table does not exist).
    #[serde(serialize_with = "outbox_json")]
    pub outbox: Option<OutboxStatus>,
    /// HTTP idempotency keys per state (`None`: the table does not exist).
    pub http_keys: Option<Vec<StateCount>>,
    /// Deduplication window entries per state (`None`: the table does not exist).
    pub window: Option<Vec<StateCount>>,
    /// Live dead letters in the table store per consumer, queue and cause
    /// (`None`: the table does not exist).
    pub dead_letters: Option<Vec<crate::dead_letters::model::LetterCount>>,
    /// The consumer processes whose heartbeat was written in the last 15
    /// minutes, running or stopped (`None`: the table does not exist).
    pub instances: Option<Vec<crate::runtime::heartbeat::Instance>>,
    /// What an operator must act on, in the order found.
    pub warnings: Vec<Warning>,
}

impl Status {
    /// Whether there is a warning: the `idempo status` command then exits with 2.
    pub fn needs_attention(&self) -> bool {
        !self.warnings.is_empty()
    }
}

/// One consumer's claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ConsumerStatus {
    /// The consumer.
    pub consumer: String,
    /// How many claims it holds.
    pub claims: i64,
    /// How long ago its oldest claim was made.
    #[serde(rename = "oldest_age_secs", serialize_with = "optional_secs")]
    pub oldest_age: Option<Duration>,
    /// How long ago its newest claim was made.
    #[serde(rename = "newest_age_secs", serialize_with = "optional_secs")]
    pub newest_age: Option<Duration>,
    /// The longest a copy of a message can come back after its first
    /// delivery: the retry delays plus the `consumer_timeout`. Claims must be
    /// kept at least this long.
    #[serde(rename = "redelivery_horizon_secs", serialize_with = "secs")]
    pub redelivery_horizon: Duration,
}

/// One queue, its DLQ and its delay queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct QueueStatus {
    /// The work queue.
    pub queue: String,
    /// Whether it exists.
    pub exists: bool,
    /// Its ready messages.
    pub ready: Option<u32>,
    /// Its messages delivered and not acknowledged yet, where the transport
    /// says without another API (JetStream); `None` for RabbitMQ, whose
    /// count needs the management API.
    pub unacked: Option<u32>,
    /// Its consumers.
    pub consumers: Option<u32>,
    /// The ready messages of its DLQ (`None`: no DLQ).
    pub dlq_ready: Option<u32>,
    /// Its delay queues that exist.
    pub delay_queues: Vec<DelayQueueStatus>,
    /// Where it is: `amqp` (a RabbitMQ queue), or `nats` (a JetStream
    /// stream: `ready` counts what its idempo consumers have not been
    /// delivered yet; it has no DLQ or delay queues).
    pub transport: String,
}

impl QueueStatus {
    /// Its name as the operator tools show it: a RabbitMQ queue by its
    /// name, a JetStream stream as `name (nats stream)`.
    pub fn label(&self) -> String {
        if self.transport == "amqp" {
            self.queue.clone()
        } else {
            format!("{} ({} stream)", self.queue, self.transport)
        }
    }
}

/// One delay queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DelayQueueStatus {
    /// Its name (`<queue>.retry.<delay>`).
    pub queue: String,
    /// Messages waiting for their retry.
    pub ready: u32,
}

fn secs<S: Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(d.as_secs_f64())
}

fn optional_secs<S: Serializer>(d: &Option<Duration>, serializer: S) -> Result<S::Ok, S::Error> {
    d.map(|d| d.as_secs_f64()).serialize(serializer)
}

fn outbox_json<S: Serializer>(o: &Option<OutboxStatus>, serializer: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Json {
        pending: i64,
        failed: i64,
        oldest_pending_age_secs: Option<f64>,
    }
    o.map(|o| Json {
        pending: o.pending,
        failed: o.failed,
        oldest_pending_age_secs: o.oldest_pending_age.map(|d| d.as_secs_f64()),
    })
    .serialize(serializer)
}

/// How far back [`Status::instances`] looks.
const INSTANCES_WITHIN: Duration = Duration::from_secs(15 * 60);

impl Services {
    /// Claims per consumer, queue depths (passive declares: the broker is asked
    /// only when there is a queue to inspect), the outbox, HTTP keys and window
    /// entries, and the [`Warning`]s among them.
    ///
    /// # Errors
    /// [`OpsError::QueueNotFound`] when a queue named in
    /// [`StatusOptions::queues`] does not exist; connection and query errors.
    pub async fn status(&self, options: &StatusOptions) -> Result<Status> {
        let pool = self.database().await?;
        let mut warnings = Vec::new();
        let delays = if options.retry_delays.is_empty() {
            RedeliveryPolicy::default().delays().to_vec()
        } else {
            options.retry_delays.clone()
        };
        let max_attempts = options
            .max_attempts
            .unwrap_or(RedeliveryPolicy::default().max_attempts);
        let retries = RedeliveryPolicy::delayed(delays.clone())
            .max_attempts(max_attempts)
            .total_delay();
        let horizon = retries + options.consumer_timeout;

        // The database's questions side by side (the pool has two connections),
        // then the broker's beside the rest.
        let (claims, dead_letters, sealed, instances) = tokio::join!(
            crate::inbox::ConsumerClaims::list(pool, &options.consumers),
            crate::dead_letters::queries::counts(pool),
            crate::amqp::consumers_with_keys(pool),
            crate::runtime::heartbeat::instances(pool, INSTANCES_WITHIN),
        );
        let instances: Option<Vec<_>> = match instances {
            Ok(found) => Some(
                found
                    .into_iter()
                    .filter(|i| {
                        options.consumers.is_empty() || options.consumers.contains(&i.consumer)
                    })
                    .collect(),
            ),
            Err(e) if missing_table(&e) => None,
            Err(e) => return Err(e.into()),
        };
        let claims = match claims {
            Ok(claims) => claims,
            Err(e) if missing_table(&e) => {
                warnings.push(Warning::NotMigrated);
                Vec::new()
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(retention) = options.retention
            && retention < horizon
        {
            warnings.push(Warning::RetentionTooShort {
                retention,
                horizon,
                retries,
                consumer_timeout: options.consumer_timeout,
            });
        }
        let dead_letters = match dead_letters {
            Ok(counts) => Some(counts),
            Err(e) if missing_table(&e) => None,
            Err(e) => return Err(e.into()),
        };
        let names: Vec<String> = if options.queues.is_empty() {
            // Every consumer seen: with claims, with a key (it sealed a retry or
            // dead-letter copy), or with letters in the table; and the queues of
            // the processes that wrote a heartbeat.
            let mut names: Vec<String> = claims.iter().map(|c| c.consumer.clone()).collect();
            let lettered = dead_letters.iter().flatten().map(|c| c.queue.clone());
            let wanted =
                |name: &String| options.consumers.is_empty() || options.consumers.contains(name);
            for name in sealed.unwrap_or_default().into_iter().chain(lettered) {
                if wanted(&name) && !names.contains(&name) {
                    names.push(name);
                }
            }
            for name in instances.iter().flatten().map(|i| i.queue.clone()) {
                if wanted(&name) && !names.contains(&name) {
                    names.push(name);
                }
            }
            names
        } else {
            options.queues.clone()
        };
        if options.fail_on_dlq {
            let mut per_queue: Vec<(String, i64)> = Vec::new();
            for c in dead_letters.iter().flatten() {
                match per_queue.iter_mut().find(|(q, _)| *q == c.queue) {
                    Some((_, n)) => *n += c.count,
                    None => per_queue.push((c.queue.clone(), c.count)),
                }
            }
            for (queue, count) in per_queue {
                warnings.push(Warning::TableDeadLetters { queue, count });
            }
        }
        // JetStream streams are asked of NATS, the rest of RabbitMQ.
        let streams: Vec<(String, Vec<String>)> = instances
            .iter()
            .flatten()
            .filter(|i| i.transport == "nats" && names.contains(&i.queue))
            .fold(Vec::new(), |mut streams, i| {
                match streams.iter_mut().find(|(s, _)| *s == i.queue) {
                    Some((_, durables)) if !durables.contains(&i.consumer) => {
                        durables.push(i.consumer.clone());
                    }
                    Some(_) => {}
                    None => streams.push((i.queue.clone(), vec![i.consumer.clone()])),
                }
                streams
            });
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| !streams.iter().any(|(s, _)| s == n))
            .collect();
        let broker = async {
            let mut found = Vec::new();
            if names.is_empty() {
                return Ok((Vec::new(), found));
            }
            let connection = self.broker().await?;
            let inspected = inspect(&connection, &names, &delays, options, &mut found).await;
            close(&connection).await;
            inspected.map(|queues| (queues, found))
        };
        let http_store = crate::http::PostgresStore::new(pool.clone());
        let window_store = crate::window::PostgresWindow::new(pool.clone());
        let (inspected, outbox, http_keys, window) = tokio::join!(
            broker,
            crate::outbox::OutboxStatus::read(pool),
            http_store.count_by_state(),
            window_store.count_by_state(),
        );
        let (mut queues, queue_warnings) = inspected?;
        warnings.extend(queue_warnings);
        queues.extend(stream_statuses(self, &streams).await);

        let outbox = match outbox {
            Ok(outbox) => Some(outbox),
            Err(e) if undefined_table(&e) => None,
            Err(e) => return Err(e.into()),
        };
        if let Some(outbox) = outbox
            && outbox.failed > 0
        {
            warnings.push(Warning::OutboxFailed {
                failed: outbox.failed,
            });
        }
        let absent = |counts: crate::Result<Vec<StateCount>>| match counts {
            Ok(counts) => Ok(Some(counts)),
            Err(e) if missing_table(&e) => Ok(None),
            Err(e) => Err(OpsError::from(e)),
        };
        let http_keys = absent(http_keys)?;
        let window = absent(window)?;

        Ok(Status {
            consumers: claims
                .into_iter()
                .map(|c| ConsumerStatus {
                    consumer: c.consumer,
                    claims: c.claims,
                    oldest_age: c.oldest,
                    newest_age: c.newest,
                    redelivery_horizon: horizon,
                })
                .collect(),
            queues,
            outbox,
            http_keys,
            window,
            dead_letters,
            instances,
            warnings,
        })
    }
}

/// The JetStream streams of NATS consumers, asked of the server at the
/// services' NATS URL; unknown depths without one (or without feature
/// `nats`), and when the server cannot be asked (logged).
async fn stream_statuses(
    services: &Services,
    streams: &[(String, Vec<String>)],
) -> Vec<QueueStatus> {
    // (exists, pending, consumers, unacked) per stream, when NATS answered.
    #[cfg(feature = "nats")]
    let depths = match (services.nats_url(), streams.is_empty()) {
        (Some(url), false) => match crate::nats::depth::stream_depths(url, streams).await {
            Ok(found) => found
                .into_iter()
                .map(|d| Some((d.exists, d.pending, d.consumers, d.unacked)))
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "status: cannot ask NATS about its streams");
                vec![None; streams.len()]
            }
        },
        _ => vec![None; streams.len()],
    };
    #[cfg(not(feature = "nats"))]
    let depths: Vec<Option<(bool, u64, u32, u64)>> = {
        let _ = services;
        vec![None; streams.len()]
    };
    streams
        .iter()
        .zip(depths)
        .map(|((stream, _), depth)| QueueStatus {
            queue: stream.clone(),
            exists: depth.is_none_or(|(exists, ..)| exists),
            ready: depth
                .filter(|(exists, ..)| *exists)
                .map(|(_, pending, ..)| u32::try_from(pending).unwrap_or(u32::MAX)),
            unacked: depth
                .filter(|(exists, ..)| *exists)
                .map(|(.., unacked)| u32::try_from(unacked).unwrap_or(u32::MAX)),
            consumers: depth
                .filter(|(exists, ..)| *exists)
                .map(|(_, _, consumers, _)| consumers),
            dlq_ready: None,
            delay_queues: Vec::new(),
            transport: "nats".into(),
        })
        .collect()
}

/// The work queue, DLQ and delay queues of each of `names`.
async fn inspect(
    connection: &lapin::Connection,
    names: &[String],
    delays: &[Duration],
    options: &StatusOptions,
    warnings: &mut Vec<Warning>,
) -> Result<Vec<QueueStatus>> {
    let mut queues = Vec::new();
    for queue in names {
        let work = queue_depth(connection, queue).await?;
        if work.is_none() && !options.queues.is_empty() {
            return Err(OpsError::QueueNotFound {
                queue: queue.clone(),
            });
        }
        let dlq_name = crate::amqp::Amqp::dead_letter_queue(queue);
        let dlq = queue_depth(connection, &dlq_name).await?;
        let mut delay_queues = Vec::new();
        for delay in delays {
            let name = delay_queue(queue, *delay);
            if let Some(depth) = queue_depth(connection, &name).await? {
                delay_queues.push(DelayQueueStatus {
                    queue: name,
                    ready: depth.ready,
                });
            }
        }
        if let Some(dlq) = dlq
            && dlq.ready > 0
            && options.fail_on_dlq
        {
            warnings.push(Warning::DeadLetters {
                dlq: dlq_name,
                ready: dlq.ready,
            });
        }
        queues.push(QueueStatus {
            queue: queue.clone(),
            exists: work.is_some(),
            ready: work.map(|w| w.ready),
            unacked: None,
            consumers: work.map(|w| w.consumers),
            dlq_ready: dlq.map(|d| d.ready),
            delay_queues,
            transport: "amqp".into(),
        });
    }
    Ok(queues)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_read_as_the_command_prints_them() {
        let short = Warning::RetentionTooShort {
            retention: Duration::from_secs(60),
            horizon: Duration::from_secs(2_556),
            retries: Duration::from_secs(756),
            consumer_timeout: Duration::from_secs(1_800),
        };
        assert_eq!(
            short.to_string(),
            "retention 60s is shorter than the redelivery horizon 42m (retries 12m + consumer_timeout 30m): \
             a late redelivery would be processed again"
        );
        let dlq = Warning::DeadLetters {
            dlq: "payments.dlq".into(),
            ready: 3,
        };
        assert_eq!(
            serde_json::to_value(&dlq).unwrap(),
            "payments.dlq holds 3 dead letter(s)"
        );
    }

    #[test]
    fn status_serialises_durations_as_seconds() {
        let status = Status {
            consumers: vec![ConsumerStatus {
                consumer: "c1".into(),
                claims: 3,
                oldest_age: Some(Duration::from_millis(1_500)),
                newest_age: None,
                redelivery_horizon: Duration::from_secs(2_556),
            }],
            queues: Vec::new(),
            outbox: Some(OutboxStatus::default()),
            http_keys: None,
            window: Some(Vec::new()),
            dead_letters: None,
            instances: None,
            warnings: vec![Warning::NotMigrated],
        };
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "consumers": [{
                    "consumer": "c1", "claims": 3, "oldest_age_secs": 1.5,
                    "newest_age_secs": null, "redelivery_horizon_secs": 2556.0,
                }],
                "queues": [],
                "outbox": {"pending": 0, "failed": 0, "oldest_pending_age_secs": null},
                "http_keys": null,
                "window": [],
                "dead_letters": null,
                "instances": null,
                "warnings": ["idempo's tables do not exist: run `idempo migrate`"],
            })
        );
        assert!(status.needs_attention());
    }
}
