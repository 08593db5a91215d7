//! The response body type: a buffered body (cache hits, errors), a streamed origin body, or
//! a buffered prefix followed by the rest of a streamed body (answers that outgrew
//! `max_entry_bytes` while being read for storage).
//!
//! An enum instead of a boxed trait object keeps the hit path free of a per-response
//! allocation.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;

#[derive(Debug)]
pub(crate) enum Body {
    Full(Option<Bytes>),
    Stream(Incoming),
    Prefixed(Option<Bytes>, Incoming),
}

impl Body {
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        if bytes.is_empty() {
            Body::Full(None)
        } else {
            Body::Full(Some(bytes))
        }
    }

    pub(crate) fn empty() -> Self {
        Body::Full(None)
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Body::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(incoming) => Pin::new(incoming).poll_frame(cx),
            Body::Prefixed(prefix, rest) => {
                if let Some(b) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                Pin::new(rest).poll_frame(cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(bytes) => bytes.is_none(),
            Body::Stream(incoming) => incoming.is_end_stream(),
            Body::Prefixed(prefix, rest) => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Stream(incoming) => incoming.size_hint(),
            Body::Prefixed(prefix, rest) => {
                let extra = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
        }
    }
}
