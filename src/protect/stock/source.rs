//! The origin's own count of a resource's units: `GET <upstream><source path>`, a JSON
//! answer, the number at the gate's JSON pointer.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::protect::bloom::source::http_client;

/// Largest source answer read: a count, not a catalogue.
const MAX_ANSWER: usize = 64 * 1024;

/// Asks the origin how many units of one resource are left.
#[derive(Debug)]
pub(crate) struct Source {
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl Source {
    pub(crate) fn new() -> Self {
        Source {
            client: http_client(),
        }
    }

    /// The number at `pointer` in the answer to `GET base + path`, within `timeout`.
    ///
    /// # Errors
    /// What went wrong, for the log: no answer in time, a status other than 200, a body
    /// that is not JSON, no number at the pointer (or a negative or fractional one).
    pub(crate) async fn remaining(
        &self,
        base: &Uri,
        path: &str,
        pointer: &str,
        timeout: Duration,
    ) -> Result<u64, String> {
        let authority = base.authority().map_or("", |a| a.as_str());
        let prefix = base.path().trim_end_matches('/');
        let uri: Uri = format!("http://{authority}{prefix}{path}")
            .parse()
            .map_err(|error| format!("the source path {path:?} is not a valid URI: {error}"))?;
        let request = Request::get(uri.clone())
            .header(header::ACCEPT, "application/json")
            .body(Empty::new())
            .map_err(|error| format!("building GET {uri}: {error}"))?;
        let fetch = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|error| format!("GET {uri}: {error}"))?;
            if response.status() != StatusCode::OK {
                return Err(format!(
                    "GET {uri} answered {}, not 200",
                    response.status().as_u16()
                ));
            }
            let body = Limited::new(response.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|error| format!("reading GET {uri}: {error}"))?
                .to_bytes();
            number_at(&body, pointer).map_err(|why| format!("GET {uri}: {why}"))
        };
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| format!("GET {uri} did not answer within {timeout:?}"))?
    }
}

/// The non-negative integer at `pointer` (RFC 6901; empty: the whole document).
fn number_at(body: &[u8], pointer: &str) -> Result<u64, String> {
    let json: serde_json::Value =
        serde_json::from_slice(body).map_err(|error| format!("the answer is not JSON: {error}"))?;
    let value = json
        .pointer(pointer)
        .ok_or_else(|| format!("the answer has nothing at {pointer:?}"))?;
    match value {
        serde_json::Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("{pointer:?} is {n}, not a count of units")),
        // A count written as a string ("12") is common enough to take.
        serde_json::Value::String(s) => s
            .trim()
            .parse()
            .map_err(|_| format!("{pointer:?} is {s:?}, not a count of units")),
        other => Err(format!("{pointer:?} is {other}, not a count of units")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_non_negative_numbers_are_counts() {
        assert_eq!(number_at(br#"{"remaining": 12}"#, "/remaining"), Ok(12));
        assert_eq!(number_at(br#"{"a": {"left": "7"}}"#, "/a/left"), Ok(7));
        assert_eq!(number_at(b"42", ""), Ok(42));
        for (body, pointer) in [
            (&br#"{"remaining": -1}"#[..], "/remaining"),
            (br#"{"remaining": 1.5}"#, "/remaining"),
            (br#"{"remaining": null}"#, "/remaining"),
            (br#"{"other": 3}"#, "/remaining"),
            (b"not json", "/remaining"),
        ] {
            assert!(number_at(body, pointer).is_err(), "{body:?}");
        }
    }
}
