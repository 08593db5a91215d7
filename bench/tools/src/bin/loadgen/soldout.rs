//! `loadgen soldout-probe`: how long a stock gate's sold-out mark takes to reach the other
//! instances of a fleet (bench/flash_sale.sh; see the crate docs).
//!
//! Per rep, on a fresh resource the origin gives 2 units:
//!
//! 1. one buy through instance A takes the first unit (it also loads the resource);
//! 2. the probers of B and C are released, and the clock starts (`t0`) as the buy of the
//!    last unit is sent to A;
//! 3. each prober sends, one after the other (`--gap-us` apart), on connections opened
//!    beforehand, a buy *head* with `Expect: 100-continue` and no body. An instance that
//!    holds the mark answers `409` with `X-Cache: SOLDOUT` at once (the mark is checked
//!    before the body is read); one that does not goes on to read the body, which makes
//!    hyper answer `100 Continue`: the prober then closes that connection without sending
//!    the body, so the probe never reaches Redis, takes no unit and marks nothing. The probe
//!    changes nothing: the first SOLDOUT is the bus's doing;
//! 4. a side channel subscribed to the event bus's Redis channel stamps the `stock soldout`
//!    message as Redis delivers it to every subscriber.
//!
//! All times are on one monotonic clock, from `t0`: A's answer, the bus message, and per
//! instance the answer to its first SOLDOUT probe (the mark was there by then: the
//! figure) and the send of the probe before it (which found no mark: a lower bound).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::parse_target;
use crate::stats::{ms, round3, summary};
use crate::{SoldOutArgs, positive};

/// Bound on one blocking read or write.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// An instance (or the origin): where to connect and what to put in `Host`.
#[derive(Clone)]
struct Endpoint {
    addr: SocketAddr,
    authority: String,
}

impl Endpoint {
    fn of(url: &str) -> Result<Endpoint, String> {
        let t = parse_target(url)?;
        Ok(Endpoint {
            addr: t.addr,
            authority: t.authority,
        })
    }

    fn connect(&self) -> Result<TcpStream, String> {
        let s = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT)
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        let _ = s.set_nodelay(true);
        s.set_read_timeout(Some(IO_TIMEOUT))
            .and_then(|()| s.set_write_timeout(Some(IO_TIMEOUT)))
            .map_err(|e| format!("socket: {e}"))?;
        Ok(s)
    }
}

/// The status code and X-Cache of a response head.
fn parse_head(head: &str) -> Option<(u16, Option<String>)> {
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let x_cache = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("x-cache"))
        .map(|(_, v)| v.trim().to_owned());
    Some((status, x_cache))
}

/// One request on a fresh connection with `Connection: close`, read to the end: its
/// status and X-Cache, and when the answer was read.
fn request(
    e: &Endpoint,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, Option<String>, Instant), String> {
    let mut s = e.connect()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: cacheguard-bench-loadgen\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        e.authority,
        body.len()
    );
    s.write_all(head.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let at = Instant::now();
    let text = String::from_utf8_lossy(&answer);
    let (status, x_cache) =
        parse_head(&text).ok_or_else(|| format!("no HTTP answer from {}", e.addr))?;
    Ok((status, x_cache, at))
}

/// What one probe found.
enum Probe {
    /// The mark: `409`, `X-Cache: SOLDOUT`.
    Marked,
    /// `100 Continue`: no mark, the instance went on to read the body.
    Unmarked,
    /// Any other answer (its status).
    Other(u16),
}

/// One probe on the connection `s` (see the module docs); `s` is closed after it.
fn probe(mut s: TcpStream, authority: &str, path: &str) -> Result<Probe, String> {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: cacheguard-bench-loadgen\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    );
    s.write_all(head.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if n == 0 || buf.len() > 64 * 1024 {
            return Err("connection closed before a whole head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let (status, x_cache) =
        parse_head(&String::from_utf8_lossy(&buf)).ok_or("unreadable answer head")?;
    Ok(match status {
        100 => Probe::Unmarked,
        _ if x_cache.as_deref() == Some("SOLDOUT") => Probe::Marked,
        other => Probe::Other(other),
    })
}

/// What one instance's prober saw in one rep.
#[derive(Default)]
struct Seen {
    /// Send and answer of the first SOLDOUT probe.
    marked: Option<(Instant, Instant)>,
    /// Send of the last probe that found no mark.
    last_unmarked: Option<Instant>,
    unmarked: u64,
    other: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
}

/// Probes `e` until it answers SOLDOUT, `limit` probes or `max_wait` after the release.
fn prober(
    e: &Endpoint,
    path: &str,
    mut pool: Vec<TcpStream>,
    release: &Barrier,
    gap: Duration,
    limit: u64,
    max_wait: Duration,
) -> Seen {
    let mut seen = Seen::default();
    release.wait();
    let until = Instant::now() + max_wait;
    for _ in 0..limit {
        if Instant::now() >= until {
            break;
        }
        let s = match pool.pop().map_or_else(|| e.connect(), Ok) {
            Ok(s) => s,
            Err(err) => {
                *seen.errors.entry(err).or_default() += 1;
                continue;
            }
        };
        let sent = Instant::now();
        match probe(s, &e.authority, path) {
            Ok(Probe::Marked) => {
                seen.marked = Some((sent, Instant::now()));
                break;
            }
            Ok(Probe::Unmarked) => {
                seen.unmarked += 1;
                seen.last_unmarked = Some(sent);
            }
            Ok(Probe::Other(status)) => *seen.other.entry(status.to_string()).or_default() += 1,
            Err(err) => *seen.errors.entry(err).or_default() += 1,
        }
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
    }
    seen
}

/// A RESP value, as much of it as a subscriber needs.
enum Resp {
    Bulk(Option<Vec<u8>>),
    Array(Vec<Resp>),
    Other,
}

/// Reads one RESP value. Hand-written: the bench tools have no Redis client, and a
/// subscriber only ever reads arrays of bulk strings and integers.
fn read_resp(r: &mut impl BufRead) -> std::io::Result<Resp> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let line = line.trim_end();
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad RESP");
    let (kind, rest) = line.split_at_checked(1).ok_or_else(bad)?;
    match kind {
        "$" => {
            let len: i64 = rest.parse().map_err(|_| bad())?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Resp::Bulk(None));
            };
            let mut data = vec![0; len + 2];
            r.read_exact(&mut data)?;
            data.truncate(len);
            Ok(Resp::Bulk(Some(data)))
        }
        "*" => {
            let n: i64 = rest.parse().map_err(|_| bad())?;
            let n = usize::try_from(n).unwrap_or(0);
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_resp(r)?);
            }
            Ok(Resp::Array(items))
        }
        "-" => Err(std::io::Error::other(format!("Redis error: {rest}"))),
        _ => Ok(Resp::Other),
    }
}

/// Subscribes to `channel` on the Redis at `addr` and, from a thread of its own, sends
/// every message with the instant it was read. Returns once the subscription is confirmed.
fn subscribe(addr: SocketAddr, channel_name: &str) -> Result<Receiver<(Instant, String)>, String> {
    let mut s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
        .map_err(|e| format!("connect to Redis {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    let cmd = format!(
        "*2\r\n$9\r\nSUBSCRIBE\r\n${}\r\n{channel_name}\r\n",
        channel_name.len()
    );
    s.write_all(cmd.as_bytes())
        .map_err(|e| format!("SUBSCRIBE: {e}"))?;
    let mut r = BufReader::new(s);
    match read_resp(&mut r) {
        Ok(Resp::Array(items)) if items.len() == 3 => {}
        Ok(_) => return Err("SUBSCRIBE: unexpected answer".into()),
        Err(e) => return Err(format!("SUBSCRIBE: {e}")),
    }
    let (tx, rx): (Sender<(Instant, String)>, _) = channel();
    std::thread::spawn(move || {
        while let Ok(value) = read_resp(&mut r) {
            let at = Instant::now();
            if let Resp::Array(items) = value
                && let [Resp::Bulk(Some(kind)), _, Resp::Bulk(Some(payload))] = items.as_slice()
                && kind == b"message"
                && tx
                    .send((at, String::from_utf8_lossy(payload).into_owned()))
                    .is_err()
            {
                return;
            }
        }
    });
    Ok(rx)
}

fn since(t0: Instant, t: Instant) -> f64 {
    if t >= t0 { ms(t - t0) } else { -ms(t0 - t) }
}

/// What one rep measured (ms from `t0`): its record, per instance when the mark was seen
/// there, when the bus message came, and when every instance had it.
struct RepResult {
    record: Value,
    marked: Vec<Option<f64>>,
    published: Option<f64>,
    reached_all: Option<f64>,
}

/// One rep (see the module docs).
fn rep(
    args: &SoldOutArgs,
    n: u64,
    a: &Endpoint,
    probed: &[Endpoint],
    origin: &Endpoint,
    bus: &Receiver<(Instant, String)>,
) -> Result<RepResult, String> {
    let resource = args.resource_template.replace("{rep}", &n.to_string());
    let orders = format!("{resource}/orders");
    let set = format!(
        "/shop/stock/{}",
        resource
            .strip_prefix("/trains/")
            .and_then(|r| r.split_once("/seats/"))
            .map(|(t, s)| format!("{t}/{s}"))
            .ok_or("--resource-template must be /trains/{train}/seats/{type}")?
    );
    let (status, _, _) = request(origin, "PUT", &set, "2")?;
    if status != 200 {
        return Err(format!("origin answered {status} to PUT {set}"));
    }
    let (status, _, _) = request(a, "POST", &orders, "{}")?;
    if status != 201 {
        return Err(format!("the first buy on A answered {status}"));
    }
    std::thread::sleep(Duration::from_millis(args.pause_ms));
    while bus.try_recv().is_ok() {}

    let release = Arc::new(Barrier::new(probed.len() + 1));
    let gap = Duration::from_micros(args.gap_us);
    let max_wait = Duration::from_millis(args.max_wait_ms);
    let mut threads = Vec::new();
    for e in probed {
        let pool = (0..args.pool)
            .map(|_| e.connect())
            .collect::<Result<Vec<_>, _>>()?;
        let (e, path, release) = (e.clone(), orders.clone(), release.clone());
        let limit = args.max_probes;
        threads.push(std::thread::spawn(move || {
            prober(&e, &path, pool, &release, gap, limit, max_wait)
        }));
    }
    release.wait();
    let t0 = Instant::now();
    let last = request(a, "POST", &orders, "{}");
    let seen: Vec<Seen> = threads
        .into_iter()
        .map(|t| t.join().unwrap_or_default())
        .collect();
    let (last_status, last_x_cache, answered) = last?;
    let published = bus
        .try_iter()
        .find(|(at, msg)| *at >= t0 && msg.starts_with("stock soldout"))
        .map(|(at, _)| since(t0, at));
    let marked: Vec<Option<f64>> = seen
        .iter()
        .map(|s| s.marked.map(|(_, at)| since(t0, at)))
        .collect();
    let reached_all = if marked.iter().all(Option::is_some) {
        marked.iter().flatten().copied().reduce(f64::max)
    } else {
        None
    };
    let instances: Vec<Value> = seen
        .iter()
        .map(|s| {
            json!({
                "marked_sent_ms": s.marked.map(|(at, _)| round3(since(t0, at))),
                "marked_answered_ms": s.marked.map(|(_, at)| round3(since(t0, at))),
                "last_unmarked_sent_ms": s.last_unmarked.map(|at| round3(since(t0, at))),
                "unmarked_probes": s.unmarked,
                "other": s.other,
                "errors": s.errors,
            })
        })
        .collect();
    let record = json!({
        "rep": n,
        "resource": resource,
        "last_buy_status": last_status,
        "last_buy_x_cache": last_x_cache,
        "last_buy_answered_ms": round3(since(t0, answered)),
        "bus_message_ms": published.map(round3),
        "reached_all_ms": reached_all.map(round3),
        "instances": instances,
    });
    Ok(RepResult {
        record,
        marked,
        published,
        reached_all,
    })
}

pub async fn soldout_probe(args: SoldOutArgs) -> Result<Value, String> {
    tokio::task::spawn_blocking(move || run(&args))
        .await
        .map_err(|e| format!("prober: {e}"))?
}

fn run(args: &SoldOutArgs) -> Result<Value, String> {
    positive(args.max_wait_ms as f64, "--max-wait-ms")?;
    if args.reps == 0 || args.probe_urls.is_empty() {
        return Err("--reps must be > 0 and --probe-url given".into());
    }
    let a = Endpoint::of(&args.buy_url)?;
    let origin = Endpoint::of(&args.origin)?;
    let probed = args
        .probe_urls
        .iter()
        .map(|u| Endpoint::of(u))
        .collect::<Result<Vec<_>, _>>()?;
    let redis: SocketAddr = args
        .redis
        .parse()
        .map_err(|_| format!("--redis must be IP:PORT: {}", args.redis))?;
    let bus = subscribe(redis, &args.channel)?;

    let mut records = Vec::new();
    let mut per_instance: Vec<Vec<f64>> = vec![Vec::new(); probed.len()];
    let mut bus_ms = Vec::new();
    let mut all_ms = Vec::new();
    let mut failed = BTreeMap::new();
    let mut not_reached = 0u64;
    let deadline = Instant::now() + Duration::from_secs_f64(args.max_duration_s);
    for n in 0..args.reps {
        if Instant::now() >= deadline {
            break;
        }
        match rep(args, args.first_rep + n, &a, &probed, &origin, &bus) {
            Ok(r) => {
                for (i, m) in r.marked.iter().enumerate() {
                    if let Some(m) = m {
                        per_instance[i].push(*m);
                    }
                }
                bus_ms.extend(r.published);
                match r.reached_all {
                    Some(at) => all_ms.push(at),
                    None => not_reached += 1,
                }
                records.push(r.record);
            }
            Err(e) => *failed.entry(e).or_insert(0u64) += 1,
        }
        std::thread::sleep(Duration::from_millis(args.pause_ms));
    }
    let instances: Vec<Value> = probed
        .iter()
        .zip(per_instance.iter_mut())
        .map(|(e, v)| json!({"addr": e.addr.to_string(), "marked_ms": summary(v)}))
        .collect();
    Ok(json!({
        "mode": "soldout-probe",
        "reps": records.len(),
        "failed_reps": failed,
        "reps_not_reached": not_reached,
        "gap_us": args.gap_us,
        "max_wait_ms": args.max_wait_ms,
        "reached_all_ms": summary(&mut all_ms),
        "bus_message_ms": summary(&mut bus_ms),
        "instances": instances,
        "records": records,
    }))
}
