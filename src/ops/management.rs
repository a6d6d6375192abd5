//! What only RabbitMQ's management plugin knows: a queue's unacknowledged
//! messages and the broker's delivery and ack rates (AMQP's passive declare
//! tells ready messages and consumers only). Optional: without the plugin,
//! the callers show what AMQP and the heartbeats tell.

use std::str::FromStr;
use std::time::Duration;

use lapin::uri::AMQPUri;

use super::error::{OpsError, Result};

/// The management plugin's port on a broker's host.
pub(crate) const MANAGEMENT_PORT: u16 = 15672;

/// Where the management HTTP API answers, and as whom.
#[derive(Clone)]
pub struct Management {
    /// `http://host:port`, without credentials (shown in errors).
    base: String,
    user: String,
    password: String,
    vhost: String,
    client: reqwest::Client,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("base", &self.base)
            .field("vhost", &self.vhost)
            .finish_non_exhaustive()
    }
}

/// One queue as the management API sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ManagedQueue {
    /// The queue's name.
    pub name: String,
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and not yet acknowledged.
    pub unacked: u64,
    /// Consumers attached.
    pub consumers: u64,
    /// Deliveries per second (the broker's own rate, over its last samples).
    pub deliveries_per_sec: f64,
    /// Acknowledgements per second.
    pub acks_per_sec: f64,
}

impl Management {
    /// The management API of the first node of `amqp_url` (comma-separated
    /// URLs allowed): the same host and credentials, port
    /// 15672, HTTP.
    ///
    /// # Errors
    /// [`OpsError::Management`] when the URL does not parse.
    pub fn for_broker(amqp_url: &str) -> Result<Self> {
        let first = crate::amqp::urls::first(amqp_url);
        let uri = AMQPUri::from_str(first).map_err(|e| OpsError::Management {
            url: crate::redact_url(first),
            message: format!("the AMQP URL does not parse: {e}"),
        })?;
        Self::build(
            format!("http://{}:{MANAGEMENT_PORT}", uri.authority.host),
            uri.authority.userinfo.username,
            uri.authority.userinfo.password,
            uri.vhost,
        )
    }

    /// The management API of the broker `services` connect to (see
    /// [`for_broker`](Self::for_broker)).
    ///
    /// # Errors
    /// [`OpsError::Management`] when the URL does not parse.
    pub fn for_services(services: &super::Services) -> Result<Self> {
        Self::for_broker(&services.amqp_url)
    }

    /// The management API at `url` (`http[s]://user:password@host:port`,
    /// vhost `/`).
    ///
    /// # Errors
    /// [`OpsError::Management`] when the URL is not of that form.
    pub fn new(url: &str) -> Result<Self> {
        let bad = |message: &str| OpsError::Management {
            url: crate::redact_url(url),
            message: message.into(),
        };
        let (scheme, rest) = url
            .split_once("://")
            .filter(|(s, _)| matches!(*s, "http" | "https"))
            .ok_or_else(|| bad("expected http://user:password@host:port"))?;
        let rest = rest.trim_end_matches('/');
        let (userinfo, host) = rest
            .rsplit_once('@')
            .ok_or_else(|| bad("the URL carries no user (http://user:password@host:port)"))?;
        let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        let decode = |s: &str| {
            form_urlencoded::parse(format!("x={s}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default()
        };
        Self::build(
            format!("{scheme}://{host}"),
            decode(user),
            decode(password),
            "/".into(),
        )
    }

    fn build(base: String, user: String, password: String, vhost: String) -> Result<Self> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| OpsError::Management {
                url: base.clone(),
                message: e.to_string(),
            })?;
        Ok(Management {
            base,
            user,
            password,
            vhost,
            client,
        })
    }

    /// Where it asks (without credentials).
    pub fn url(&self) -> &str {
        &self.base
    }

    /// Every queue of the vhost.
    ///
    /// # Errors
    /// [`OpsError::Management`] when the API does not answer (the plugin is
    /// not enabled: `rabbitmq-plugins enable rabbitmq_management`), refuses
    /// the credentials, or answers something else than its queue list.
    pub async fn queues(&self) -> Result<Vec<ManagedQueue>> {
        let vhost: String = form_urlencoded::byte_serialize(self.vhost.as_bytes()).collect();
        let url = format!(
            "{}/api/queues/{vhost}?columns=name,messages_ready,messages_unacknowledged,consumers,message_stats",
            self.base
        );
        let failed = |message: String| OpsError::Management {
            url: self.base.clone(),
            message,
        };
        let response = self
            .client
            .get(&url)
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|e| {
                failed(format!(
                    "no answer ({}); is the plugin enabled? rabbitmq-plugins enable rabbitmq_management",
                    e.without_url()
                ))
            })?;
        let status = response.status();
        if !status.is_success() {
            return Err(failed(format!("answered {status}")));
        }
        let body = response
            .bytes()
            .await
            .map_err(|e| failed(e.without_url().to_string()))?;
        let rows: Vec<serde_json::Value> =
            serde_json::from_slice(&body).map_err(|e| failed(format!("not a queue list: {e}")))?;
        let number = |v: &serde_json::Value, path: &[&str]| {
            path.iter()
                .try_fold(v, |v, k| v.get(k))
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0)
        };
        Ok(rows
            .iter()
            .map(|q| ManagedQueue {
                name: q["name"].as_str().unwrap_or_default().to_owned(),
                ready: number(q, &["messages_ready"]) as u64,
                unacked: number(q, &["messages_unacknowledged"]) as u64,
                consumers: number(q, &["consumers"]) as u64,
                deliveries_per_sec: number(q, &["message_stats", "deliver_get_details", "rate"]),
                acks_per_sec: number(q, &["message_stats", "ack_details", "rate"]),
            })
            .collect())
    }
}
