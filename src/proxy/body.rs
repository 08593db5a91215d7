//! The response body type: a buffered body (cache hits, errors), a streamed origin body, or
//! a buffered prefix followed by the rest of a streamed body (answers that outgrew
//! `max_entry_bytes` while being read for storage); and, with the access log on, any of
//! these wrapped to count what is sent and write the request's line when it ends.
//!
//! An enum instead of a boxed trait object keeps the hit path free of a per-response
//! allocation (the access log's wrapper is one, only while the log is on).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::access_log::Pending;

#[derive(Debug)]
pub(crate) enum Body {
    Full(Option<Bytes>),
    Stream(Incoming),
    Prefixed(Option<Bytes>, Incoming),
    /// Made by the router alone, last (see [`Body::logged`]).
    Logged(Box<Logged>),
}

/// A body whose end writes its request's access-log line: sent whole, failed, or dropped
/// unfinished (the client went away, the connection was cut). Exactly once: the line is
/// taken when it is finished.
#[derive(Debug)]
pub(crate) struct Logged {
    inner: Body,
    /// Data bytes handed to the connection so far.
    sent: u64,
    line: Option<Pending>,
}

impl Logged {
    fn end(&mut self) {
        if let Some(line) = self.line.take() {
            line.finish(self.sent);
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.end();
    }
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

    /// This body, writing `line` to the access log when it ends or is dropped.
    pub(crate) fn logged(self, line: Pending) -> Self {
        Body::Logged(Box::new(Logged {
            inner: self,
            sent: 0,
            line: Some(line),
        }))
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
            Body::Logged(logged) => {
                let polled = Pin::new(&mut logged.inner).poll_frame(cx);
                match &polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Some(data) = frame.data_ref() {
                            logged.sent += data.len() as u64;
                        }
                        // hyper stops polling a body that says it ended (and drops it
                        // later): the time is taken now.
                        if logged.inner.is_end_stream() {
                            logged.end();
                        }
                    }
                    Poll::Ready(None | Some(Err(_))) => logged.end(),
                    Poll::Pending => {}
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(bytes) => bytes.is_none(),
            Body::Stream(incoming) => incoming.is_end_stream(),
            Body::Prefixed(prefix, rest) => prefix.is_none() && rest.is_end_stream(),
            Body::Logged(logged) => logged.inner.is_end_stream(),
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
            Body::Logged(logged) => logged.inner.size_hint(),
        }
    }
}

/// A streamed answer read up to a limit: whole, or the part read and the rest unread.
#[derive(Debug)]
pub(crate) enum Read {
    Whole(Bytes),
    /// Over the limit: the part read so far, then the rest, streamed on unread.
    TooLarge(Body),
}

/// Reads a streamed answer whole, up to `limit` bytes.
pub(crate) async fn read_whole(body: Body, limit: usize) -> Result<Read, hyper::Error> {
    let mut incoming = match body {
        Body::Stream(incoming) => incoming,
        Body::Full(bytes) => return Ok(Read::Whole(bytes.unwrap_or_default())),
        // A logged body is the router's last step: never seen here.
        other @ (Body::Prefixed(..) | Body::Logged(_)) => return Ok(Read::TooLarge(other)),
    };
    let mut buf = BytesMut::new();
    while let Some(frame) = incoming.frame().await {
        if let Ok(data) = frame?.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                return Ok(Read::TooLarge(Body::Prefixed(Some(buf.freeze()), incoming)));
            }
        }
    }
    Ok(Read::Whole(buf.freeze()))
}
