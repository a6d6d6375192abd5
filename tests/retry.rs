//! The retry client against a real local HTTP server (delays measured on a
//! paused tokio clock), and against the project's own `http_payments`
//! example: a retried POST makes exactly one payment.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idempo::retry::{RetryError, RetryPolicy, RetryingClient, SendError, retry};
use tokio::time::Instant;

/// What the server saw: each attempt's key and arrival time (tokio's clock).
#[derive(Default)]
struct Seen {
    attempts: Vec<(String, Instant)>,
}

/// How the server answers: `failures` times `status` (with `retry_after`),
/// then 201.
#[derive(Clone)]
struct Script {
    failures: usize,
    status: StatusCode,
    retry_after: RetryAfter,
    seen: Arc<Mutex<Seen>>,
}

#[derive(Clone, Copy)]
enum RetryAfter {
    None,
    Seconds(u64),
    /// An HTTP-date this far in the (wall-clock) future.
    DateIn(u64),
}

async fn flaky(State(script): State<Script>, headers: HeaderMap) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let attempt = {
        let mut seen = script.seen.lock().unwrap();
        seen.attempts.push((key, Instant::now()));
        seen.attempts.len()
    };
    if attempt > script.failures {
        return (StatusCode::CREATED, "done").into_response();
    }
    let mut response = script.status.into_response();
    let value = match script.retry_after {
        RetryAfter::None => return response,
        RetryAfter::Seconds(s) => s.to_string(),
        RetryAfter::DateIn(s) => {
            httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(s))
        }
    };
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, value.parse().unwrap());
    response
}

async fn serve(script: Script) -> String {
    let app = Router::new().route("/op", post(flaky)).with_state(script);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/op", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// A reqwest client with no idle pool: its idle timer would let the paused
/// clock jump while a request waits on the socket.
fn client(policy: RetryPolicy) -> RetryingClient {
    let inner = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    RetryingClient::new(inner, policy)
}

/// Runs one request against a server following `script`; returns the
/// outcome and the gaps between attempts.
async fn attempt(
    policy: RetryPolicy,
    failures: usize,
    status: StatusCode,
    retry_after: RetryAfter,
) -> (
    Result<idempo::retry::Retried, SendError>,
    Vec<String>,
    Vec<Duration>,
) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let url = serve(Script {
        failures,
        status,
        retry_after,
        seen: seen.clone(),
    })
    .await;
    let request = reqwest::Client::new()
        .post(&url)
        .body("{}")
        .build()
        .unwrap();
    let outcome = client(policy).send(request).await;
    let seen = seen.lock().unwrap();
    let keys = seen.attempts.iter().map(|(k, _)| k.clone()).collect();
    let gaps = seen.attempts.windows(2).map(|w| w[1].1 - w[0].1).collect();
    (outcome, keys, gaps)
}

#[tokio::test(start_paused = true)]
async fn one_key_across_all_attempts_and_retry_after_in_seconds() {
    let (outcome, keys, gaps) = attempt(
        RetryPolicy::new(),
        3,
        StatusCode::SERVICE_UNAVAILABLE,
        RetryAfter::Seconds(2),
    )
    .await;
    let retried = outcome.unwrap();
    assert_eq!(retried.response.status(), 201);
    assert_eq!(retried.attempts, 4);
    assert_eq!(keys.len(), 4);
    assert!(
        keys.iter().all(|k| *k == retried.key),
        "one key on every attempt: {keys:?}"
    );
    assert_eq!(retried.key.len(), 36, "a UUID v4");
    for gap in gaps {
        assert!(
            gap >= Duration::from_secs(2) && gap < Duration::from_millis(2100),
            "Retry-After: 2 waits 2 s, not {gap:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honoured_and_capped() {
    let (outcome, _, gaps) = attempt(
        RetryPolicy::new(),
        1,
        StatusCode::TOO_MANY_REQUESTS,
        RetryAfter::DateIn(5),
    )
    .await;
    assert_eq!(outcome.unwrap().response.status(), 201);
    // A whole-second date 5 s ahead of a wall clock that hardly moves.
    assert!(
        gaps[0] >= Duration::from_secs(4) && gaps[0] <= Duration::from_millis(5100),
        "{gaps:?}"
    );
    let capped = RetryPolicy::new().max_delay(Duration::from_secs(3));
    let (outcome, _, gaps) = attempt(
        capped,
        1,
        StatusCode::SERVICE_UNAVAILABLE,
        RetryAfter::DateIn(60),
    )
    .await;
    assert_eq!(outcome.unwrap().response.status(), 201);
    assert!(
        gaps[0] >= Duration::from_secs(3) && gaps[0] < Duration::from_millis(3100),
        "capped by max_delay: {gaps:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn without_retry_after_the_waits_stay_under_the_jittered_ceilings() {
    let policy = RetryPolicy::new();
    let (outcome, _, gaps) =
        attempt(policy.clone(), 3, StatusCode::BAD_GATEWAY, RetryAfter::None).await;
    assert_eq!(outcome.unwrap().attempts, 4);
    for (n, gap) in gaps.iter().enumerate() {
        let ceiling = policy.ceiling(n as u32 + 1);
        assert!(
            *gap <= ceiling + Duration::from_millis(50),
            "retry {}: {gap:?} > {ceiling:?}",
            n + 1
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_error_returns_at_once_and_exhausted_retries_return_the_last_response() {
    let (outcome, keys, _) = attempt(
        RetryPolicy::new(),
        5,
        StatusCode::BAD_REQUEST,
        RetryAfter::None,
    )
    .await;
    let retried = outcome.unwrap();
    assert_eq!(
        (retried.response.status().as_u16(), retried.attempts),
        (400, 1)
    );
    assert_eq!(keys.len(), 1);
    let (outcome, keys, _) = attempt(
        RetryPolicy::new().max_retries(2),
        9,
        StatusCode::CONFLICT,
        RetryAfter::Seconds(1),
    )
    .await;
    let retried = outcome.unwrap();
    assert_eq!(
        (retried.response.status().as_u16(), retried.attempts),
        (409, 3)
    );
    assert_eq!(keys.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_and_cancellation_stop_the_retries() {
    let policy = RetryPolicy::new().deadline(Duration::from_secs(5));
    let (outcome, keys, _) = attempt(
        policy,
        9,
        StatusCode::SERVICE_UNAVAILABLE,
        RetryAfter::Seconds(2),
    )
    .await;
    let retried = outcome.unwrap();
    assert_eq!(
        retried.response.status(),
        503,
        "the last answer before the deadline"
    );
    assert_eq!(
        keys.len(),
        3,
        "attempts at 0 s, 2 s, 4 s; the next would start after 5 s"
    );

    let token = tokio_util::sync::CancellationToken::new();
    let policy = RetryPolicy::new().cancel_on(token.clone());
    let cancel = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        token.cancel();
    });
    let (outcome, keys, _) = attempt(
        policy,
        9,
        StatusCode::SERVICE_UNAVAILABLE,
        RetryAfter::Seconds(2),
    )
    .await;
    assert!(
        matches!(
            outcome,
            Err(SendError::Retry {
                error: RetryError::Cancelled { attempts: 2 },
                ..
            })
        ),
        "{outcome:?}"
    );
    assert_eq!(keys.len(), 2);
    cancel.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn network_errors_are_retried_then_reported_with_the_attempt_count() {
    // A port nobody listens on.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let request = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/op"))
        .build()
        .unwrap();
    let outcome = client(RetryPolicy::new()).send(request).await;
    let Err(SendError::Retry {
        key,
        error: RetryError::Exhausted { last, attempts },
    }) = outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!(attempts, 4);
    assert!(last.is_connect(), "{last}");
    assert_eq!(key.len(), 36, "the key comes back, to retry later with it");
}

#[tokio::test(start_paused = true)]
async fn the_generic_retry_for_non_http_work() {
    let started = Instant::now();
    let mut calls = 0;
    let policy = RetryPolicy::new()
        .base_delay(Duration::from_secs(1))
        .max_retries(5);
    let value = retry(&policy, |attempt| {
        calls += 1;
        async move {
            if attempt < 4 {
                Err(format!("attempt {attempt}"))
            } else {
                Ok(attempt)
            }
        }
    })
    .await
    .unwrap();
    assert_eq!((value, calls), (4, 4));
    assert!(
        started.elapsed() <= Duration::from_secs(1 + 2 + 4),
        "{:?}",
        started.elapsed()
    );
    let exhausted = retry(&RetryPolicy::new().max_retries(1), |_| async {
        Err::<(), _>("no")
    })
    .await;
    assert!(matches!(
        exhausted,
        Err(RetryError::Exhausted {
            last: "no",
            attempts: 2
        })
    ));
}

/// Forwards connections to `target`; the first `lose` connections have their
/// response swallowed (read from the server, then the client's socket is
/// closed): the request was executed, the answer lost.
async fn lossy_proxy(target: String, lose: usize) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            n += 1;
            let mut server = tokio::net::TcpStream::connect(&target).await.unwrap();
            if n > lose {
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
                continue;
            }
            tokio::spawn(async move {
                let request = read_request(&mut client).await;
                server.write_all(&request).await.unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                let _ = server.read(&mut buf).await; // the answer, swallowed
                drop(client); // the client sees the connection close
            });
        }
    });
    addr
}

/// One whole HTTP/1.1 request: the head, then `content-length` bytes.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "the client closed before a whole request");
        request.extend_from_slice(&buf[..n]);
        let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&request[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        if request.len() >= end + 4 + length {
            return request;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_callers_key_is_kept_and_an_invalid_one_is_refused() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let url = serve(Script {
        failures: 1,
        status: StatusCode::SERVICE_UNAVAILABLE,
        retry_after: RetryAfter::Seconds(1),
        seen: seen.clone(),
    })
    .await;
    let request = reqwest::Client::new()
        .post(&url)
        .header("idempotency-key", "order-17:charge")
        .build()
        .unwrap();
    let retried = client(RetryPolicy::new()).send(request).await.unwrap();
    assert_eq!(retried.key, "order-17:charge");
    let keys: Vec<String> = seen
        .lock()
        .unwrap()
        .attempts
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(keys, ["order-17:charge", "order-17:charge"]);
    let request = reqwest::Client::new().post(&url).build().unwrap();
    let refused = client(RetryPolicy::new())
        .send_with_key(request, "bad\nkey")
        .await;
    assert!(
        matches!(refused, Err(SendError::InvalidKey(_))),
        "{refused:?}"
    );
}

#[tokio::test]
async fn a_retried_post_to_the_http_payments_example_makes_one_payment() {
    let db = support::Db::new().await;
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut server = std::process::Command::new(support::example_binary("http_payments"))
        .env("HTTP_ADDR", &addr)
        .env("DATABASE_URL", &db.url)
        .env("IDEMPOTENCY_STORE", "postgres")
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("start the http_payments example");
    let _kill = support::KillOnDrop(&mut server);
    let client = reqwest::Client::new();
    support::eventually("the example listens", Duration::from_secs(30), || {
        let client = client.clone();
        let url = format!("http://{addr}/payments");
        async move { client.get(url).send().await.is_ok() }
    })
    .await;

    let proxy = lossy_proxy(addr.clone(), 1).await;
    let request = client
        .post(format!("http://{proxy}/payments"))
        .header("content-type", "application/json")
        .header("x-user-id", "alice")
        .body(r#"{"account": "acc-1", "amount_cents": 500}"#)
        .build()
        .unwrap();
    let retried = RetryingClient::new(client.clone(), RetryPolicy::new())
        .send(request)
        .await
        .expect("the retry gets an answer");
    assert_eq!(retried.attempts, 2, "the first answer was lost");
    assert_eq!(retried.response.status(), 201);
    assert_eq!(
        retried
            .response
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the second attempt got the first one's stored answer"
    );
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM http_payments")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(payments, 1, "exactly one payment");
}
