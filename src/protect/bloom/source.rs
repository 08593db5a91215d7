//! Loading a filter from its source: an HTTP endpoint or a file listing the existing ids,
//! one per line or one JSON object per line.
//!
//! Loading streams: bytes are split into lines as they arrive and each id goes straight into
//! the new filter, so a source of ten million ids needs the filter's memory plus one line,
//! never the whole list. A malformed line is skipped and counted; it never aborts a load.
//! Only the source itself failing (unreachable, non-200 status, cut mid-body, timeout) does,
//! and then the filter in service stays as it was.

use std::borrow::Cow;

use bloomfilter::Bloom;
use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::AsyncReadExt;

use crate::config::{BloomSource, SourceFormat};

/// Longest id accepted; a longer one is a malformed line (no real id is this long, and a
/// cap keeps one bad line from growing the line buffer without bound).
pub(crate) const MAX_ID_BYTES: usize = 1024;
/// Longest NDJSON line accepted (the object may carry other fields besides the id).
const MAX_JSON_LINE_BYTES: usize = 64 * 1024;
/// File read size.
const CHUNK: usize = 64 * 1024;

/// What one load read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LoadStats {
    /// Non-empty lines seen.
    pub(crate) lines: u64,
    /// Malformed lines skipped.
    pub(crate) skipped: u64,
    /// Ids put in the filter (a source is expected to list each id once).
    pub(crate) items: u64,
}

/// The HTTP client for sources; plain HTTP, like the upstream client.
pub(crate) fn http_client() -> Client<HttpConnector, Empty<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// Streams every id of `source` into `bloom`.
///
/// # Errors
/// A message naming what failed: the source could not be read, or answered a status other
/// than 200. The caller bounds the whole load with `load_timeout`.
pub(crate) async fn load(
    source: &BloomSource,
    format: &SourceFormat,
    client: &Client<HttpConnector, Empty<Bytes>>,
    bloom: &mut Bloom<[u8]>,
) -> Result<LoadStats, String> {
    let mut lines = LineSplitter::new(format);
    let mut stats = LoadStats::default();
    let mut sink = |line: Line<'_>| match line {
        Line::Id(id) => {
            stats.lines += 1;
            stats.items += 1;
            bloom.set(&id);
        }
        Line::Malformed => {
            stats.lines += 1;
            stats.skipped += 1;
        }
    };
    match source {
        BloomSource::Url(uri) => {
            let mut body = fetch(client, uri).await?;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|error| format!("reading {uri}: {error}"))?;
                if let Ok(data) = frame.into_data() {
                    lines.push(&data, &mut sink);
                }
            }
        }
        BloomSource::File(path) => {
            let mut file = tokio::fs::File::open(path)
                .await
                .map_err(|error| format!("opening {}: {error}", path.display()))?;
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = file
                    .read(&mut buf)
                    .await
                    .map_err(|error| format!("reading {}: {error}", path.display()))?;
                if n == 0 {
                    break;
                }
                lines.push(&buf[..n], &mut sink);
            }
        }
    }
    lines.finish(&mut sink);
    Ok(stats)
}

async fn fetch(
    client: &Client<HttpConnector, Empty<Bytes>>,
    uri: &Uri,
) -> Result<hyper::body::Incoming, String> {
    let request = Request::get(uri.clone())
        .header(http::header::ACCEPT, "text/plain, application/x-ndjson")
        .body(Empty::new())
        .map_err(|error| format!("building the request to {uri}: {error}"))?;
    let response = client
        .request(request)
        .await
        .map_err(|error| format!("requesting {uri}: {error}"))?;
    if response.status() != StatusCode::OK {
        return Err(format!("{uri} answered {}", response.status()));
    }
    Ok(response.into_body())
}

/// One line of a source.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Line<'a> {
    Id(Cow<'a, [u8]>),
    Malformed,
}

/// Splits a byte stream into lines across chunk boundaries and parses each one. Holds at
/// most one partial line, capped: a line that outgrows the cap is dropped as malformed
/// without buffering the rest of it.
pub(crate) struct LineSplitter<'f> {
    format: &'f SourceFormat,
    partial: Vec<u8>,
    /// The current line outgrew the cap; skip to its end.
    overflow: bool,
    cap: usize,
}

impl<'f> LineSplitter<'f> {
    pub(crate) fn new(format: &'f SourceFormat) -> Self {
        let cap = match format {
            SourceFormat::Lines => MAX_ID_BYTES,
            SourceFormat::Ndjson { .. } => MAX_JSON_LINE_BYTES,
        };
        LineSplitter {
            format,
            partial: Vec::new(),
            overflow: false,
            // Room for surrounding spaces and a '\r' before calling a line too long.
            cap: cap + 64,
        }
    }

    pub(crate) fn push(&mut self, mut chunk: &[u8], sink: &mut impl FnMut(Line<'_>)) {
        while let Some(end) = chunk.iter().position(|&b| b == b'\n') {
            let (line, rest) = (&chunk[..end], &chunk[end + 1..]);
            if self.overflow {
                self.overflow = false;
                sink(Line::Malformed);
            } else if self.partial.is_empty() {
                emit(self.format, line, sink);
            } else {
                self.partial.extend_from_slice(line);
                let whole = std::mem::take(&mut self.partial);
                emit(self.format, &whole, sink);
            }
            chunk = rest;
        }
        if self.overflow {
            return;
        }
        if self.partial.len() + chunk.len() > self.cap {
            self.partial.clear();
            self.overflow = true;
        } else {
            self.partial.extend_from_slice(chunk);
        }
    }

    /// The last line, when the source does not end with a newline.
    pub(crate) fn finish(&mut self, sink: &mut impl FnMut(Line<'_>)) {
        if self.overflow {
            self.overflow = false;
            sink(Line::Malformed);
        } else if !self.partial.is_empty() {
            let whole = std::mem::take(&mut self.partial);
            emit(self.format, &whole, sink);
        }
    }
}

fn emit(format: &SourceFormat, line: &[u8], sink: &mut impl FnMut(Line<'_>)) {
    if let Some(line) = parse_line(format, line) {
        sink(line);
    }
}

/// `None` for a blank line (ignored, not counted).
pub(crate) fn parse_line<'a>(format: &SourceFormat, raw: &'a [u8]) -> Option<Line<'a>> {
    let line = raw.trim_ascii();
    if line.is_empty() {
        return None;
    }
    Some(match format {
        SourceFormat::Lines => match std::str::from_utf8(line) {
            Ok(text) if valid_id(text) => Line::Id(Cow::Borrowed(line)),
            _ => Line::Malformed,
        },
        SourceFormat::Ndjson { field } => ndjson_id(line, field)
            .map_or(Line::Malformed, |id| Line::Id(Cow::Owned(id.into_bytes()))),
    })
}

fn ndjson_id(line: &[u8], field: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    json_id(value.get(field)?)
}

/// An id held in a JSON value (a source's NDJSON field, a create's answer): a string or an
/// integer that is a valid id.
pub(crate) fn json_id(value: &serde_json::Value) -> Option<String> {
    let id = match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => n.to_string(),
        _ => return None,
    };
    valid_id(&id).then_some(id)
}

/// An id is what a path segment can carry once decoded: non-empty, bounded, no whitespace
/// or control characters (a line with a space inside is two things glued together).
pub(crate) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && !id.chars().any(|c| c.is_whitespace() || c.is_control())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(format: &SourceFormat, chunks: &[&[u8]]) -> (Vec<Vec<u8>>, usize) {
        let mut ids = Vec::new();
        let mut bad = 0;
        let mut sink = |line: Line<'_>| match line {
            Line::Id(id) => ids.push(id.into_owned()),
            Line::Malformed => bad += 1,
        };
        let mut splitter = LineSplitter::new(format);
        for chunk in chunks {
            splitter.push(chunk, &mut sink);
        }
        splitter.finish(&mut sink);
        (ids, bad)
    }

    #[test]
    fn lines_split_across_chunks_and_bad_lines_are_counted() {
        let long = vec![b'x'; 2000];
        let chunks: Vec<&[u8]> = vec![
            b"1\n2",
            b"2\r\n\n  33  \nbad line\n\xff\xfe\n",
            &long,
            b"\n4",
            b"4",
        ];
        let (ids, bad) = split(&SourceFormat::Lines, &chunks);
        assert_eq!(
            ids,
            vec![
                b"1".to_vec(),
                b"22".to_vec(),
                b"33".to_vec(),
                b"44".to_vec()
            ]
        );
        assert_eq!(bad, 3);
    }

    #[test]
    fn an_overlong_line_is_dropped_without_being_buffered() {
        let format = SourceFormat::Lines;
        let mut splitter = LineSplitter::new(&format);
        let mut seen = Vec::new();
        let mut sink = |line: Line<'_>| seen.push(matches!(line, Line::Id(_)));
        for _ in 0..1000 {
            splitter.push(&[b'y'; 4096], &mut sink);
            assert!(splitter.partial.len() <= splitter.cap);
        }
        splitter.push(b"\n5\n", &mut sink);
        assert_eq!(seen, vec![false, true]);
    }

    #[test]
    fn ndjson_takes_string_or_integer_fields() {
        let format = SourceFormat::Ndjson {
            field: "id".to_owned(),
        };
        let input: &[u8] = b"{\"id\":\"a\"}\n{\"id\":7,\"x\":1}\n{bad\n{\"other\":1}\n{\"id\":{\"n\":1}}\n{\"id\":1.5}\n{\"id\":\"\"}\n";
        let (ids, bad) = split(&format, &[input]);
        assert_eq!(ids, vec![b"a".to_vec(), b"7".to_vec()]);
        assert_eq!(bad, 5);
    }
}
