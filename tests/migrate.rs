//! idempo's migrations coexist with an application's own sqlx migrations.

mod support;

use support::Db;

async fn app_migrate(db: &Db) -> Result<(), sqlx::migrate::MigrateError> {
    sqlx::migrate!("tests/fixtures/app_migrations")
        .run(&db.pool)
        .await
}

async fn assert_both_applied(db: &Db) {
    let idempo: i64 = db.count("SELECT count(*) FROM _idempo_migrations").await;
    let app: i64 = db.count("SELECT count(*) FROM _sqlx_migrations").await;
    // idempo's migrations are the crate's `migrations/*.sql`.
    let ours = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .expect("the crate's migrations folder")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count() as i64;
    assert!(ours >= 2, "the inbox and the idempotency keys");
    assert_eq!(idempo, ours, "idempo records its own migrations apart");
    assert_eq!(
        app, 2,
        "the application's table holds only its own versions"
    );
    // Both schemas are really there.
    db.count("SELECT count(*) FROM processed_messages").await;
    db.count("SELECT count(*) FROM idempotency_keys").await;
    db.count("SELECT count(*) FROM orders WHERE note IS NULL")
        .await;
}

#[tokio::test]
async fn app_migrations_then_idempo_then_both_again() {
    let db = Db::empty().await;
    app_migrate(&db).await.expect("app migrations");
    idempo::migrate(&db.pool)
        .await
        .expect("idempo after the app");
    // A restart runs both again: neither may complain about the other's versions.
    app_migrate(&db).await.expect("app migrations rerun");
    idempo::migrate(&db.pool).await.expect("idempo rerun");
    assert_both_applied(&db).await;
}

#[tokio::test]
async fn idempo_then_app_migrations_then_both_again() {
    let db = Db::empty().await;
    idempo::migrate(&db.pool).await.expect("idempo first");
    app_migrate(&db).await.expect("app migrations after idempo");
    idempo::migrate(&db.pool).await.expect("idempo rerun");
    app_migrate(&db).await.expect("app migrations rerun");
    assert_both_applied(&db).await;
}
