//! Write routes with `bloom_add`: the create goes through untouched, and when the origin
//! answers 2xx the new resource's id is added to the Bloom filter — here, in Redis and on
//! every instance — before the client gets the answer, so no instance can reject the id
//! once the client knows it exists.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response, StatusCode, header};
use tracing::warn;

use super::body::{Body, Read, read_whole};
use super::respond;
use super::route::Route;
use super::spool::Spooled;
use super::write::WritePath;
use crate::config::AddFrom;
use crate::protect::bloom::source::{self, MAX_ID_BYTES};

impl WritePath {
    pub(crate) async fn serve_create(
        &self,
        route: &Arc<Route>,
        request: Request<Spooled>,
        client: SocketAddr,
    ) -> Response<Body> {
        let response = self
            .passthrough
            .serve_whole(
                &route.metrics,
                request,
                client,
                &route.config.forward_client_headers,
            )
            .await;
        let (Some(filter), Some(add)) = (&route.adds_to, &route.config.bloom_add) else {
            return response;
        };
        if !response.status().is_success() {
            return response;
        }
        let (response, id) = match &add.from {
            AddFrom::Location => {
                let id = response
                    .headers()
                    .get(header::LOCATION)
                    .and_then(|value| value.to_str().ok())
                    .and_then(|location| self.id_from_location(filter.name(), location));
                (response, id)
            }
            AddFrom::Json(pointer) => {
                let (parts, body) = response.into_parts();
                match read_whole(body, route.config.max_entry_bytes).await {
                    Ok(Read::Whole(bytes)) => {
                        let id = id_from_json(&bytes, pointer);
                        (Response::from_parts(parts, Body::full(bytes)), id)
                    }
                    Ok(Read::TooLarge(body)) => (Response::from_parts(parts, body), None),
                    Err(error) => {
                        // The create happened; the client could not have read the answer
                        // either. Nothing is added: the next source load will have it.
                        warn!(message = "Create answer cut while reading it.", route = %route.config.name, %error);
                        filter.metrics.add_failures_no_id.inc();
                        return respond::text(StatusCode::BAD_GATEWAY, "bad gateway\n");
                    }
                }
            }
        };
        match id {
            Some(id) => self.filters.add_created(filter, &id).await,
            None => {
                filter.metrics.add_failures_no_id.inc();
                warn!(
                    message = "No id found in a create's answer; it reaches the Bloom filter with the next source load.",
                    route = %route.config.name,
                );
            }
        }
        response
    }

    /// The id in a `Location`: the Bloom parameter of the read route of `filter` that the
    /// path matches, else the path's last segment.
    fn id_from_location(&self, filter: &str, location: &str) -> Option<Vec<u8>> {
        let path = if location.starts_with('/') {
            location
        } else if let Some(after_scheme) = location.split_once("://").map(|(_, rest)| rest) {
            after_scheme.find('/').map_or("/", |i| &after_scheme[i..])
        } else {
            location
        };
        let path = path.split(['?', '#']).next().unwrap_or(path);
        let raw = self
            .routes
            .load()
            .id_for_filter(filter, path)
            .or_else(|| path.rsplit('/').find(|segment| !segment.is_empty()))?;
        let id: Vec<u8> = percent_encoding::percent_decode_str(raw).collect();
        valid(id)
    }
}

fn id_from_json(body: &[u8], pointer: &str) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    source::json_id(value.pointer(pointer)?).map(String::into_bytes)
}

fn valid(id: Vec<u8>) -> Option<Vec<u8>> {
    (!id.is_empty() && id.len() <= MAX_ID_BYTES).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_from_json_pointers() {
        assert_eq!(id_from_json(br#"{"id":"a1"}"#, "/id"), Some(b"a1".to_vec()));
        assert_eq!(
            id_from_json(br#"{"item":{"id":7}}"#, "/item/id"),
            Some(b"7".to_vec())
        );
        assert_eq!(id_from_json(br#"{"id":null}"#, "/id"), None);
        assert_eq!(id_from_json(br#"{"id":""}"#, "/id"), None);
        assert_eq!(id_from_json(b"not json", "/id"), None);
    }
}
