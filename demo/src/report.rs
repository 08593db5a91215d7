//! Printing the burst results as small aligned tables.

use std::fmt::Write as _;
use std::time::Duration;

use crate::burst::Outcome;
use crate::sale::SaleOutcome;

/// One phase's results on both paths.
pub struct Row {
    pub phase: String,
    pub direct: Outcome,
    pub cached: Outcome,
}

/// The main table: requests, DB queries and errors per path, plus wall time.
pub fn table(rows: &[Row]) -> String {
    let header = [
        "phase",
        "requests",
        "DB direct",
        "DB via cg",
        "errors direct",
        "errors via cg",
        "time direct",
        "time via cg",
    ];
    let mut cells: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for r in rows {
        cells.push(vec![
            r.phase.clone(),
            requests(&r.direct, &r.cached),
            r.direct.db_queries.to_string(),
            r.cached.db_queries.to_string(),
            r.direct.errors().to_string(),
            r.cached.errors().to_string(),
            ms(r.direct.elapsed),
            ms(r.cached.elapsed),
        ]);
    }
    let total_direct: u64 = rows.iter().map(|r| r.direct.db_queries).sum();
    let total_cached: u64 = rows.iter().map(|r| r.cached.db_queries).sum();
    let total_sent: u64 = rows.iter().map(|r| r.cached.sent).sum();
    cells.push(vec![
        "total".to_owned(),
        total_sent.to_string(),
        total_direct.to_string(),
        total_cached.to_string(),
        rows.iter()
            .map(|r| r.direct.errors())
            .sum::<u64>()
            .to_string(),
        rows.iter()
            .map(|r| r.cached.errors())
            .sum::<u64>()
            .to_string(),
        ms(rows.iter().map(|r| r.direct.elapsed).sum()),
        ms(rows.iter().map(|r| r.cached.elapsed).sum()),
    ]);
    render(&cells, Some(rows.len() + 1))
}

/// The `X-Cache` values seen through cacheguard, one row per phase.
pub fn x_cache_table(rows: &[Row]) -> String {
    const ORDER: [&str; 7] = [
        "MISS", "HIT-L1", "HIT-L2", "STALE", "NEGATIVE", "REJECT", "BYPASS",
    ];
    let mut columns: Vec<String> = ORDER.iter().map(|s| (*s).to_owned()).collect();
    for r in rows {
        for k in r.cached.x_cache.keys() {
            if !columns.contains(k) {
                columns.push(k.clone());
            }
        }
    }
    // Keep only the columns that were seen, in the documented order, then any others.
    columns.retain(|c| rows.iter().any(|r| r.cached.x_cache.contains_key(c)));
    let mut cells = vec![
        std::iter::once("phase".to_owned())
            .chain(columns.iter().cloned())
            .collect::<Vec<_>>(),
    ];
    for r in rows {
        let mut line = vec![r.phase.clone()];
        for c in &columns {
            line.push(r.cached.x_cache.get(c).copied().unwrap_or(0).to_string());
        }
        cells.push(line);
    }
    render(&cells, None)
}

/// The flash sale on each path: attempts, what the database did, what buyers were told.
pub fn sale_table(rows: &[(&str, &SaleOutcome)]) -> String {
    let header = [
        "path",
        "attempts",
        "buy transactions",
        "seats sold",
        "oversold",
        "told sold",
        "told sold out",
        "told busy",
        "errors",
        "time",
    ];
    let mut cells: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for (path, o) in rows {
        cells.push(vec![
            (*path).to_owned(),
            if o.sent == o.planned {
                o.sent.to_string()
            } else {
                format!("{} of {}", o.sent, o.planned)
            },
            o.buy_transactions.to_string(),
            o.seats_sold.to_string(),
            o.oversold().to_string(),
            o.told_sold.to_string(),
            o.sold_out.to_string(),
            o.busy.to_string(),
            o.errors.to_string(),
            ms(o.elapsed),
        ]);
    }
    render(&cells, None)
}

/// `SOLDOUT 99000, BYPASS 1000`: the `X-Cache` values of a sale, the most frequent first.
pub fn sale_x_cache(outcome: &SaleOutcome) -> String {
    let mut seen: Vec<(&String, &u64)> = outcome.x_cache.iter().collect();
    seen.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    seen.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Lines explaining any errors, or nothing.
pub fn error_details(rows: &[Row]) -> String {
    let mut s = String::new();
    for r in rows {
        for (path, o) in [("direct", &r.direct), ("via cacheguard", &r.cached)] {
            if o.errors() > 0 || o.sent < o.planned {
                let _ = writeln!(
                    s,
                    "  {} ({path}): {} transport errors, {} 5xx, {} wrong answers, {} of {} sent",
                    r.phase,
                    o.transport_errors,
                    o.server_errors,
                    o.wrong_answers,
                    o.sent,
                    o.planned
                );
            }
        }
    }
    s
}

fn requests(direct: &Outcome, cached: &Outcome) -> String {
    if direct.sent == cached.sent {
        cached.sent.to_string()
    } else {
        format!("{}/{}", direct.sent, cached.sent)
    }
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

/// Left-aligns the first column, right-aligns the others; a rule under the header and,
/// when `rule_before` is given, before that row.
fn render(cells: &[Vec<String>], rule_before: Option<usize>) -> String {
    let ncols = cells.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..ncols)
        .map(|c| {
            cells
                .iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let rule = widths
        .iter()
        .map(|w| "-".repeat(*w))
        .collect::<Vec<_>>()
        .join("  ");
    let mut out = String::new();
    for (i, row) in cells.iter().enumerate() {
        if rule_before == Some(i) {
            let _ = writeln!(out, "  {rule}");
        }
        let mut line = String::from(" ");
        for (c, cell) in row.iter().enumerate() {
            let w = widths[c];
            if c == 0 {
                let _ = write!(line, " {cell:<w$}");
            } else {
                let _ = write!(line, "  {cell:>w$}");
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
        if i == 0 {
            let _ = writeln!(out, "  {rule}");
        }
    }
    out
}
