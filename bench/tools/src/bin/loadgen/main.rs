//! Load client for the bench scripts.
//!
//! `loadgen stampede --url URL [--url URL2 ...] --concurrency C --timeout-s 30 [--warm-path P]`
//!
//! 1. Opens C keep-alive HTTP/1.1 connections, spread round-robin over the URLs (at most
//!    `--connect-parallelism` connects in flight, so no SYN is dropped by a full backlog).
//! 2. With `--warm-path`, sends one GET of that (already cached) path on every connection and
//!    reads the whole answer, so each connection is known to be accepted and served by the
//!    proxy before the stampede (a bare TCP connect only proves the kernel queued it).
//! 3. When every connection is ready (or failed), releases one GET of its URL on each at the
//!    same moment (a watch channel is the barrier).
//! 4. Prints one JSON object: counts, errors, latency percentiles, the X-Cache and status
//!    histograms, per-URL figures, and the send skew.
//!
//! Latency of a request is measured from the moment its first byte is handed to the kernel
//! (the first `write` on its connection after the release; recorded by a wrapper around the
//! socket) to the end of its body. The send skew is the spread of those moments.
//!
//! `loadgen rate --url URL --rate R --duration-s D --connections C [--warmup-s W] [--drain-s 5]
//!  [--post-bytes N]`
//!
//! Open loop at a fixed rate, free of coordinated omission (GETs; with `--post-bytes N`, POSTs
//! of a JSON body of exactly N bytes, `{"payload":"xx…x"}`, as bench/post_body.lua sends):
//!
//! 1. Opens C keep-alive HTTP/1.1 connections to URL (all must connect, or it fails).
//! 2. A pacer thread (an OS thread with `std::thread::sleep`, not the 1 ms tokio timer)
//!    schedules request i at `start + i/R`, for W + D seconds, into a FIFO queue. The first
//!    W seconds are warm-up: sent at the same rate, left out of every figure.
//! 3. Each connection takes the oldest queued request when it is free and sends it. When
//!    every connection is busy, a due request waits in the queue.
//! 4. Latency is measured from the request's *scheduled* time to the end of its body, so
//!    the time it waited for a free connection (and any pacer lag) counts. Service time
//!    (actual send to end of body) and send lag (scheduled to actual send) are reported
//!    beside it, to tell a slow target from a late generator.
//! 5. After the last scheduled request it waits at most `--drain-s` for the queue and the
//!    in-flight requests; whatever is left is counted as unsent / unfinished. A request
//!    taking over `--timeout-s` is an error and its connection is replaced.
//!
//! Prints one JSON object: counts, achieved rate, exact percentiles (nearest rank over the
//! full sorted vector of measured latencies) and the X-Cache / status / body-size histograms.
//!
//! `loadgen list --url 'http://IP:PORT/items/{id}' --ids-file F --connections C
//!  [--max-duration-s 600] [--passed-out FILE] [--reject-x-cache REJECT]`
//!
//! Closed loop at full speed over a fixed list: every id of F (one per line) is requested
//! exactly once, in file order, by whichever of the C keep-alive connections is free next.
//! 1. Opens the C connections before the clock starts (all must connect, or it fails).
//! 2. Each connection takes the next id, GETs it, reads the whole body, and takes the next;
//!    a connection the server closed is replaced (counted as a reconnect).
//! 3. Ends when the list is done; after `--max-duration-s` no new id is handed out (the rest
//!    are counted as unsent).
//! 4. Prints one JSON object: counts, elapsed time (first send to last answer) and the rate,
//!    latency percentiles (send to end of body), X-Cache / status / body-size histograms.
//!    With `--passed-out`, writes the ids whose answer did not carry `X-Cache:
//!    <--reject-x-cache>` (or failed) to that file, one per line.
//!
//! `loadgen cycle --url 'http://IP:PORT/items/{id}' [--url URL2 ...] --keys N [--first-id 1]
//!  --rate R --duration-s D --connections C [--bucket-ms 1000] [--drain-s 5]`
//!
//! Open loop at a fixed rate cycling over N keys, with a timeline (bench/avalanche.sh):
//! 1. Opens C keep-alive connections per URL (all must connect, or it fails).
//! 2. A pacer thread schedules request j at `start + j/R` for D seconds. Request j goes to URL
//!    `j mod U` (U URLs) and asks for id `first_id + (j div U) mod N`, so every URL cycles
//!    through all N keys in order, each at R/U req/s. One pass (D = N/R) is a fill burst.
//! 3. Each URL's connections take its oldest due request when free (a due request waits in
//!    that URL's queue when all are busy); a connection the server closed is replaced.
//! 4. Latency runs from the scheduled time to the end of the body (as in `rate`).
//! 5. Prints one JSON object: totals, the X-Cache / status histograms, and `timeline`: per
//!    `--bucket-ms` bucket of *scheduled* time, the scheduled / ok / non-2xx / error counts,
//!    status and X-Cache histograms and latency percentiles. `start_unix_ms` is the
//!    wall-clock time of `start`, to line the timeline up with other processes' clocks.
//!
//! `loadgen stale --url http://IP:PORT [--url URL2 ...] [--path-template /kv/{key}]
//!  [--writers 8] [--readers 32] [--keys 100] [--duration-s 10] --delay-ms D`
//!
//! Closed-loop read-your-writes check against a versioned KV origin (bench-origin `--kv`)
//! behind one or more caches (bench/stale_window.sh):
//! 1. Opens one keep-alive connection per loop and URL (all must connect, or it fails).
//! 2. W writer loops: a random key, `PUT`, record (key, the version the answer returns, the
//!    instant the answer arrived). R reader loops: a random key, `GET`, record (key,
//!    instance, the instant the request was sent, the version in the JSON body). Each
//!    request goes to a random URL. Every loop stops at `--duration-s` or after
//!    `--max-requests-per-loop` requests; each request is bounded by `--timeout-s`.
//! 3. All instants come from one monotonic clock (`std::time::Instant`), shared by every
//!    loop. For each write (key k, version v, returned at t_w), its *stale window* is the
//!    largest (read start − t_w) over reads of k that started at or after t_w and returned a
//!    version < v (0 when there is none).
//! 4. Prints one JSON object: counts, errors by kind, the distribution of stale windows over
//!    all writes (p50/p90/p99/p99.9/max, ms), `stale_reads_total` (reads that started at or
//!    after the return of some write to their key and returned an older version) and
//!    `stale_reads_after_delay` (the same, started more than D ms after that return: with a
//!    working delayed double delete of `double_delete_delay = D`, this must be 0), the latter
//!    broken down by instance and X-Cache, with samples.
//!
//! `loadgen soak --url http://IP:PORT [--url URL2 ...] [--path-template /kv/{key}]
//!  [--writers 8] [--readers 32] [--keys 200] [--write-rate 40] [--read-rate 400]
//!  [--duration-s 180] --delay-ms D [--bucket-ms 1000]`
//!
//! Paced writers and readers of a versioned KV origin for minutes, with a timeline
//! (bench/soak.sh: faults are injected while it runs):
//! 1. Opens one keep-alive connection per loop and URL (all must connect, or it fails); a
//!    connection that breaks later is re-opened on the loop's next request.
//! 2. W writer loops share `--write-rate` PUTs per second and R reader loops share
//!    `--read-rate` GETs per second: each loop sends its j-th request at start + phase +
//!    j × period (a loop over a second behind drops the slots it missed, counted in
//!    `dropped_slots`), to a random key and a random URL, each bounded by `--timeout-s`.
//! 3. A read is stale when it started more than D ms after some write to its key returned
//!    version v and it read a version < v (as `stale_reads_after_delay` of `stale`).
//! 4. Prints one JSON object: counts, statuses (`status_5xx`), errors by kind, stale reads
//!    by instance and X-Cache with samples, the start of each (`stale_read_times_s`, seconds
//!    from the start, sorted) and of the last one (`last_stale_read_s`), latencies, and `timeline`: per `--bucket-ms` bucket of send
//!    time, reads and writes answered 2xx, other statuses, errors, stale reads and X-Cache.
//!    `start_unix_ms` is the wall-clock time of the start, to line it up with a fault log.
//!
//! `loadgen buyers --url http://IP:PORT [--url URL2 ...] --resource /trains/t/seats/a
//!  [--resource R2 ...] [--clients 12] [--pace-ms 15] --duration-s D [--idempotency-keys]
//!  [--ops-out FILE]`
//!
//! A flash sale's buyers (bench/flash_sale.sh, the flood runs), shaped like the Jepsen-style
//! tests' clients: C client tasks, each one buy at a time; client p's k-th buy goes to
//! instance (p + k) mod U and POSTs `{}` to `<resource (p + k) mod R>/orders`, with an
//! `Idempotency-Key` when asked; then it pauses `--pace-ms`. Each buy is bounded by
//! `--timeout-s`; a connection that failed is replaced. Prints one JSON object (counts by
//! status, X-Cache, error and resource, latencies, the run's wall-clock start and end);
//! `--ops-out` writes every buy (wall-clock send and answer times in unix ms, client,
//! instance, resource, status (0: no answer), X-Cache, error) for the script's checkers.
//!
//! `loadgen soldout-probe --buy-url http://A --probe-url http://B [--probe-url C ...]
//!  --origin http://O --redis IP:PORT [--channel cg:events] [--reps 100]`
//!
//! How long a stock gate's sold-out mark takes to reach the other instances: per rep, the
//! last unit of a fresh resource is bought through A while B, C, ... are probed, each with
//! a tight loop of buy heads (`Expect: 100-continue`, no body) that find the mark (`409`,
//! `X-Cache: SOLDOUT`) or not (`100 Continue`: closed before the body, so the probe never
//! reaches Redis nor marks anything); a subscriber on the bus's Redis channel stamps the
//! `stock soldout` message. Times are from the send of the last buy, on one clock. See
//! `soldout.rs`.
//!
//! `loadgen writes --url http://IP:PORT [--url URL2 ...] [--path-template /kv/{key}]
//!  [--method PUT] [--connections 8] [--keys 1] [--warmup-s 1] [--duration-s 5]`
//!
//! Closed-loop writes for the serialized-writes bench (bench/serialize.sh): C keep-alive
//! connections per URL, each writing the next key of one shared counter (`j mod keys`) as
//! soon as its last write answered; the 2xx rate of the measured window and the latencies
//! of all, 2xx and 503 answers (see `writes.rs`).

mod buyers;
mod cycle;
mod http;
mod list;
mod open_loop;
mod rate;
mod soak;
mod soldout;
mod stale;
mod stampede;
mod stats;
mod writes;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(about = "Load client for the cacheguard bench scripts")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// C connections, one GET of the same URL on each, released at once.
    Stampede(StampedeArgs),
    /// Open-loop GETs (or POSTs) of one URL at a fixed rate over C keep-alive connections.
    Rate(RateArgs),
    /// Every id of a list GET once, at full speed over C keep-alive connections.
    List(ListArgs),
    /// Open-loop GETs cycling over N keys at a fixed rate, with a per-bucket timeline.
    Cycle(CycleArgs),
    /// Closed-loop writers and readers of a versioned KV origin: stale reads after writes.
    Stale(StaleArgs),
    /// Paced writers and readers of a versioned KV origin for minutes, with a timeline.
    Soak(SoakArgs),
    /// A flash sale's buyers: paced POSTs round-robin over instances and resources.
    Buyers(BuyersArgs),
    /// How long a stock gate's sold-out mark takes to reach the other instances.
    SoldoutProbe(SoldOutArgs),
    /// Closed-loop writes over one or many keys and instances (serialized writes).
    Writes(WritesArgs),
}

#[derive(Parser, Debug)]
struct BuyersArgs {
    /// Base URL of one instance (http://IP:PORT); repeat for several.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// A resource on sale (`/trains/{t}/seats/{s}`; buys POST `<resource>/orders`); repeat.
    #[arg(long = "resource", required = true)]
    resources: Vec<String>,
    /// Client tasks, each one buy at a time.
    #[arg(long, default_value_t = 12)]
    clients: usize,
    /// Pause between a client's buys, in ms.
    #[arg(long, default_value_t = 15)]
    pace_ms: u64,
    /// Run time in seconds (no buy starts after it).
    #[arg(long)]
    duration_s: f64,
    /// Buys per client, at most.
    #[arg(long, default_value_t = 100_000)]
    max_ops: u64,
    /// Per-buy timeout (connect, send, whole answer), in seconds.
    #[arg(long, default_value_t = 2.0)]
    timeout_s: f64,
    /// Send an `Idempotency-Key` with every buy (`<key-tag>-p<client>-<n>`).
    #[arg(long)]
    idempotency_keys: bool,
    /// The run's part of the idempotency keys (a fresh tag gives fresh keys).
    #[arg(long, default_value = "run")]
    key_tag: String,
    /// Write every buy here, one TSV line each, in order of sending.
    #[arg(long)]
    ops_out: Option<std::path::PathBuf>,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct SoldOutArgs {
    /// Base URL of instance A, which sells the last unit (http://IP:PORT).
    #[arg(long)]
    buy_url: String,
    /// Base URL of an instance to watch for the mark; repeat.
    #[arg(long = "probe-url", required = true)]
    probe_urls: Vec<String>,
    /// Base URL of the bench-origin shop (its stock is set per rep).
    #[arg(long)]
    origin: String,
    /// The Redis of the event bus, IP:PORT (the side channel subscribes there).
    #[arg(long)]
    redis: String,
    /// The event bus channel (`<redis.key_prefix>events`).
    #[arg(long, default_value = "cg:events")]
    channel: String,
    /// The resource of rep n; `{rep}` is replaced by n.
    #[arg(long, default_value = "/trains/mark-{rep}/seats/a")]
    resource_template: String,
    /// Reps (one resource each).
    #[arg(long, default_value_t = 100)]
    reps: u64,
    /// Number of the first rep (a fresh number gives fresh resources on a running fleet).
    #[arg(long, default_value_t = 0)]
    first_rep: u64,
    /// Pause between probes of one instance, in microseconds.
    #[arg(long, default_value_t = 100)]
    gap_us: u64,
    /// Probes of one instance per rep, at most.
    #[arg(long, default_value_t = 5000)]
    max_probes: u64,
    /// Longest an instance is probed per rep, in ms (a rep past it counts as not reached).
    #[arg(long, default_value_t = 1000)]
    max_wait_ms: u64,
    /// Connections opened per instance before each rep's clock starts.
    #[arg(long, default_value_t = 64)]
    pool: usize,
    /// Pause after the first buy of a rep and between reps, in ms.
    #[arg(long, default_value_t = 20)]
    pause_ms: u64,
    /// No rep starts after this many seconds.
    #[arg(long, default_value_t = 300.0)]
    max_duration_s: f64,
    /// Tokio worker threads (the probing itself runs on threads of its own).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Parser, Debug, Clone)]
struct WritesArgs {
    /// Base URL of one instance (http://IP:PORT); repeat for several.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Path of one key; `{key}` is replaced by the key.
    #[arg(long, default_value = "/kv/{key}")]
    path_template: String,
    /// The write's method: PUT, PATCH, DELETE or POST (an empty body).
    #[arg(long, default_value = "PUT")]
    method: String,
    /// Keep-alive connections per URL, each one write at a time.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Number of keys, `<key-prefix>0` .. `<key-prefix><keys - 1>`, written in turn.
    #[arg(long, default_value_t = 1)]
    keys: u64,
    /// Prefix of the key names.
    #[arg(long, default_value = "k")]
    key_prefix: String,
    /// Seconds sent before the measured window, left out of every figure.
    #[arg(long, default_value_t = 1.0)]
    warmup_s: f64,
    /// The measured window, in seconds.
    #[arg(long, default_value_t = 5.0)]
    duration_s: f64,
    /// Per-request timeout (ready, send, whole answer), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct StaleArgs {
    /// Base URL of one instance (http://IP:PORT); repeat for several. Each request goes to a
    /// random one.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Path of one key; `{key}` is replaced by the key.
    #[arg(long, default_value = "/kv/{key}")]
    path_template: String,
    /// Writer loops (PUT).
    #[arg(long, default_value_t = 8)]
    writers: usize,
    /// Reader loops (GET).
    #[arg(long, default_value_t = 32)]
    readers: usize,
    /// Number of keys, named `<key-prefix>0` .. `<key-prefix><keys - 1>`; each request picks
    /// one at random.
    #[arg(long, default_value_t = 100)]
    keys: u64,
    /// Prefix of the key names (a fresh prefix gives fresh keys on a long-running origin).
    #[arg(long, default_value = "k")]
    key_prefix: String,
    /// Run time of every loop, in seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// The `double_delete_delay` under test, in milliseconds: a read that starts more than
    /// this long after a write returned must not see an older version.
    #[arg(long)]
    delay_ms: f64,
    /// Hard cap on the requests of each loop.
    #[arg(long, default_value_t = 200_000)]
    max_requests_per_loop: u64,
    /// Per-request timeout (connect, send, whole answer), in seconds.
    #[arg(long, default_value_t = 5.0)]
    timeout_s: f64,
    /// Stale reads (after the delay) listed in the report.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Seed of the key and instance choices (default: from the clock; reported).
    #[arg(long)]
    seed: Option<u64>,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct SoakArgs {
    /// Base URL of one instance (http://IP:PORT); repeat for several. Each request goes to a
    /// random one.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Path of one key; `{key}` is replaced by the key.
    #[arg(long, default_value = "/kv/{key}")]
    path_template: String,
    /// Writer loops (PUT).
    #[arg(long, default_value_t = 8)]
    writers: usize,
    /// Reader loops (GET).
    #[arg(long, default_value_t = 32)]
    readers: usize,
    /// Number of keys, `<key-prefix>0` .. `<key-prefix><keys - 1>`.
    #[arg(long, default_value_t = 200)]
    keys: u64,
    /// Prefix of the key names.
    #[arg(long, default_value = "k")]
    key_prefix: String,
    /// PUTs per second, over all writer loops.
    #[arg(long, default_value_t = 40.0)]
    write_rate: f64,
    /// GETs per second, over all reader loops.
    #[arg(long, default_value_t = 400.0)]
    read_rate: f64,
    /// Run time in seconds.
    #[arg(long, default_value_t = 180.0)]
    duration_s: f64,
    /// A read that starts more than this many ms after a write returned must not see an
    /// older version.
    #[arg(long)]
    delay_ms: f64,
    /// Per-request timeout (ready, send, whole answer), in seconds.
    #[arg(long, default_value_t = 5.0)]
    timeout_s: f64,
    /// Timeline bucket, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    bucket_ms: u64,
    /// Stale reads listed in the report.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Seed of the key and instance choices (default: from the clock; reported).
    #[arg(long)]
    seed: Option<u64>,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct CycleArgs {
    /// URL template with `{id}` in the path, e.g. http://127.0.0.1:8080/items/{id}; repeat
    /// for several instances (request j goes to the (j mod U)-th).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// First id of the cycle.
    #[arg(long, default_value_t = 1)]
    first_id: u64,
    /// Number of keys cycled: ids first-id ..= first-id + keys - 1.
    #[arg(long)]
    keys: u64,
    /// Requests per second over all URLs (request j is scheduled at start + j/rate).
    #[arg(long)]
    rate: f64,
    /// Duration in seconds: ceil(rate × duration) requests are scheduled.
    #[arg(long)]
    duration_s: f64,
    /// Keep-alive connections per URL; a due request waits for a free one.
    #[arg(long)]
    connections: usize,
    /// Width of one timeline bucket (of scheduled time), in milliseconds.
    #[arg(long, default_value_t = 1000)]
    bucket_ms: u64,
    /// Time allowed after the last scheduled request for the rest to finish, in seconds.
    #[arg(long, default_value_t = 5.0)]
    drain_s: f64,
    /// Per-request timeout (from the actual send), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// Tokio worker threads (the pacer is one more OS thread).
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct ListArgs {
    /// URL template; `{id}` (in the path) is replaced by each id, e.g.
    /// http://127.0.0.1:8080/items/{id}
    #[arg(long)]
    url: String,
    /// One id per line (trimmed; empty lines ignored). Ids are put into the path verbatim.
    #[arg(long)]
    ids_file: std::path::PathBuf,
    /// Keep-alive connections.
    #[arg(long)]
    connections: usize,
    /// Per-request timeout (from the send), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// No new id is handed out after this many seconds; the rest are counted as unsent.
    #[arg(long, default_value_t = 600.0)]
    max_duration_s: f64,
    /// Write the ids whose answer's X-Cache was not --reject-x-cache (or that failed) here.
    #[arg(long)]
    passed_out: Option<std::path::PathBuf>,
    /// The X-Cache value of a rejected request (for --passed-out and the "rejected" count).
    #[arg(long, default_value = "REJECT")]
    reject_x_cache: String,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct RateArgs {
    /// Target URL (http://IP:PORT/path).
    #[arg(long)]
    url: String,
    /// Requests per second (request i is scheduled at start + i/rate).
    #[arg(long)]
    rate: f64,
    /// Measured duration in seconds (after the warm-up).
    #[arg(long)]
    duration_s: f64,
    /// Keep-alive connections; a due request waits for a free one.
    #[arg(long)]
    connections: usize,
    /// Warm-up in seconds before the measured part, same rate, not counted.
    #[arg(long, default_value_t = 0.0)]
    warmup_s: f64,
    /// Time allowed after the last scheduled request for the rest to finish, in seconds.
    #[arg(long, default_value_t = 5.0)]
    drain_s: f64,
    /// Per-request timeout (from the actual send), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// Tokio worker threads (the pacer is one more OS thread).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// POST a JSON body of exactly this many bytes (at least 14) instead of a GET.
    #[arg(long)]
    post_bytes: Option<usize>,
}

#[derive(Parser, Debug)]
struct StampedeArgs {
    /// Target URL (repeat for several instances; connections are spread round-robin).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Number of connections, one stampede request each.
    #[arg(long)]
    concurrency: usize,
    /// Per-request timeout after the release, in seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout_s: f64,
    /// Path (with query) GET once on every connection before the release; must answer 2xx.
    #[arg(long)]
    warm_path: Option<String>,
    /// Connects (and warm-ups) in flight at once while setting up.
    #[arg(long, default_value_t = 64)]
    connect_parallelism: usize,
    /// Time allowed for setting every connection up, in seconds.
    #[arg(long, default_value_t = 30.0)]
    setup_timeout_s: f64,
    /// Pause between "all connections ready" and the release, in milliseconds.
    #[arg(long, default_value_t = 100)]
    settle_ms: u64,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Include every latency (ms) in the JSON.
    #[arg(long)]
    dump_latencies: bool,
}

/// Errors unless `v` is a finite number > 0 ("FLAG must be > 0").
fn positive(v: f64, flag: &str) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!("{flag} must be > 0"))
    }
}

fn main() {
    let cli = Cli::parse();
    let threads = match &cli.cmd {
        Cmd::Stampede(a) => a.threads,
        Cmd::Rate(a) => a.threads,
        Cmd::List(a) => a.threads,
        Cmd::Cycle(a) => a.threads,
        Cmd::Stale(a) => a.threads,
        Cmd::Soak(a) => a.threads,
        Cmd::Buyers(a) => a.threads,
        Cmd::SoldoutProbe(a) => a.threads,
        Cmd::Writes(a) => a.threads,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = match cli.cmd {
        Cmd::Stampede(args) => rt.block_on(stampede::stampede(args)),
        Cmd::Rate(args) => rt.block_on(rate::rate(args)),
        Cmd::List(args) => rt.block_on(list::list(args)),
        Cmd::Cycle(args) => rt.block_on(cycle::cycle(args)),
        Cmd::Stale(args) => rt.block_on(stale::stale(args)),
        Cmd::Soak(args) => rt.block_on(soak::soak(args)),
        Cmd::Buyers(args) => rt.block_on(buyers::buyers(args)),
        Cmd::SoldoutProbe(args) => rt.block_on(soldout::soldout_probe(args)),
        Cmd::Writes(args) => rt.block_on(writes::writes(args)),
    };
    // do not wait for abandoned tasks (requests still in flight after the drain deadline)
    rt.shutdown_background();
    match result {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(2);
        }
    }
}
