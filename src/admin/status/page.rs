//! The status page as HTML: [`render`] fills the `{{slot}}`s of `page.html` from a
//! [`Snapshot`], so the page carries every number before any script runs.
//!
//! Paths and keys come from clients, so nothing reaches the page but through [`Html`]: text
//! is escaped on the way in, and the only markup it takes is a `&'static str` (a tag written
//! here, never a value). Escaping five characters, and filling a dozen slots, is a few lines:
//! not worth a template engine and its build.

use std::time::{Duration, UNIX_EPOCH};

use super::{BloomRow, GateRow, HotRow, RouteRow, Snapshot};
use crate::metrics::{Outcome, StockOutcome, StockSettled};
use crate::proxy::own_answer::RecentAnswer;

const TEMPLATE: &str = include_str!("page.html");

/// The routes table's outcome columns, in the order the page's script uses.
const COLUMNS: [Outcome; 12] = [
    Outcome::HitL1,
    Outcome::HitL2,
    Outcome::Coalesced,
    Outcome::Miss,
    Outcome::Stale,
    Outcome::Revalidated,
    Outcome::Negative,
    Outcome::Reject,
    Outcome::Bypass,
    Outcome::Error,
    Outcome::SoldOut,
    Outcome::Replayed,
];

/// Markup safe to put into the page.
#[derive(Debug, Default)]
struct Html(String);

impl Html {
    fn text(text: &str) -> Html {
        let mut html = Html::default();
        html.push_text(text);
        html
    }

    /// `text`, escaped: `&`, `<`, `>`, `"` and `'` as entities, which is enough for element
    /// content and for quoted attribute values.
    fn push_text(&mut self, text: &str) {
        for c in text.chars() {
            match c {
                '&' => self.0.push_str("&amp;"),
                '<' => self.0.push_str("&lt;"),
                '>' => self.0.push_str("&gt;"),
                '"' => self.0.push_str("&quot;"),
                '\'' => self.0.push_str("&#39;"),
                c => self.0.push(c),
            }
        }
    }

    /// Markup written in this file (`'static`: never a value from elsewhere).
    fn push_tag(&mut self, tag: &'static str) {
        self.0.push_str(tag);
    }

    /// `<td class="{class}">{text}</td>`.
    fn cell(&mut self, class: &'static str, text: &str) {
        if class.is_empty() {
            self.push_tag("<td>");
        } else {
            self.push_tag("<td class=\"");
            self.push_tag(class);
            self.push_tag("\">");
        }
        self.push_text(text);
        self.push_tag("</td>");
    }
}

/// The page for `snapshot`, with `nonce` on its inline style and script.
pub(super) fn render(snapshot: &Snapshot, nonce: &str) -> String {
    fill(TEMPLATE, |slot| slot_value(snapshot, nonce, slot))
}

fn slot_value(s: &Snapshot, nonce: &str, slot: &str) -> Option<Html> {
    let origin = &s.origin;
    let journal = &s.journal;
    let locks = &s.locks;
    Some(match slot {
        "nonce" => Html::text(nonce),
        "mode" => Html::text(s.mode),
        "generation" => Html::text(&s.config_generation.to_string()),
        "started" => Html::text(&stamp(s.started_unix_ms)),
        "now" => Html::text(&stamp(s.now_unix_ms)),
        "breaker" => Html::text(s.redis.breaker),
        "topology" => Html::text(&s.redis.topology_text),
        "event_bus" => Html::text(s.redis.event_bus.unwrap_or("\u{2013} (embedded)")),
        "origin_in_flight" => Html::text(&origin.in_flight.to_string()),
        "max_concurrency" => Html::text(&origin.max_concurrency.to_string()),
        "origin_rps" => Html::text(&rate(origin.requests_per_second)),
        "max_rps" => Html::text(&match origin.max_rps {
            0 => "no cap".to_owned(),
            n => n.to_string(),
        }),
        "journal_depth" => Html::text(&if journal.enabled {
            journal.depth.to_string()
        } else {
            "\u{2013}".to_owned()
        }),
        "journal_note" => Html::text(&if !journal.enabled {
            "embedded mode: nothing is owed to Redis".to_owned()
        } else if journal.failing {
            format!(
                "the journal cannot be written: {} held in memory",
                journal.held
            )
        } else if journal.depth > 0 {
            format!("oldest waiting {:.0} s", journal.oldest_pending_seconds)
        } else {
            "nothing owed".to_owned()
        }),
        "lock_waiting" => Html::text(&locks.waiting.to_string()),
        "lock_note" => Html::text(&format!(
            "{} waits so far ({:.1} s), {} timed out",
            locks.waits, locks.wait_seconds, locks.wait_timeouts
        )),
        "rate_window" => Html::text(&format!("{} s", s.rate_window_ms / 1000)),
        "outcome_headers" => {
            let mut html = Html::default();
            for outcome in COLUMNS {
                html.push_tag("<th class=\"num\">");
                html.push_text(outcome.as_str());
                html.push_tag("</th>");
            }
            html
        }
        "route_rows" => route_rows(&s.routes),
        "bloom_rows" => bloom_rows(&s.bloom),
        "hot_count" => Html::text(&match s.hot_keys_total {
            0 => "none".to_owned(),
            n => format!("{n} hot"),
        }),
        "hot_keys" => hot_keys(&s.hot_keys),
        "error_rows" => error_rows(&s.recent_errors),
        "stock_rows" => stock_rows(&s.stock),
        "stock_charts" => stock_charts(&s.stock),
        _ => return None,
    })
}

fn route_rows(routes: &[RouteRow]) -> Html {
    let mut html = Html::default();
    for r in routes {
        html.push_tag("<tr data-route=\"");
        html.push_text(&r.name);
        html.push_tag("\">");
        html.cell("name", &r.name);
        html.cell("num rps", &rate(r.requests_per_second));
        html.cell("num hit-ratio", &percent(r.hit_ratio, 1));
        html.cell("num", &percent(r.hit_ratio_since_start, 1));
        for outcome in COLUMNS {
            html.cell("num", &r.outcomes[outcome as usize].to_string());
        }
        html.cell("num", &r.total.to_string());
        html.push_tag("</tr>");
    }
    html
}

/// The stock gates table: the same cells, in the same order, as the page's script writes.
fn stock_rows(gates: &[GateRow]) -> Html {
    let mut html = Html::default();
    if gates.is_empty() {
        html.push_tag("<tr class=\"none\"><td colspan=\"18\">no stock gates configured</td></tr>");
    }
    for g in gates {
        html.push_tag("<tr data-gate=\"");
        html.push_text(&g.name);
        html.push_tag("\">");
        html.cell("name", &g.name);
        html.cell("num admitted-rate", &rate(g.admitted_per_second));
        html.cell("num sold-out-rate", &rate(g.sold_out_per_second));
        let numbers = [
            g.decision(StockOutcome::Admitted),
            g.decision(StockOutcome::SoldOutLocal),
            g.decision(StockOutcome::SoldOutRedis),
            g.settlement(StockSettled::Sold),
            g.settlement(StockSettled::Returned),
            g.settlement(StockSettled::InDoubt),
        ];
        for n in numbers {
            html.cell("num", &n.to_string());
        }
        html.cell("num delta", &signed(g.reconcile_delta));
        let numbers = [
            g.reconciles,
            g.reconciles_failed,
            g.redis_errors,
            g.decision(StockOutcome::Replayed),
            g.decision(StockOutcome::InFlight),
            g.decision(StockOutcome::Mismatch),
            g.decision(StockOutcome::Unavailable) + g.decision(StockOutcome::NotLoaded),
            g.decision(StockOutcome::Ungated),
        ];
        for n in numbers {
            html.cell("num", &n.to_string());
        }
        html.push_tag("</tr>");
    }
    html
}

/// One chart per stock gate (drawn by the script; the `i`th gate's is `chart-stock-i`).
fn stock_charts(gates: &[GateRow]) -> Html {
    let mut html = Html::default();
    for (i, g) in gates.iter().enumerate() {
        html.push_tag("<figure data-gate=\"");
        html.push_text(&g.name);
        html.push_tag("\"><figcaption>Stock gate <code>");
        html.push_text(&g.name);
        html.push_tag(
            "</code>: admitted vs sold out per second</figcaption><svg id=\"chart-stock-",
        );
        html.push_text(&i.to_string());
        html.push_tag(
            "\" class=\"chart\" viewBox=\"0 0 560 150\" role=\"img\" aria-label=\"admitted and sold-out buys per second\"></svg></figure>",
        );
    }
    html
}

fn bloom_rows(filters: &[BloomRow]) -> Html {
    let mut html = Html::default();
    if filters.is_empty() {
        html.push_tag("<tr class=\"none\"><td colspan=\"6\">no Bloom filters configured</td></tr>");
    }
    for f in filters {
        html.push_tag("<tr data-filter=\"");
        html.push_text(&f.name);
        html.push_tag("\">");
        html.cell("", &f.name);
        html.cell("state", f.state);
        html.cell("num", &f.items.to_string());
        html.cell("num", &f.expected_items.to_string());
        html.cell("num", &percent(Some(f.fill), 1));
        html.cell("num", &percent(Some(f.estimated_fp_rate), 2));
        html.push_tag("</tr>");
    }
    html
}

fn hot_keys(keys: &[HotRow]) -> Html {
    let mut html = Html::default();
    if keys.is_empty() {
        html.push_tag("<li class=\"none\">none</li>");
    }
    for h in keys {
        html.push_tag("<li data-hash=\"");
        html.push_text(&h.hash);
        html.push_tag("\"><code>");
        html.push_text(&h.key);
        html.push_tag("</code> <span class=\"num\">");
        html.push_text(&format!("{:.0} req/s", h.rate));
        html.push_tag("</span> <span class=\"note\">");
        html.push_text(&format!(
            "{}, since {}",
            h.promoted_from,
            clock(h.since_unix_ms)
        ));
        html.push_tag("</span></li>");
    }
    html
}

fn error_rows(errors: &[RecentAnswer]) -> Html {
    let mut html = Html::default();
    if errors.is_empty() {
        html.push_tag("<tr class=\"none\"><td colspan=\"6\">none since start</td></tr>");
    }
    for e in errors {
        html.push_tag("<tr>");
        html.cell("", &clock(e.unix_ms));
        html.cell("", &e.route);
        html.cell("", &e.method);
        html.cell("path", &e.path);
        html.cell("num", &e.status.to_string());
        html.cell("", e.reason);
        html.push_tag("</tr>");
    }
    html
}

/// `template` with each `{{name}}` replaced by `value(name)`; a slot `value` does not know
/// is left as it is (a test checks none is).
fn fill(template: &str, value: impl Fn(&str) -> Option<Html>) -> String {
    let mut out = String::with_capacity(template.len() + 8 * 1024);
    let mut rest = template;
    while let Some(open) = rest.find("{{") {
        let after = &rest[open + 2..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(after.len());
        let filled = after[name_len..]
            .starts_with("}}")
            .then(|| value(&after[..name_len]))
            .flatten();
        match filled {
            Some(html) => {
                out.push_str(&rest[..open]);
                out.push_str(&html.0);
                rest = &after[name_len + 2..];
            }
            None => {
                out.push_str(&rest[..open + 2]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Requests per second, as the page's script writes them.
fn rate(rps: Option<f64>) -> String {
    rps.map_or_else(|| "\u{2013}".to_owned(), |r| format!("{r:.1}"))
}

/// A signed count: `+3`, `-2`, `0`.
fn signed(n: i64) -> String {
    if n > 0 {
        format!("+{n}")
    } else {
        n.to_string()
    }
}

fn percent(ratio: Option<f64>, digits: usize) -> String {
    ratio.map_or_else(
        || "\u{2013}".to_owned(),
        |r| format!("{:.*}%", digits, r * 100.0),
    )
}

/// `2026-05-01T12:00:00Z`, as the page's script writes it.
fn stamp(unix_ms: u64) -> String {
    let at = UNIX_EPOCH
        .checked_add(Duration::from_millis(unix_ms))
        .unwrap_or(UNIX_EPOCH);
    humantime::format_rfc3339_seconds(at).to_string()
}

/// `12:00:00` (UTC).
fn clock(unix_ms: u64) -> String {
    stamp(unix_ms).get(11..19).unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::super::{JournalRow, LockRow, OriginRow, RedisRow};
    use super::*;

    const NASTY: &str = "<script>alert(1)</script>\"'&";

    fn snapshot() -> Snapshot {
        let mut outcomes = [0; Outcome::ALL.len()];
        outcomes[Outcome::HitL1 as usize] = 9;
        outcomes[Outcome::Miss as usize] = 1;
        Snapshot {
            now_unix_ms: 1_800_000_000_000,
            started_unix_ms: 1_799_999_000_000,
            mode: "shared",
            config_generation: 2,
            sample_every_ms: 2000,
            rate_window_ms: 10_000,
            routes: vec![RouteRow {
                name: "items".to_owned(),
                requests_per_second: Some(12.34),
                hit_ratio: Some(0.9),
                hit_ratio_since_start: Some(0.5),
                outcomes,
                total: 10,
            }],
            origin: OriginRow {
                in_flight: 3,
                max_concurrency: 64,
                requests_per_second: None,
                max_rps: 0,
                requests_total: 1,
            },
            redis: RedisRow {
                breaker: "closed",
                topology_text: "standalone 127.0.0.1:6379, 0 replicas".to_owned(),
                topology: None,
                event_bus: Some("subscribed"),
            },
            bloom: vec![BloomRow {
                name: "ids".to_owned(),
                state: "ready",
                items: 50,
                expected_items: 100,
                fill: 0.5,
                estimated_fp_rate: 0.0001,
                configured_fp_rate: 0.01,
            }],
            journal: JournalRow {
                enabled: true,
                depth: 4,
                oldest_pending_seconds: 7.2,
                failing: false,
                held: 0,
            },
            locks: LockRow {
                waiting: 1,
                waits: 5,
                wait_seconds: 0.25,
                wait_timeouts: 0,
            },
            hot_keys: vec![HotRow {
                key: format!("items /api/items/{NASTY}"),
                hash: "00ff".to_owned(),
                rate: 1234.4,
                since_unix_ms: 1_799_999_999_000,
                promoted_from: "local".to_owned(),
            }],
            hot_keys_total: 1,
            recent_errors: vec![RecentAnswer {
                unix_ms: 1_799_999_999_500,
                route: "-".to_owned(),
                method: "GET".to_owned(),
                path: format!("/api/items/{NASTY}"),
                status: 413,
                reason: "body_too_large",
            }],
            stock: vec![gate(NASTY)],
        }
    }

    /// A gate with every counter set to a different number.
    fn gate(name: &str) -> GateRow {
        let mut decisions = [0; StockOutcome::ALL.len()];
        for (i, outcome) in StockOutcome::ALL.iter().enumerate() {
            decisions[*outcome as usize] = 100 + i as u64;
        }
        let mut settled = [0; StockSettled::ALL.len()];
        for (i, result) in StockSettled::ALL.iter().enumerate() {
            settled[*result as usize] = 200 + i as u64;
        }
        GateRow {
            name: name.to_owned(),
            admitted_per_second: Some(25.04),
            sold_out_per_second: None,
            decisions,
            settled,
            reconciles: 31,
            reconciles_failed: 2,
            reconcile_delta: -4,
            redis_errors: 7,
        }
    }

    #[test]
    fn every_slot_is_filled_and_the_numbers_are_in_the_page() {
        let page = render(&snapshot(), "n0nce");
        assert!(!page.contains("{{"), "a slot left unfilled");
        assert!(page.contains("<style nonce=\"n0nce\">"));
        assert!(page.contains("<script nonce=\"n0nce\">"));
        assert!(page.contains(
            "<tr data-route=\"items\"><td class=\"name\">items</td><td class=\"num rps\">12.3</td><td class=\"num hit-ratio\">90.0%</td><td class=\"num\">50.0%</td><td class=\"num\">9</td>"
        ));
        assert!(page.contains("<td id=\"breaker-state\" data-state=\"closed\">closed</td>"));
        assert!(page.contains("<td class=\"num\" id=\"journal-depth\">4</td>"));
        assert!(page.contains("oldest waiting 7 s"));
        assert!(page.contains("<span id=\"origin-max-rps\">no cap</span>"));
        assert!(page.contains("<td class=\"num\">50.0%</td><td class=\"num\">0.01%</td>"));
        assert!(page.contains("1234 req/s"));
        assert!(page.contains("2027-01-15T08:00:00Z"));
    }

    #[test]
    fn a_gate_row_has_every_number_in_the_columns_order() {
        let mut s = snapshot();
        s.stock = vec![gate("seats")];
        let page = render(&s, "n0nce");
        // admitted/s, sold out/s; admitted, sold out here, sold out Redis; sold, returned,
        // in doubt; the last delta; reconciles, failed; Redis errors; replayed, 409, 422,
        // 503 (unavailable + not loaded), ungated.
        let cells = [
            "25.0", "\u{2013}", "100", "102", "103", "200", "201", "203", "-4", "31", "2", "7",
            "104", "105", "106", "218", "109",
        ];
        let row = page
            .split("<tr data-gate=\"seats\">")
            .nth(1)
            .and_then(|rest| rest.split("</tr>").next())
            .unwrap_or_else(|| panic!("no row for the gate"));
        let found: Vec<&str> = row
            .split("</td>")
            .filter_map(|cell| cell.rsplit('>').next())
            .filter(|text| !text.is_empty())
            .skip(1)
            .collect();
        assert_eq!(found, cells);
        assert!(page.contains("<svg id=\"chart-stock-0\""));
        assert!(page.contains("<th class=\"num\">sold_out</th><th class=\"num\">replayed</th>"));
        assert_eq!(signed(3), "+3");
        assert_eq!(signed(0), "0");
    }

    #[test]
    fn no_gates_says_so() {
        let mut s = snapshot();
        s.stock = Vec::new();
        let page = render(&s, "n0nce");
        assert!(page.contains("no stock gates configured"));
        assert!(!page.contains("<svg id=\"chart-stock-"));
    }

    #[test]
    fn client_chosen_text_is_escaped() {
        let page = render(&snapshot(), "n0nce");
        let escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#39;&amp;";
        assert!(page.contains(&format!("<code>items /api/items/{escaped}</code>")));
        assert!(page.contains(&format!("<td class=\"path\">/api/items/{escaped}</td>")));
        assert!(page.contains(&format!(
            "<tr data-gate=\"{escaped}\"><td class=\"name\">{escaped}</td>"
        )));
        assert!(page.contains(&format!("<figure data-gate=\"{escaped}\">")));
        assert!(!page.contains("<script>alert"));
        // Our own script is the only one.
        assert_eq!(page.matches("<script").count(), 1);
    }

    #[test]
    fn fill_leaves_what_is_not_a_slot() {
        let filled = fill("a {{x}} {{ y }} {{unknown}} {{", |slot| {
            (slot == "x").then(|| Html::text("<b>"))
        });
        assert_eq!(filled, "a &lt;b&gt; {{ y }} {{unknown}} {{");
    }
}
