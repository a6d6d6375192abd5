//! idempo's schema, embedded and applied with sqlx's migrator.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::Result;

/// The table in which idempo records which of *its own* migrations ran.
///
/// It is deliberately not sqlx's default `_sqlx_migrations`: an application
/// that runs its own sqlx migrations in the same database would otherwise see
/// idempo's versions as unknown ("migration ... was previously applied but is
/// missing") and the version numbers of the two could collide.
pub(crate) const MIGRATIONS_TABLE: &str = "_idempo_migrations";

/// idempo's migrations (the `processed_messages` inbox table, and the
/// `idempotency_keys` table of the `http` feature, the `dedup_window` table of
/// the `window` feature, `saga_steps` and `sagas` of the `saga` feature; tables of features you do
/// not use stay empty),
/// recorded in `_idempo_migrations`.
pub(crate) fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// Applies idempo's migrations to the database behind `pool`.
///
/// Idempotent and safe to call from every process at start-up: sqlx takes an
/// advisory lock while it migrates. It coexists with the application's own
/// sqlx migrations, in either order (see `_idempo_migrations`). The tables are
/// created in the first schema of the connection's `search_path`.
///
/// # Example
/// ```no_run
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
/// idempo::migrate(&pool).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Migrate`](crate::error::Error::Migrate) when the database is unreachable
/// or a migration fails.
///
/// When every migration is already applied it runs no DDL at all, so a role
/// without `CREATE` (least privilege, the usual production setup) can call
/// it at every start once someone with the right to has migrated.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    match check_migrations(pool).await {
        Ok(()) => return Ok(()),
        // Unreachable: say so, rather than what the migrator makes of it.
        Err(e) if e.is_connection_error() => return Err(e),
        Err(_) => {}
    }
    migrator().run(pool).await?;
    Ok(())
}

/// Checks, without any DDL, that every one of idempo's migrations is applied
/// to the database behind `pool`: [`Schema::Check`], what a process without
/// the right to migrate does at start.
///
/// # Errors
/// [`Error::SchemaBehind`](crate::error::Error::SchemaBehind) naming the
/// versions that are missing (all of them when `_idempo_migrations` does not
/// exist); [`Error::Database`](crate::error::Error::Database) when the check
/// itself fails.
pub(crate) async fn check_migrations(pool: &PgPool) -> Result<()> {
    let applied = applied_versions(pool).await?;
    let missing: Vec<i64> = migrator()
        .iter()
        .map(|m| m.version)
        .filter(|v| !applied.contains(v))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(crate::error::Error::SchemaBehind { missing })
}

/// What a [`Consumer`](crate::amqp::Consumer) does with idempo's schema when
/// it starts (`ConsumerBuilder::schema`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Schema {
    /// Nothing: the application migrates (with [`migrate`], the `idempo
    /// migrate` command, or its own copy of the SQL). The default.
    #[default]
    Unchecked,
    /// Apply the migrations ([`migrate`]; DDL only when some are missing).
    Migrate,
    /// Check that every migration is applied and refuse to start otherwise
    /// (`Schema::Check.apply(&pool)` alone): no DDL, so a role without `CREATE` can run.
    Check,
}

impl Schema {
    /// Does what this says on `pool`.
    ///
    /// # Errors
    /// As [`migrate`]; for [`Check`](Schema::Check),
    /// [`Error::SchemaBehind`](crate::error::Error::SchemaBehind) naming the
    /// versions that are missing (all of them when `_idempo_migrations` does
    /// not exist), or [`Error::Database`](crate::error::Error::Database) when
    /// the check itself fails.
    pub async fn apply(self, pool: &PgPool) -> Result<()> {
        match self {
            Schema::Unchecked => Ok(()),
            Schema::Migrate => migrate(pool).await,
            Schema::Check => check_migrations(pool).await,
        }
    }
}

/// The versions of idempo's migrations that ran successfully in the
/// database behind `pool`, in order (none when `_idempo_migrations` does not
/// exist yet).
pub(crate) async fn applied_versions(pool: &PgPool) -> Result<Vec<i64>> {
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(MIGRATIONS_TABLE)
        .fetch_one(pool)
        .await?;
    if exists.is_none() {
        return Ok(Vec::new());
    }
    let sql = format!("SELECT version FROM {MIGRATIONS_TABLE} WHERE success ORDER BY version");
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await?)
}
