//! The MySQL / MariaDB lock service (see `locks.rs`): one row per resource in a lock table,
//! leases kept by the database's clock, and a fence column bumped in the statement that
//! takes the row.
//!
//! ```text
//! CREATE TABLE <table> (
//!   resource    VARBINARY(255) PRIMARY KEY,  -- the path; "#xxh3:<hex>" beyond 255 bytes
//!   owner       VARBINARY(32) NULL,          -- the grant in force (NULL: released)
//!   lease_until DATETIME(6) NOT NULL,        -- by the database's clock (UTC session)
//!   fence       BIGINT UNSIGNED NOT NULL     -- the last token granted
//! )
//! ```
//!
//! - **acquire**: one `INSERT … ON DUPLICATE KEY UPDATE` takes the row when it is new, free
//!   or expired (`lease_until < NOW(6)`), and in the same statement sets
//!   `fence = GREATEST(fence + 1, UNIX µs of NOW(6))`; InnoDB's row lock makes the test and
//!   the take one step, so two takers never both win. The row is then read back: it is ours
//!   when its owner is our random owner id, and its fence is the token. The fence survives
//!   a restart (InnoDB is durable) and the clock floor keeps it growing if a row is deleted.
//! - **renew**: `UPDATE … WHERE owner = ours AND lease_until >= NOW(6)`: one row, still held.
//! - **release**: `UPDATE … SET owner = NULL, lease_until = NOW(6) - 1 µs WHERE owner = ours`.
//! - **waiting** holds no connection: a refused take returns its connection to the pool and
//!   sleeps ([`Backoff`]: jittered, doubling from 5 ms to 100 ms, never past the holder's
//!   lease end) before trying again. A waiting instance (one per resource, the local queue
//!   orders the rest) costs one short statement per sleep; a handoff to another instance
//!   waits up to one sleep.
//!
//! No `GET_LOCK`: it belongs to a connection (a waiter would hold one, and the lock dies with
//! it) and Galera does not replicate it.
//!
//! Every statement is bounded by the caller's deadline and by a third of the lease (a grant
//! that took longer would be given back anyway), its wait for a connection by 500 ms (a
//! server that refuses connections costs that); a statement that fails, or runs out of
//! its third of the lease, is `Unavailable` (the route follows its `on_redis_error`), one
//! cut short by the caller's deadline a `Timeout`. A statement cut short closes its
//! connection instead of returning it to the pool (its answer may still be on the wire); a
//! statement that finds its pooled connection dead (the server restarted) is tried again on
//! another one within the same bound; all three statements are safe to repeat. The table is
//! created at start if the user may (`CREATE TABLE IF NOT EXISTS`), else it must exist; a
//! server that cannot be reached, refuses the login or lacks the table is logged at start
//! with what is wrong, and checked again by the first call once it answers.

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, Row, SqlSafeStr, SqlStr};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::{AcquireError, Backoff, Grant};

/// Connections per lock service: each is held for one statement at a time.
const POOL_SIZE: u32 = 8;
/// How long a start-up check may take.
const START_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a statement may wait for a pooled connection (a new one included: the pool
/// tries again while the server refuses connections, so a server that is down costs this).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a release may take (it runs after the origin answered, before the client hears).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest resource path kept as the row's key; longer ones are hashed.
const MAX_KEY_BYTES: usize = 255;

/// MySQL's and MariaDB's error numbers that name a misconfiguration.
mod errno {
    pub(super) const DB_ACCESS_DENIED: u16 = 1044;
    pub(super) const ACCESS_DENIED: u16 = 1045;
    pub(super) const UNKNOWN_DB: u16 = 1049;
    pub(super) const BAD_FIELD: u16 = 1054;
    pub(super) const TABLE_ACCESS_DENIED: u16 = 1142;
    pub(super) const NO_SUCH_TABLE: u16 = 1146;
}

/// The statements of one lock table, built once (the table name was checked at config
/// load: letters, digits and `_`).
#[derive(Debug)]
struct Statements {
    create: SqlStr,
    check: SqlStr,
    take: SqlStr,
    read: SqlStr,
    renew: SqlStr,
    release: SqlStr,
}

impl Statements {
    fn new(table: &str) -> Self {
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        // The condition is on `lease_until` alone, and `lease_until` is assigned last: MySQL
        // evaluates the assignments left to right, each seeing the ones before it.
        let free = "lease_until < NOW(6)";
        Statements {
            create: sql(format!(
                "CREATE TABLE IF NOT EXISTS `{table}` ({COLUMNS}) ENGINE=InnoDB"
            )),
            check: sql(format!(
                "SELECT resource, owner, lease_until, fence FROM `{table}` LIMIT 0"
            )),
            take: sql(format!(
                "INSERT INTO `{table}` (resource, owner, lease_until, fence) \
                 VALUES (?, ?, NOW(6) + INTERVAL ? MICROSECOND, {CLOCK_US}) \
                 ON DUPLICATE KEY UPDATE \
                 fence = IF({free}, GREATEST(fence + 1, {CLOCK_US}), fence), \
                 owner = IF({free}, ?, owner), \
                 lease_until = IF({free}, NOW(6) + INTERVAL ? MICROSECOND, lease_until)"
            )),
            read: sql(format!(
                "SELECT owner, fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), lease_until) \
                 FROM `{table}` WHERE resource = ?"
            )),
            renew: sql(format!(
                "UPDATE `{table}` SET lease_until = NOW(6) + INTERVAL ? MICROSECOND \
                 WHERE resource = ? AND owner = ? AND lease_until >= NOW(6)"
            )),
            release: sql(format!(
                "UPDATE `{table}` SET owner = NULL, lease_until = NOW(6) - INTERVAL 1 MICROSECOND \
                 WHERE resource = ? AND owner = ?"
            )),
        }
    }
}

/// The lock table's columns (also shown to users who must create it themselves).
const COLUMNS: &str = "resource VARBINARY(255) NOT NULL PRIMARY KEY, owner VARBINARY(32) NULL, \
                       lease_until DATETIME(6) NOT NULL, fence BIGINT UNSIGNED NOT NULL";

/// The database's clock in µs since the epoch: the floor of every token.
const CLOCK_US: &str = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)";

/// The locks in one MySQL / MariaDB lock table.
#[derive(Debug)]
pub(crate) struct MysqlLocks {
    /// The `[locks.<name>]` section, for logs.
    name: String,
    table: String,
    pool: MySqlPool,
    /// For the start-up check's own connection (the pool's hides why it cannot connect).
    options: MySqlConnectOptions,
    sql: Statements,
    /// Set once the table is known to be there (created or checked).
    ready: OnceCell<()>,
}

/// What a take found.
enum Take {
    Granted {
        token: u64,
    },
    /// Held by another grant for this much longer.
    Held {
        left: Duration,
    },
}

/// Why a statement failed.
#[derive(Debug)]
enum Failure {
    /// Its bound passed first.
    TimedOut,
    /// The server refused it or could not be reached.
    Sql(sqlx::Error),
}

impl Failure {
    /// Whether another pooled connection may do better (this one was dead).
    fn connection_lost(&self) -> bool {
        matches!(
            self,
            Failure::Sql(sqlx::Error::Io(_) | sqlx::Error::Protocol(_))
        )
    }
}

impl MysqlLocks {
    /// A lock service on `url`'s database, with its pool; nothing is sent yet (see
    /// [`MysqlLocks::check_at_start`]).
    ///
    /// # Errors
    /// When `url` is not a MySQL URL sqlx understands.
    pub(crate) fn new(name: &str, url: &str, table: &str) -> Result<Self, String> {
        let options: MySqlConnectOptions = url.parse().map_err(|e: sqlx::Error| e.to_string())?;
        // UTC sessions: NOW(6) and the stored lease ends have no daylight-saving gaps.
        let options = options.timezone(Some("+00:00".to_owned()));
        let pool = MySqlPoolOptions::new()
            .max_connections(POOL_SIZE)
            .min_connections(0)
            // Bounded again by every caller's own deadline.
            .acquire_timeout(CONNECT_TIMEOUT)
            .idle_timeout(Duration::from_secs(60))
            .max_lifetime(Duration::from_secs(30 * 60))
            // No ping before each statement: a dead connection is found by its statement,
            // which is then tried on another one.
            .test_before_acquire(false)
            .connect_lazy_with(options.clone());
        Ok(MysqlLocks {
            name: name.to_owned(),
            table: table.to_owned(),
            pool,
            options,
            sql: Statements::new(table),
            ready: OnceCell::new(),
        })
    }

    /// Connects and makes sure the table is there, bounded; logs what is wrong.
    pub(crate) async fn check_at_start(&self, url: &str) {
        let url = crate::config::redact_url(url);
        match self.check(Instant::now() + START_TIMEOUT).await {
            Ok(()) => tracing::info!(
                message = "Lock service ready.",
                lock = %self.name,
                backend = "mysql",
                url = %url,
                table = %self.table,
            ),
            Err(failure) => tracing::error!(
                message = "Lock service not usable at start; routes using it follow their \
                           on_redis_error until it is.",
                lock = %self.name,
                backend = "mysql",
                url = %url,
                problem = %self.explain(&failure),
            ),
        }
    }

    /// One connection of its own (so a refusal is seen as such), then [`Self::prepare`].
    async fn check(&self, bound: Instant) -> Result<(), Failure> {
        use sqlx::ConnectOptions as _;
        match tokio::time::timeout_at(bound, self.options.connect()).await {
            Ok(Ok(conn)) => drop(conn),
            Ok(Err(e)) => return Err(Failure::Sql(e)),
            Err(_) => return Err(Failure::TimedOut),
        }
        self.prepare(bound).await
    }

    /// What is wrong, in a user's words.
    fn explain(&self, failure: &Failure) -> String {
        let table = &self.table;
        let Failure::Sql(error) = failure else {
            return "the server did not answer in time".to_owned();
        };
        let Some(number) = error
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .map(sqlx::mysql::MySqlDatabaseError::number)
        else {
            return match error {
                sqlx::Error::Io(e) => format!("the server cannot be reached: {e}"),
                sqlx::Error::PoolTimedOut => "the server did not answer in time".to_owned(),
                other => other.to_string(),
            };
        };
        match number {
            errno::ACCESS_DENIED => {
                format!("the login was refused (check the user and password in the url): {error}")
            }
            errno::DB_ACCESS_DENIED | errno::UNKNOWN_DB => {
                format!("the database in the url cannot be used: {error}")
            }
            errno::NO_SUCH_TABLE => format!(
                "the lock table `{table}` is missing and this user may not create it: create it \
                 with CREATE TABLE `{table}` ({COLUMNS}) ENGINE=InnoDB, or grant CREATE"
            ),
            errno::BAD_FIELD => format!(
                "the table `{table}` exists without the lock columns ({COLUMNS}): name another \
                 table in `table`"
            ),
            errno::TABLE_ACCESS_DENIED => format!(
                "this user may not use the lock table `{table}` (it needs SELECT, INSERT and \
                 UPDATE on it): {error}"
            ),
            _ => error.to_string(),
        }
    }

    /// Creates the table if it is missing and the user may, else checks that it is there.
    async fn prepare(&self, bound: Instant) -> Result<(), Failure> {
        self.ready
            .get_or_try_init(|| async {
                match self.execute(&self.sql.create, &[], bound).await {
                    Ok(_) => Ok(()),
                    // No CREATE right: the table may still be there.
                    Err(Failure::Sql(e)) if is_denied(&e) => {
                        self.execute(&self.sql.check, &[], bound).await.map(|_| ())
                    }
                    Err(failure) => Err(failure),
                }
            })
            .await?;
        Ok(())
    }

    pub(super) async fn acquire(
        &self,
        resource: u128,
        path: &str,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        let key = row_key(path, resource);
        let owner = format!("{:032x}", rand::random::<u128>());
        let lease_us = micros(lease);
        let mut backoff = Backoff::new();
        loop {
            let sent = Instant::now();
            let bound = (sent + lease / 3).min(deadline);
            if let Err(failure) = self.prepare(bound).await {
                return Err(refusal(&failure, bound == deadline));
            }
            match self.take(&key, &owner, lease_us, bound).await {
                Ok(Take::Granted { token }) => {
                    return Ok(Grant {
                        token,
                        expires: sent + lease,
                        resource,
                        owner,
                        key,
                        handle: super::Handle::None,
                    });
                }
                Ok(Take::Held { left }) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(AcquireError::Timeout);
                    }
                    tokio::time::sleep_until((now + backoff.next(left)).min(deadline)).await;
                    if Instant::now() >= deadline {
                        return Err(AcquireError::Timeout);
                    }
                }
                Err(failure) => {
                    // The take may have landed: give it back (its owner id is ours alone).
                    self.spawn_release(key, owner);
                    return Err(refusal(&failure, bound == deadline));
                }
            }
        }
    }

    /// One take of the row, then its read-back.
    async fn take(
        &self,
        key: &str,
        owner: &str,
        lease_us: u64,
        bound: Instant,
    ) -> Result<Take, Failure> {
        let args = [
            Arg::Bytes(key.as_bytes()),
            Arg::Bytes(owner.as_bytes()),
            Arg::U64(lease_us),
            Arg::Bytes(owner.as_bytes()),
            Arg::U64(lease_us),
        ];
        self.execute(&self.sql.take, &args, bound).await?;
        let row = self
            .fetch(&self.sql.read, &[Arg::Bytes(key.as_bytes())], bound)
            .await?;
        let read = row.map(|row| {
            let holder: Option<Vec<u8>> = row.try_get(0)?;
            let fence: u64 = row.try_get(1)?;
            let left_us: i64 = row.try_get(2)?;
            Ok::<_, sqlx::Error>((holder, fence, left_us))
        });
        match read {
            Some(Ok((holder, fence, _))) if holder.as_deref() == Some(owner.as_bytes()) => {
                Ok(Take::Granted { token: fence })
            }
            Some(Ok((_, _, left_us))) => Ok(Take::Held {
                left: Duration::from_micros(u64::try_from(left_us).unwrap_or(0)),
            }),
            Some(Err(e)) => Err(Failure::Sql(e)),
            // Deleted between the take and the read (by hand): try again.
            None => Ok(Take::Held {
                left: Duration::ZERO,
            }),
        }
    }

    pub(super) async fn renew(
        &self,
        grant: &mut Grant,
        lease: Duration,
    ) -> Result<bool, AcquireError> {
        let sent = Instant::now();
        // After the lease end the row is anyone's: lost, whatever the row says now.
        if sent >= grant.expires {
            return Ok(false);
        }
        let bound = (sent + lease / 3).min(grant.expires);
        let args = [
            Arg::U64(micros(lease)),
            Arg::Bytes(grant.key.as_bytes()),
            Arg::Bytes(grant.owner.as_bytes()),
        ];
        match self.execute(&self.sql.renew, &args, bound).await {
            Ok(1) => {
                grant.expires = sent + lease;
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(_) => Err(AcquireError::Unavailable),
        }
    }

    pub(super) async fn release(&self, grant: &Grant) -> bool {
        let bound = Instant::now() + RELEASE_TIMEOUT;
        let args = [
            Arg::Bytes(grant.key.as_bytes()),
            Arg::Bytes(grant.owner.as_bytes()),
        ];
        self.execute(&self.sql.release, &args, bound).await.is_ok()
    }

    /// Releases `owner`'s hold on `key` in the background, if it has one.
    fn spawn_release(&self, key: String, owner: String) {
        let (pool, release) = (self.pool.clone(), self.sql.release.clone());
        tokio::spawn(async move {
            let bound = Instant::now() + RELEASE_TIMEOUT;
            let args = [Arg::Bytes(key.as_bytes()), Arg::Bytes(owner.as_bytes())];
            let _ = run(&pool, &release, &args, bound, Query::Execute).await;
        });
    }

    /// Runs a statement; the rows it changed (found).
    async fn execute(
        &self,
        sql: &SqlStr,
        args: &[Arg<'_>],
        bound: Instant,
    ) -> Result<u64, Failure> {
        match run(&self.pool, sql, args, bound, Query::Execute).await? {
            Answer::Changed(n) => Ok(n),
            Answer::Row(_) => Ok(0),
        }
    }

    /// Runs a query of at most one row.
    async fn fetch(
        &self,
        sql: &SqlStr,
        args: &[Arg<'_>],
        bound: Instant,
    ) -> Result<Option<MySqlRow>, Failure> {
        match run(&self.pool, sql, args, bound, Query::Fetch).await? {
            Answer::Row(row) => Ok(row),
            Answer::Changed(_) => Ok(None),
        }
    }
}

/// A bound parameter.
#[derive(Clone, Copy)]
enum Arg<'a> {
    Bytes(&'a [u8]),
    U64(u64),
}

#[derive(Clone, Copy)]
enum Query {
    Execute,
    Fetch,
}

enum Answer {
    Changed(u64),
    Row(Option<MySqlRow>),
}

/// Runs `sql` once on a pooled connection, within `bound`; again on another connection when
/// the first was dead (the server restarted), while the bound lasts.
async fn run(
    pool: &MySqlPool,
    sql: &SqlStr,
    args: &[Arg<'_>],
    bound: Instant,
    query: Query,
) -> Result<Answer, Failure> {
    // At most one try per pooled connection, plus a fresh one.
    for _ in 0..=POOL_SIZE {
        let mut conn = match tokio::time::timeout_at(bound, pool.acquire()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(Failure::Sql(e)),
            Err(_) => return Err(Failure::TimedOut),
        };
        match tokio::time::timeout_at(bound, once(&mut conn, sql, args, query)).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(e)) => {
                let failure = Failure::Sql(e);
                if !failure.connection_lost() {
                    return Err(failure);
                }
                conn.close_on_drop();
            }
            Err(_) => {
                // Cut short: its answer may still come, so the connection is not reused.
                conn.close_on_drop();
                return Err(Failure::TimedOut);
            }
        }
    }
    Err(Failure::TimedOut)
}

async fn once(
    conn: &mut PoolConnection<MySql>,
    sql: &SqlStr,
    args: &[Arg<'_>],
    query: Query,
) -> Result<Answer, sqlx::Error> {
    let mut statement = sqlx::query(sql.clone());
    for arg in args {
        statement = match *arg {
            Arg::Bytes(bytes) => statement.bind(bytes),
            Arg::U64(n) => statement.bind(n),
        };
    }
    match query {
        Query::Execute => Ok(Answer::Changed(
            statement.execute(&mut **conn).await?.rows_affected(),
        )),
        Query::Fetch => Ok(Answer::Row(statement.fetch_optional(&mut **conn).await?)),
    }
}

/// A failed statement as the caller sees it: cut short by the caller's own deadline, it is
/// a wait that ran out; else the server did not serve.
fn refusal(failure: &Failure, at_deadline: bool) -> AcquireError {
    match failure {
        Failure::TimedOut if at_deadline => AcquireError::Timeout,
        _ => AcquireError::Unavailable,
    }
}

/// Whether the server refused a statement for want of a right.
fn is_denied(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|e| e.number() == errno::TABLE_ACCESS_DENIED)
}

/// The row of resource `path`: the path itself (operators can read the table), or its hash
/// when it is longer than the column.
fn row_key(path: &str, resource: u128) -> String {
    if path.len() <= MAX_KEY_BYTES {
        path.to_owned()
    } else {
        format!("#xxh3:{resource:032x}")
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_mariadb::MariaDb;

    const TABLE: &str = "cacheguard_locks";
    const LEASE: Duration = Duration::from_secs(10);

    async fn service(url: &str) -> MysqlLocks {
        let locks = MysqlLocks::new("db", url, TABLE).expect("a MySQL URL");
        locks.check_at_start(url).await;
        locks
    }

    fn within(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    async fn grant(locks: &MysqlLocks, path: &str) -> Grant {
        locks
            .acquire(7, path, LEASE, within(2_000))
            .await
            .expect("granted")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grants_exclude_renew_release_and_tokens_grow() {
        let db = MariaDb::start().await;
        let (a, b) = (service(&db.url()).await, service(&db.url()).await);
        let mut first = grant(&a, "/r/1").await;
        assert_eq!(
            b.acquire(7, "/r/1", LEASE, within(150))
                .await
                .map(|g| g.token),
            Err(AcquireError::Timeout),
            "held by the first grant"
        );
        assert_eq!(a.renew(&mut first, LEASE).await, Ok(true));
        let stored = db.fence(TABLE, "/r/1").await;
        assert_eq!(stored, Some(first.token), "the token is the row's fence");
        let token = first.token;
        a.release(&first).await;
        drop(first);
        let second = grant(&b, "/r/1").await;
        assert!(second.token > token, "{} after {token}", second.token);
        // Another resource is another row.
        let other = grant(&a, "/r/2").await;
        b.release(&second).await;
        drop(second);
        a.release(&other).await;
        drop(other);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_past_its_lease_is_taken_over_and_its_renewal_says_lost() {
        let db = MariaDb::start().await;
        let (a, b) = (service(&db.url()).await, service(&db.url()).await);
        let lease = Duration::from_millis(300);
        let mut old = a
            .acquire(7, "/r/1", lease, within(1_000))
            .await
            .expect("granted");
        // The holder pauses past its lease: the next taker gets the row, with a larger token.
        let started = Instant::now();
        let new = b
            .acquire(7, "/r/1", LEASE, within(2_000))
            .await
            .expect("taken over at the lease end");
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
        assert!(new.token > old.token);
        assert_eq!(a.renew(&mut old, lease).await, Ok(false), "lost");
        // The old grant's release does not free the new holder's row.
        a.release(&old).await;
        drop(old);
        assert!(a.acquire(7, "/r/1", LEASE, within(150)).await.is_err());
        b.release(&new).await;
        drop(new);
    }

    /// Many takers on one free row at once, each with a pool of its own (instances): one
    /// wins each round, and the tokens grow round after round.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_take_wins_among_concurrent_takers() {
        let db = MariaDb::start().await;
        let mut services = Vec::new();
        for _ in 0..8 {
            services.push(std::sync::Arc::new(service(&db.url()).await));
        }
        let mut last = 0;
        for round in 0..6 {
            let path = format!("/race/{}", round % 2);
            let tasks: Vec<_> = services
                .iter()
                .map(|locks| {
                    let (locks, path) = (std::sync::Arc::clone(locks), path.clone());
                    tokio::spawn(async move {
                        let granted = locks.acquire(7, &path, LEASE, within(400)).await;
                        match granted {
                            Ok(grant) => {
                                let token = grant.token;
                                locks.release(&grant).await;
                                drop(grant);
                                Some(token)
                            }
                            Err(_) => None,
                        }
                    })
                })
                .collect();
            let mut tokens = Vec::new();
            for task in tasks {
                tokens.extend(task.await.expect("taker"));
            }
            // Released at once, so later takers of the round may win too, one at a time.
            assert!(!tokens.is_empty(), "round {round}: nobody won");
            tokens.sort_unstable();
            tokens.dedup();
            assert!(
                tokens.iter().all(|t| *t > last),
                "round {round}: {tokens:?} after {last}"
            );
            last = *tokens.last().unwrap_or(&last);
        }
        // Held, not released: exactly one of the takers wins.
        let tasks: Vec<_> = services
            .iter()
            .map(|locks| {
                let locks = std::sync::Arc::clone(locks);
                tokio::spawn(async move { locks.acquire(7, "/held", LEASE, within(400)).await })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            won += usize::from(task.await.expect("taker").is_ok());
        }
        assert_eq!(won, 1, "one grant among concurrent takers of a held row");
    }

    /// Waiters hold no connection: more waiters than the pool has connections all get
    /// their turn, and the server never sees more than the pool's connections.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiters_hold_no_connection() {
        let db = MariaDb::start().await;
        let locks = std::sync::Arc::new(service(&db.url()).await);
        let waiters = 3 * POOL_SIZE as usize;
        let tasks: Vec<_> = (0..waiters)
            .map(|_| {
                let locks = std::sync::Arc::clone(&locks);
                tokio::spawn(async move {
                    let grant = locks
                        .acquire(7, "/r/1", LEASE, within(20_000))
                        .await
                        .expect("every waiter gets its turn");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let token = grant.token;
                    locks.release(&grant).await;
                    drop(grant);
                    token
                })
            })
            .collect();
        let mut tokens = Vec::new();
        for task in tasks {
            tokens.push(task.await.expect("waiter"));
        }
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), waiters, "one token per grant");
        assert!(locks.pool.size() <= POOL_SIZE);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokens_keep_growing_across_a_kill_and_restart_of_the_server() {
        let mut db = MariaDb::start().await;
        let locks = service(&db.url()).await;
        let mut last = 0;
        for _ in 0..3 {
            let grant = grant(&locks, "/r/1").await;
            assert!(grant.token > last);
            last = grant.token;
            locks.release(&grant).await;
            drop(grant);
        }
        db.kill();
        let started = Instant::now();
        let down = locks.acquire(7, "/r/1", LEASE, within(5_000)).await;
        assert_eq!(down.map(|g| g.token), Err(AcquireError::Unavailable));
        assert!(
            started.elapsed() <= CONNECT_TIMEOUT + Duration::from_millis(300),
            "a server that is down costs the connect bound: {:?}",
            started.elapsed()
        );
        db.restart().await;
        // The pool's connections died with the server: the take finds a live one.
        let grant = grant(&locks, "/r/1").await;
        assert!(grant.token > last, "{} after {last}", grant.token);
        assert_eq!(db.fence(TABLE, "/r/1").await, Some(grant.token), "durable");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn misconfigurations_are_named() {
        let db = MariaDb::start().await;
        let problem = |url: String, table: &'static str| async move {
            let locks = MysqlLocks::new("db", &url, table).expect("a MySQL URL");
            let failure = locks.check(within(3_000)).await.expect_err("not usable");
            let started = Instant::now();
            let acquired = locks.acquire(7, "/r/1", LEASE, within(3_000)).await;
            assert_eq!(acquired.map(|g| g.token), Err(AcquireError::Unavailable));
            assert!(
                started.elapsed() <= CONNECT_TIMEOUT + Duration::from_millis(300),
                "{:?}",
                started.elapsed()
            );
            locks.explain(&failure)
        };
        let refused = problem(db.url_as(crate::test_mariadb::USER, "wrong"), TABLE).await;
        assert!(refused.contains("login was refused"), "{refused}");
        let closed_port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        let unreachable =
            problem(format!("mysql://u:p@127.0.0.1:{closed_port}/locks"), TABLE).await;
        assert!(unreachable.contains("cannot be reached"), "{unreachable}");
        db.root(&[
            "CREATE USER 'reader'@'%' IDENTIFIED BY 'pw'",
            "GRANT SELECT, INSERT, UPDATE ON locks.* TO 'reader'@'%'",
        ])
        .await;
        let missing = problem(db.url_as("reader", "pw"), "nowhere").await;
        assert!(
            missing.contains("`nowhere` is missing and this user may not create it"),
            "{missing}"
        );
        // The same user works once the table is there.
        db.root(&[&format!("CREATE TABLE locks.nowhere ({COLUMNS})")])
            .await;
        let locks = MysqlLocks::new("db", &db.url_as("reader", "pw"), "nowhere").expect("url");
        let granted = locks.acquire(7, "/r/1", LEASE, within(3_000)).await;
        assert!(granted.is_ok(), "{:?}", granted.map(|g| g.token));
    }

    #[test]
    fn long_paths_are_hashed_into_the_key_column() {
        assert_eq!(row_key("/trains/t1/seats/1A", 7), "/trains/t1/seats/1A");
        let long = format!("/{}", "a".repeat(300));
        let key = row_key(&long, 0xab);
        assert!(key.len() <= MAX_KEY_BYTES, "{key}");
        assert_eq!(key, format!("#xxh3:{:032x}", 0xab));
    }

    #[test]
    fn the_take_sets_lease_until_last() {
        let take = Statements::new("t").take.as_str().to_owned();
        let update = take
            .split("ON DUPLICATE KEY UPDATE")
            .nth(1)
            .unwrap_or_default();
        let fence = update.find("fence =").unwrap_or(usize::MAX);
        let owner = update.find("owner =").unwrap_or(usize::MAX);
        let lease = update.find("lease_until =").unwrap_or(0);
        assert!(fence < lease && owner < lease, "{update}");
    }
}
