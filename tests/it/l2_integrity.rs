//! A value read from Redis proves it is whole before a byte of it is served. An entry's
//! value cut (inside its head, inside its body, exactly at the 256 KiB of a first read, one
//! byte past it), padded, or with one byte changed (in its meta, head or body) is a counted
//! decode error and a miss; the fill that follows overwrites it with a whole value, which
//! the next reads serve. For a small value (read in one command) and a large one (read in
//! pieces on the bulk connection), in each route `l1` mode, on a standalone Redis and, for
//! fewer cases, on a cluster. And a large value's buffer, shared by its readers, is shared
//! only while Redis holds that same value.

use std::time::Duration;

use crate::common::entry::decode;
use crate::common::{
    CgConfig, HttpClient, RedisCluster, RedisServer, SharedRedis, TestConn, TestOrigin, item_route,
    metric, poll_until, stalled_get, url,
};

const DECODE_ERRORS: &str = "cacheguard_entry_decode_errors_total";
const KIB: usize = 1024;
/// A value this size is read whole by the first `GETRANGE`.
const SMALL: usize = 3 * KIB;
/// A value this size is read in pieces after its first 256 KiB.
const LARGE: usize = 600 * KIB;
/// What the first read of a value takes: 256 KiB (a larger value is read on from there).
const WINDOW: usize = 256 * KIB;

/// How a stored value is damaged.
#[derive(Clone, Copy, Debug)]
enum Damage {
    CutInHead,
    CutInBody,
    /// Cut to exactly the first read's 256 KiB: that read sees a whole value of that size.
    CutAtWindow,
    /// One byte past it: the first read sees a large value, the rest is missing.
    CutPastWindow,
    Padded,
    /// A small value padded past the first read's window.
    PaddedPastWindow,
    FlipInMeta,
    FlipInHead,
    FlipInBody,
    /// The value's last byte (a large value's last piece).
    FlipLast,
}

const SMALL_DAMAGE: [Damage; 7] = [
    Damage::CutInBody,
    Damage::CutInHead,
    Damage::Padded,
    Damage::PaddedPastWindow,
    Damage::FlipInMeta,
    Damage::FlipInHead,
    Damage::FlipInBody,
];

const LARGE_DAMAGE: [Damage; 9] = [
    Damage::CutInBody,
    Damage::CutInHead,
    Damage::CutAtWindow,
    Damage::CutPastWindow,
    Damage::Padded,
    Damage::FlipInMeta,
    Damage::FlipInHead,
    Damage::FlipInBody,
    Damage::FlipLast,
];

/// Where a flip in the meta lands: the low byte of the status (its first field), so that
/// `200` reads `201`, a status as valid as the first: only the checksum can tell.
const META_AT: usize = 19;

/// A stored value, and where its parts are. Found by the bytes it holds rather than decoded,
/// so the damage can be made to a value of any format version.
struct Stored {
    name: Vec<u8>,
    raw: Vec<u8>,
    /// Where the head (the key, then the header lines) starts.
    head_at: usize,
    /// Where the body starts: the body is last.
    body_at: usize,
}

impl Damage {
    /// The command that damages `stored` this way: `SET` for a cut, `SETRANGE` for the rest.
    fn command(self, stored: &Stored) -> redis::Cmd {
        let Stored {
            name,
            raw,
            head_at,
            body_at,
        } = stored;
        let cut = |len: usize| {
            let mut cmd = redis::cmd("SET");
            cmd.arg(name).arg(&raw[..len]).arg("KEEPTTL");
            cmd
        };
        let write = |at: usize, bytes: Vec<u8>| {
            let mut cmd = redis::cmd("SETRANGE");
            cmd.arg(name).arg(at).arg(bytes);
            cmd
        };
        let flip = |at: usize| write(at, vec![raw[at] ^ 0x01]);
        let len = raw.len();
        match self {
            Damage::CutInHead => cut(head_at + (body_at - head_at) / 2),
            Damage::CutInBody => cut(body_at + (len - body_at) / 2),
            Damage::CutAtWindow => cut(WINDOW),
            Damage::CutPastWindow => cut(WINDOW + 1),
            Damage::Padded => write(len, b"\0\0pad".to_vec()),
            Damage::PaddedPastWindow => write(len, vec![b'p'; WINDOW]),
            Damage::FlipInMeta => flip(META_AT),
            // The last byte of the last header value: still a valid header.
            Damage::FlipInHead => flip(body_at - 1),
            Damage::FlipInBody => flip(body_at + (len - body_at) / 2),
            Damage::FlipLast => flip(len - 1),
        }
    }
}

/// A body of `size` bytes that differs at every offset from its neighbours.
fn body_of(size: usize, seed: usize) -> Vec<u8> {
    (0..size).map(|i| ((i * 7 + seed) % 251) as u8).collect()
}

/// The entry stored for `path` with `body`, once there: the value holding the path's key
/// and ending with the body.
async fn stored<R: SharedRedis>(
    redis: &R,
    mut conn: TestConn,
    path: &str,
    body: &[u8],
) -> Option<Stored> {
    let key = format!("item\n{path}\n");
    for name in redis.entry_keys().await {
        let raw: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .expect("GET");
        let Some(raw) = raw else { continue };
        let Some(head_at) = raw.windows(key.len()).position(|w| w == key.as_bytes()) else {
            continue;
        };
        if raw.ends_with(body) {
            let body_at = raw.len() - body.len();
            return Some(Stored {
                name,
                raw,
                head_at,
                body_at,
            });
        }
    }
    None
}

/// For each case (`size`, `damage`): an entry stored through one instance, damaged in
/// Redis, then asked for through another (its L1 has no copy): the answer is the origin's
/// (a miss), the decode error is counted, and afterwards Redis holds a whole value that a
/// third instance (L1 off) serves as a hit, as does the second.
async fn damaged_values_are_counted_misses_then_overwritten<R: SharedRedis>(
    redis: &R,
    l1: &str,
    cases: &[(usize, Damage)],
) {
    let origin = TestOrigin::start().await;
    let config = redis
        .configure(CgConfig::new(&origin))
        .set_str("redis", "command_timeout", "2s")
        .l1(l1)
        .routes(&item_route("max_entry_bytes = 1048576"));
    let writer = config.start().await;
    let reader = config.start().await;
    let checker = config.clone().l1("off").start().await;
    let client = HttpClient::new();
    let mut conn = redis.conn().await;
    for (i, &(size, damage)) in cases.iter().enumerate() {
        let what = format!("l1 = {l1}, {} KiB value, {damage:?}", size / KIB);
        let path = format!("/api/items/damaged-{l1}-{i}");
        let body = body_of(size, i);
        origin.set_body(&path, body.clone());
        let r = client.get(&url(writer.addr(), &path)).await;
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (200, "MISS"),
            "{what}: {r}"
        );

        let found = poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
            stored(redis, conn.clone(), &path, &body)
        })
        .await;
        let damaged = found.unwrap_or_else(|| panic!("{what}: nothing stored"));
        let _: () = damage
            .command(&damaged)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{what}: damaging the value: {e}"));

        let errors = metric(&client, reader.admin_addr(), DECODE_ERRORS, &[]).await;
        let fetched = origin.count(&path);
        let r = client.get(&url(reader.addr(), &path)).await;
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (200, "MISS"),
            "{what}: the damaged value was served: {r}"
        );
        assert!(r.body == body, "{what}: {} bytes answered", r.body.len());
        assert_eq!(
            origin.count(&path),
            fetched + 1,
            "{what}: the origin was not asked"
        );
        let counted = metric(&client, reader.admin_addr(), DECODE_ERRORS, &[]).await;
        assert!(
            counted > errors,
            "{what}: no decode error counted ({counted})"
        );

        let whole = poll_until(
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async {
                let now = stored(redis, conn.clone(), &path, &body).await?;
                let entry = decode(&now.raw).ok()?;
                (now.raw != damaged.raw && entry.body == body).then_some(())
            },
        )
        .await;
        assert!(
            whole.is_some(),
            "{what}: the damaged value was not overwritten whole"
        );
        let r = client.get(&url(checker.addr(), &path)).await;
        assert_eq!(r.x_cache(), "HIT-L2", "{what}: the refilled value: {r}");
        assert!(
            r.body == body,
            "{what}: refilled value served {} bytes",
            r.body.len()
        );
        let r = client.get(&url(reader.addr(), &path)).await;
        assert!(
            r.is_hit() && r.body == body,
            "{what}: after the refill: {r}"
        );
    }
    for cg in [writer, reader, checker] {
        cg.shutdown().await;
    }
}

/// Every damage to a small and to a large value.
fn every_case() -> Vec<(usize, Damage)> {
    let small = SMALL_DAMAGE.iter().map(|d| (SMALL, *d));
    let large = LARGE_DAMAGE.iter().map(|d| (LARGE, *d));
    small.chain(large).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_value_is_a_counted_miss_and_overwritten_with_l1_off() {
    let redis = RedisServer::start().await;
    damaged_values_are_counted_misses_then_overwritten(&redis, "off", &every_case()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_value_is_a_counted_miss_and_overwritten_with_l1_hot() {
    let redis = RedisServer::start().await;
    damaged_values_are_counted_misses_then_overwritten(&redis, "hot", &every_case()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_value_is_a_counted_miss_and_overwritten_with_l1_all() {
    let redis = RedisServer::start().await;
    damaged_values_are_counted_misses_then_overwritten(&redis, "all", &every_case()).await;
}

/// On a cluster (shared connection, no per-thread reads; the bulk connection routed by
/// slot): a few of the cases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_value_on_a_cluster_is_a_counted_miss_and_overwritten() {
    let cluster = RedisCluster::start().await;
    let cases = [
        (SMALL, Damage::CutInBody),
        (SMALL, Damage::FlipInMeta),
        (LARGE, Damage::CutAtWindow),
        (LARGE, Damage::Padded),
        (LARGE, Damage::FlipLast),
    ];
    damaged_values_are_counted_misses_then_overwritten(&cluster, "hot", &cases).await;
}

/// A whole, valid entry copied under another key's name (as `COPY <a> <b> REPLACE` would:
/// here `GET` then `SET`, which a cluster allows across slots) is a miss for the key whose
/// name it has, counted as a decode error like any value refused, and the fill that
/// follows overwrites it. A small and a large value (a large one is checked on its own
/// path, the live table). Before, it was a correct miss but neither counted nor logged.
async fn an_entry_under_another_key_is_a_counted_miss<R: SharedRedis>(redis: &R) {
    let origin = TestOrigin::start().await;
    let config = redis
        .configure(CgConfig::new(&origin))
        .set_str("redis", "command_timeout", "2s")
        .routes(&item_route("max_entry_bytes = 1048576"));
    let writer = config.start().await;
    let reader = config.clone().l1("off").start().await;
    let client = HttpClient::new();
    let mut conn = redis.conn().await;
    for (i, size) in [SMALL, LARGE].into_iter().enumerate() {
        let what = format!("{} KiB value", size / KIB);
        let (from, to) = (
            format!("/api/items/moved-from-{i}"),
            format!("/api/items/moved-to-{i}"),
        );
        let mut stored_values = Vec::new();
        for (j, path) in [&from, &to].into_iter().enumerate() {
            let body = body_of(size, 2 * i + j);
            origin.set_body(path, body.clone());
            let r = client.get(&url(writer.addr(), path)).await;
            assert_eq!(r.x_cache(), "MISS", "{what}: {path}: {r}");
            let found = poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
                stored(redis, conn.clone(), path, &body)
            })
            .await;
            stored_values.push(found.unwrap_or_else(|| panic!("{what}: {path}: nothing stored")));
        }
        let _: () = redis::cmd("SET")
            .arg(&stored_values[1].name)
            .arg(&stored_values[0].raw)
            .arg("KEEPTTL")
            .query_async(&mut conn)
            .await
            .expect("SET");

        let errors = metric(&client, reader.admin_addr(), DECODE_ERRORS, &[]).await;
        let fetched = origin.count(&to);
        let r = client.get(&url(reader.addr(), &to)).await;
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (200, "MISS"),
            "{what}: the other key's entry was served: {r}"
        );
        assert!(r.body == body_of(size, 2 * i + 1), "{what}: wrong body");
        assert_eq!(
            origin.count(&to),
            fetched + 1,
            "{what}: the origin was not asked"
        );
        let counted = metric(&client, reader.admin_addr(), DECODE_ERRORS, &[]).await;
        // Counted once per read that found it: the lookup's, and the fill's re-check.
        assert!(
            counted > errors,
            "{what}: the entry of another key was not counted ({counted})"
        );
        let refilled = poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
            stored(redis, conn.clone(), &to, &r.body)
        })
        .await;
        assert!(
            refilled.is_some(),
            "{what}: not overwritten with its own entry"
        );
        let r = client.get(&url(reader.addr(), &to)).await;
        assert!(
            r.is_hit() && r.body == body_of(size, 2 * i + 1),
            "{what}: after the refill: {r}"
        );
    }
    writer.shutdown().await;
    reader.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_under_another_key_is_a_counted_miss_on_a_standalone_redis() {
    let redis = RedisServer::start().await;
    an_entry_under_another_key_is_a_counted_miss(&redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_under_another_key_is_a_counted_miss_on_a_cluster() {
    let cluster = RedisCluster::start().await;
    an_entry_under_another_key_is_a_counted_miss(&cluster).await;
}

/// Readers of a large value share the buffer of a copy still held only while Redis holds
/// that same value: with a copy held (by a client that reads nothing: 8 MiB, more than the
/// sockets' buffers take), the value removed (as an invalidation does) and filled again with
/// another body, the next read serves the new body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_large_copy_is_shared_only_while_redis_holds_that_value() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let config = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("redis", "command_timeout", "2s")
        .l1("off")
        .routes(&item_route("max_entry_bytes = 16777216"));
    let writer = config.start().await;
    let reader = config.start().await;
    let client = HttpClient::new();
    let path = "/api/items/held";
    let held = 8 * 1024 * KIB;
    let (first, second) = (body_of(held, 1), body_of(held, 2));
    origin.set_body(path, first.clone());
    let r = client.get(&url(writer.addr(), path)).await;
    assert_eq!(r.x_cache(), "MISS", "{r}");

    let answered = || {
        metric(
            &client,
            reader.admin_addr(),
            "cacheguard_requests_total",
            &[],
        )
    };
    let before = answered().await;
    let stalled = stalled_get(reader.addr(), path).await;
    let held = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async { (answered().await > before).then_some(()) },
    )
    .await;
    assert!(held.is_some(), "the stalled client got no answer");
    let r = client.get(&url(reader.addr(), path)).await;
    assert!(
        r.x_cache() == "HIT-L2" && r.body == first,
        "beside the held copy: {r}"
    );

    let mut conn = redis.client().await;
    for name in redis.entry_keys().await {
        let _: () = redis::cmd("DEL")
            .arg(name)
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
    origin.set_body(path, second.clone());
    let r = client.get(&url(writer.addr(), path)).await;
    assert!(r.x_cache() == "MISS" && r.body == second, "refill: {r}");
    let r = client.get(&url(reader.addr(), path)).await;
    assert_eq!(r.x_cache(), "HIT-L2", "{r}");
    assert!(
        r.body == second,
        "the held copy of the old value was served"
    );
    drop(stalled);
    writer.shutdown().await;
    reader.shutdown().await;
}
