//! The HTTP payments service shared by `examples/http_payments.rs` and the
//! tests: `POST /payments` inserts one payment row and answers 201.
#![allow(dead_code)]

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idempo::Tx;
use serde::Deserialize;
use sqlx::{PgConnection, PgPool};

/// The body of `POST /payments`.
#[derive(Debug, Deserialize)]
pub struct NewPayment {
    pub account: String,
    pub amount_cents: i64,
}

/// Checks that the table of [`create_table`] exists, without DDL (for a role
/// that may not create tables).
pub async fn check_table(pool: &PgPool) -> anyhow::Result<()> {
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass('http_payments')::text")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(
        exists.is_some(),
        "table \"http_payments\" does not exist: start once with PAYMENTS_MIGRATE=1 as a role that may create tables"
    );
    Ok(())
}

/// Creates `http_payments` if missing, one process at a time (two
/// `CREATE TABLE IF NOT EXISTS` at once can collide).
pub async fn create_table(pool: &PgPool) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(0x6964_656d_706f_4854_i64)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS http_payments (
             payment_id   uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
             user_id      text        NOT NULL,
             account      text        NOT NULL,
             amount_cents bigint      NOT NULL,
             created_at   timestamptz NOT NULL DEFAULT now()
         )",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The user of a request: header `X-User-Id`.
pub fn user_of(parts: &Parts) -> Option<String> {
    user_from(&parts.headers)
}

fn user_from(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-user-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

/// Inserts the payment; returns its fresh id.
pub async fn insert_payment(
    conn: &mut PgConnection,
    user: &str,
    payment: &NewPayment,
) -> sqlx::Result<String> {
    sqlx::query_scalar(
        "INSERT INTO http_payments (user_id, account, amount_cents)
         VALUES ($1, $2, $3) RETURNING payment_id::text",
    )
    .bind(user)
    .bind(&payment.account)
    .bind(payment.amount_cents)
    .fetch_one(conn)
    .await
}

/// An error answer of the handlers.
pub struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

/// Database errors: logged in full, answered with a generic message (the
/// client has no use for the database's text, and should not see it). 503,
/// which the idempotency layer does not store: nothing was written.
impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        tracing::warn!(error = %e, "database error");
        Failure(
            StatusCode::SERVICE_UNAVAILABLE,
            "the database is unavailable; retry later".into(),
        )
    }
}

impl From<idempo::Error> for Failure {
    fn from(e: idempo::Error) -> Self {
        tracing::warn!(error = %e, "request failed");
        Failure(StatusCode::INTERNAL_SERVER_ERROR, "internal error".into())
    }
}

fn validate(headers: &HeaderMap, payment: &NewPayment) -> Result<String, Failure> {
    let user = user_from(headers).ok_or_else(|| {
        Failure(
            StatusCode::UNAUTHORIZED,
            "header X-User-Id is required".into(),
        )
    })?;
    if payment.account.is_empty() || payment.amount_cents <= 0 {
        return Err(Failure(
            StatusCode::UNPROCESSABLE_ENTITY,
            "account must be non-empty and amount_cents positive".into(),
        ));
    }
    Ok(user)
}

fn created(payment_id: String) -> Response {
    let location = format!("/payments/{payment_id}");
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(serde_json::json!({ "payment_id": payment_id })),
    )
        .into_response()
}

/// `POST /payments`. With the PostgreSQL store the layer hands the handler a
/// [`Tx`]: the insert commits in the transaction that stores the 201 (the
/// atomic phase). With the Redis or memory store there is none, and the
/// insert commits on its own before the layer stores the 201.
pub async fn create(
    tx: Option<Tx>,
    State(pool): State<PgPool>,
    headers: HeaderMap,
    Json(payment): Json<NewPayment>,
) -> Result<Response, Failure> {
    let user = validate(&headers, &payment)?;
    let payment_id = match tx {
        Some(tx) => insert_payment(&mut *tx.try_lock()?, &user, &payment).await?,
        None => insert_payment(&mut *pool.acquire().await?, &user, &payment).await?,
    };
    Ok(created(payment_id))
}
