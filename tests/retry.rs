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
use idempo::KeyError;
use idempo::retry::{AttemptError, RetryError, RetryPolicy, RetryingClient, SendError};
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
    /// An HTTP-date (IMF-fixdate) this far in the (wall-clock) future.
    DateIn(u64),
    /// The same in the obsolete RFC 850 format.
    Rfc850In(u64),
    /// The same in the obsolete asctime format.
    AsctimeIn(u64),
}

/// `Sun, 06 Nov 1994 08:49:37 GMT` rewritten as RFC 850
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) or asctime (`Sun Nov  6 08:49:37 1994`),
/// the two obsolete HTTP-date formats a recipient must still accept.
fn obsolete_http_date(at: SystemTime, rfc850: bool) -> String {
    let imf = httpdate::fmt_http_date(at);
    let (wday, day, mon, year, time) = (
        &imf[0..3],
        &imf[5..7],
        &imf[8..11],
        &imf[12..16],
        &imf[17..25],
    );
    if rfc850 {
        let weekday = match wday {
            "Mon" => "Monday",
            "Tue" => "Tuesday",
            "Wed" => "Wednesday",
            "Thu" => "Thursday",
            "Fri" => "Friday",
            "Sat" => "Saturday",
            _ => "Sunday",
        };
        format!("{weekday}, {day}-{mon}-{} {time} GMT", &year[2..])
    } else {
        format!(
            "{wday} {mon} {:>2} {time} {year}",
            day.trim_start_matches('0')
        )
    }
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
        RetryAfter::Rfc850In(s) => {
            obsolete_http_date(SystemTime::now() + Duration::from_secs(s), true)
        }
        RetryAfter::AsctimeIn(s) => {
            obsolete_http_date(SystemTime::now() + Duration::from_secs(s), false)
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
async fn a_client_error_returns_at_once_and_exhausted_retries_give_up_with_the_last_response() {
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
    // A retryable status is no answer: it comes back as an error the caller
    // cannot take for one, with the response in it.
    let Err(gave_up) = outcome else {
        panic!("a 409 after the last retry is not Ok: {outcome:?}")
    };
    assert!(
        matches!(
            &gave_up,
            SendError::GaveUp {
                error: RetryError::Exhausted {
                    last: AttemptError::Status(_),
                    attempts: 3
                },
                ..
            }
        ),
        "{gave_up:?}"
    );
    assert_eq!(gave_up.key(), keys[0]);
    let response = gave_up.into_response().expect("the last response");
    assert_eq!(response.status(), 409);
    assert_eq!(response.headers()["retry-after"], "1");
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
    assert!(
        matches!(
            &outcome,
            Err(SendError::GaveUp {
                error: RetryError::Deadline {
                    last: Some(AttemptError::Status(_)),
                    attempts: 3
                },
                ..
            })
        ),
        "the last answer before the deadline, as an error: {outcome:?}"
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
            Err(SendError::GaveUp {
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
    let Err(SendError::GaveUp {
        key,
        error:
            RetryError::Exhausted {
                last: AttemptError::Transport(last),
                attempts,
            },
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
    let value = policy
        .retry(|attempt| {
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
    let exhausted = RetryPolicy::new()
        .max_retries(1)
        .retry(|_| async { Err::<(), _>("no") })
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
    try_read_request(stream)
        .await
        .expect("the client closed before a whole request")
}

/// [`read_request`], or `None` when the client gave up first (its attempt
/// timed out, say).
async fn try_read_request(stream: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
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
            return Some(request);
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
        matches!(
            refused,
            Err(SendError::InvalidKey {
                reason: KeyError::InvalidCharacter { position: 3 },
                ..
            })
        ),
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

/// A raw HTTP/1.1 server: request *n* (1-based, counted over connections)
/// gets `replies[n - 1]` written back verbatim, or, for `None` and past the
/// end of `replies`, no answer at all (the connection stays open). Records
/// each request's key like [`serve`].
async fn raw_server(replies: Vec<Option<&'static str>>) -> (String, Arc<Mutex<Seen>>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/op", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let (seen, replies) = (record.clone(), replies.clone());
            tokio::spawn(async move {
                let Some(request) = try_read_request(&mut stream).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&request).into_owned();
                let key = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("idempotency-key")
                            .then(|| value.trim().to_owned())
                    })
                    .unwrap_or_default();
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.attempts.push((key, Instant::now()));
                    seen.attempts.len()
                };
                match replies.get(n - 1).copied().flatten() {
                    Some(reply) => {
                        let _ = stream.write_all(reply.as_bytes()).await;
                        let _ = stream.shutdown().await;
                    }
                    // Hold the connection open and never answer.
                    None => std::future::pending::<()>().await,
                }
            });
        }
    });
    (url, seen)
}

const CREATED: &str = "HTTP/1.1 201 Created\r\ncontent-length: 4\r\nconnection: close\r\n\r\ndone";

fn keys_seen(seen: &Mutex<Seen>) -> Vec<String> {
    let seen = seen.lock().unwrap();
    seen.attempts.iter().map(|(k, _)| k.clone()).collect()
}

#[tokio::test(start_paused = true)]
async fn with_the_readme_setup_a_server_that_never_answers_is_retried_with_the_same_key() {
    let (url, seen) = raw_server(vec![]).await;
    let request = reqwest::Client::new()
        .post(&url)
        .body("{}")
        .build()
        .unwrap();
    let started = Instant::now();
    // Exactly the README's client: no timeout of its own.
    let client = RetryingClient::new(reqwest::Client::new(), RetryPolicy::new());
    let outcome = tokio::time::timeout(Duration::from_secs(600), client.send(request))
        .await
        .expect("each attempt times out: the client does not wait forever");
    let Err(SendError::GaveUp {
        key,
        error:
            RetryError::Exhausted {
                last: AttemptError::TimedOut(after),
                attempts: 4,
            },
    }) = &outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!(*after, Duration::from_secs(10));
    assert!(
        outcome
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("attempt timeout")
    );
    assert_eq!(
        keys_seen(&seen),
        vec![key.clone(); 4],
        "every attempt reached the server with one key"
    );
    let elapsed = started.elapsed();
    // Four 10 s attempts and three jittered waits under 200, 400, 800 ms.
    assert!(
        elapsed >= Duration::from_secs(40) && elapsed <= Duration::from_millis(41_500),
        "{elapsed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hung_attempt_is_retried_with_the_same_key_before_the_deadline() {
    let (url, seen) = raw_server(vec![None, Some(CREATED)]).await;
    let request = reqwest::Client::new()
        .post(&url)
        .body("{}")
        .build()
        .unwrap();
    let started = Instant::now();
    let retried = client(RetryPolicy::new().deadline(Duration::from_secs(2)))
        .attempt_timeout(Duration::from_millis(500))
        .send(request)
        .await
        .expect("the second attempt answers before the deadline");
    assert_eq!(
        (retried.response.status().as_u16(), retried.attempts),
        (201, 2)
    );
    assert_eq!(keys_seen(&seen), [retried.key.clone(), retried.key.clone()]);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_cuts_an_attempt_off_does_not_pass_the_earlier_503_as_the_answer() {
    const UNAVAILABLE: &str = "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\
        retry-after: 1\r\nx-attempt: 1\r\nconnection: close\r\n\r\n";
    // The first attempt gets a 503, the second hangs until the deadline.
    let (url, seen) = raw_server(vec![Some(UNAVAILABLE)]).await;
    let request = reqwest::Client::new()
        .post(&url)
        .body("{}")
        .build()
        .unwrap();
    let started = Instant::now();
    let outcome = client(RetryPolicy::new().deadline(Duration::from_secs(2)))
        .send(request)
        .await;
    let Err(gave_up) = outcome else {
        panic!("attempt 2 was cut off: there is no answer, not attempt 1's 503: {outcome:?}")
    };
    assert!(
        matches!(
            &gave_up,
            SendError::GaveUp {
                error: RetryError::Deadline {
                    last: Some(AttemptError::Status(_)),
                    attempts: 2
                },
                ..
            }
        ),
        "{gave_up:?}"
    );
    let last = gave_up.response().expect("the last attempt that ended");
    assert_eq!(
        last.headers()["x-attempt"],
        "1",
        "attempt 1's, named as the last that ended"
    );
    assert_eq!(keys_seen(&seen).len(), 2);
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(2) && elapsed < Duration::from_millis(2100),
        "{elapsed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn durations_too_long_for_the_clock_saturate_instead_of_panicking() {
    // A deadline and an attempt timeout of Duration::MAX: no limit at all.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let url = serve(Script {
        failures: 1,
        status: StatusCode::SERVICE_UNAVAILABLE,
        retry_after: RetryAfter::Seconds(1),
        seen: seen.clone(),
    })
    .await;
    let request = reqwest::Client::new().post(&url).build().unwrap();
    let retried = client(RetryPolicy::new().deadline(Duration::MAX))
        .attempt_timeout(Duration::MAX)
        .send(request)
        .await
        .unwrap();
    assert_eq!(
        (retried.response.status().as_u16(), retried.attempts),
        (201, 2)
    );

    // A Retry-After of u64::MAX seconds, uncapped: a wait that ends after
    // any deadline, so the retries stop at once.
    let (outcome, keys, _) = attempt(
        RetryPolicy::new()
            .max_delay(Duration::MAX)
            .deadline(Duration::from_secs(3600)),
        9,
        StatusCode::SERVICE_UNAVAILABLE,
        RetryAfter::Seconds(u64::MAX),
    )
    .await;
    assert!(
        matches!(
            outcome,
            Err(SendError::GaveUp {
                error: RetryError::Deadline {
                    last: Some(AttemptError::Status(_)),
                    attempts: 1
                },
                ..
            })
        ),
        "{outcome:?}"
    );
    assert_eq!(keys.len(), 1);

    // The generic loop shares the deadline arithmetic.
    let mut calls = 0;
    let policy = RetryPolicy::new()
        .deadline(Duration::MAX)
        .base_delay(Duration::ZERO);
    let value = policy
        .retry(|attempt| {
            calls += 1;
            async move {
                if attempt < 2 {
                    Err("once")
                } else {
                    Ok(attempt)
                }
            }
        })
        .await
        .unwrap();
    assert_eq!((value, calls), (2, 2));
}

#[tokio::test(start_paused = true)]
async fn send_and_send_with_key_refuse_the_same_keys_as_the_server_and_send_nothing() {
    let (url, seen) = raw_server(vec![Some(CREATED); 4]).await;
    let client = client(RetryPolicy::new());
    let long = "k".repeat(256);
    let cases: [(&[u8], KeyError); 5] = [
        (
            "caf\u{e9}".as_bytes(),
            KeyError::InvalidCharacter { position: 3 },
        ),
        (b"", KeyError::Empty),
        (b"  padded\t", KeyError::InvalidCharacter { position: 0 }),
        (b"\"open", KeyError::Unterminated),
        (long.as_bytes(), KeyError::TooLong { len: 256 }),
    ];
    for (key, reason) in cases {
        // The server's parser, to show the client applies the same rule.
        assert_eq!(
            idempo::http::IdempotencyKey::parse(key).unwrap_err(),
            reason,
            "{key:?}"
        );
        let text = std::str::from_utf8(key).unwrap();
        let request = reqwest::Client::new().post(&url).build().unwrap();
        let refused = client.send_with_key(request, text).await;
        let Err(SendError::InvalidKey {
            key: reported,
            reason: why,
        }) = &refused
        else {
            panic!("send_with_key({text:?}): {refused:?}")
        };
        assert_eq!((reported.as_str(), why), (text, &reason));

        let value = reqwest::header::HeaderValue::from_bytes(key).unwrap();
        let request = reqwest::Client::new()
            .post(&url)
            .header("idempotency-key", value)
            .build()
            .unwrap();
        let refused = client.send(request).await;
        let Err(SendError::InvalidKey { reason: why, .. }) = &refused else {
            panic!("send with {text:?} in the header: {refused:?}")
        };
        assert_eq!(why, &reason, "{text:?}");
    }
    let request = reqwest::Client::new()
        .post(&url)
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .build()
        .unwrap();
    assert!(matches!(
        client.send(request).await,
        Err(SendError::InvalidKey {
            reason: KeyError::Repeated,
            ..
        })
    ));
    assert!(keys_seen(&seen).is_empty(), "nothing was sent");

    // What both accept goes out exactly as given, and is reported as sent.
    for key in ["order-17:charge", "\"order-17\""] {
        let request = reqwest::Client::new().post(&url).build().unwrap();
        assert_eq!(client.send_with_key(request, key).await.unwrap().key, key);
        let request = reqwest::Client::new()
            .post(&url)
            .header("idempotency-key", key)
            .build()
            .unwrap();
        assert_eq!(client.send(request).await.unwrap().key, key);
    }
    assert_eq!(
        keys_seen(&seen),
        [
            "order-17:charge",
            "order-17:charge",
            "\"order-17\"",
            "\"order-17\""
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_in_the_obsolete_rfc_850_and_asctime_formats_is_honoured() {
    for format in [RetryAfter::Rfc850In(3), RetryAfter::AsctimeIn(3)] {
        let (outcome, _, gaps) = attempt(
            RetryPolicy::new(),
            1,
            StatusCode::SERVICE_UNAVAILABLE,
            format,
        )
        .await;
        assert_eq!(outcome.unwrap().response.status(), 201);
        // A whole-second date 3 s ahead; without parsing it the wait would
        // be the jittered backoff, under 200 ms.
        assert!(
            gaps[0] >= Duration::from_secs(2) && gaps[0] <= Duration::from_millis(3100),
            "{gaps:?}"
        );
    }
}
