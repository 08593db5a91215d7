//! The bytes of a connection as hyper reads and writes them, watched for the heads hyper
//! refuses by itself.
//!
//! hyper parses a request head in a buffer of at most `max_buf_size` bytes (`server.rs`)
//! and answers a head that does not fit, or that has more than `server.max_headers`
//! fields, with a bare `431 Request Header Fields Too Large` (no body); a target longer
//! than it can take, with a bare `414`. A request line too long for the buffer thus got
//! 431, though a target longer than `server.max_header_bytes` that does fit gets 414 from
//! `admit.rs`. hyper does not say which part overflowed, so [`HeadGuard`] keeps the start
//! of the line being read (the bytes since the last LF): when hyper writes one of its own
//! bare answers, a line that is still the request line (a method, then a space) and longer
//! than `max_header_bytes` gets cacheguard's 414, anything else cacheguard's 431, each with
//! a short text body, like every other answer cacheguard makes itself.
//!
//! hyper's own answers are told from the service's by their shape: a status line, then
//! only `connection: close`, `content-length: 0` and `date`, at the start of a write. Every answer of the
//! service carries `X-Cache` (or, on the admin listener, a body), so none has that shape.
//!
//! Memory per connection stays bounded as before: hyper's read buffer holds at most
//! `max_buf_size` bytes of a head (the guard does not enlarge it), the guard keeps a fixed
//! [`LINE_START`] bytes of the current line, and a replacement answer (under 300 bytes)
//! only from the refusal until the connection closes.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::admit::{MAX_METHOD_BYTES, is_tchar};
use crate::error::ProxyError;

/// Bytes kept of the start of the line being read: enough for any method taken
/// ([`MAX_METHOD_BYTES`]) and its space.
const LINE_START: usize = MAX_METHOD_BYTES + 1;

/// A connection's stream, with hyper's bare refusals replaced by cacheguard's own.
#[derive(Debug)]
pub(crate) struct HeadGuard<T> {
    inner: T,
    line: Line,
    max_header_bytes: usize,
    max_headers: usize,
    /// The replacement answer being written, and how much of it is out.
    pending: Option<(Vec<u8>, usize)>,
}

/// The line being read: its length so far and its first bytes.
#[derive(Debug)]
struct Line {
    len: usize,
    start: [u8; LINE_START],
    kept: usize,
}

impl Default for Line {
    fn default() -> Self {
        Line {
            len: 0,
            start: [0; LINE_START],
            kept: 0,
        }
    }
}

impl Line {
    fn feed(&mut self, bytes: &[u8]) {
        let rest = match bytes.iter().rposition(|&b| b == b'\n') {
            Some(lf) => {
                self.len = 0;
                self.kept = 0;
                &bytes[lf + 1..]
            }
            None => bytes,
        };
        let take = rest.len().min(LINE_START - self.kept);
        self.start[self.kept..self.kept + take].copy_from_slice(&rest[..take]);
        self.kept += take;
        self.len = self.len.saturating_add(rest.len());
    }

    /// Whether the line reads as a request line: a method (a token), then a space.
    fn is_request_line(&self) -> bool {
        let start = &self.start[..self.kept];
        match start.iter().position(|&b| b == b' ') {
            Some(space) if space > 0 => start[..space].iter().all(|&b| is_tchar(b)),
            _ => false,
        }
    }
}

impl<T> HeadGuard<T> {
    pub(crate) fn new(inner: T, max_header_bytes: usize, max_headers: usize) -> Self {
        HeadGuard {
            inner,
            line: Line::default(),
            max_header_bytes,
            max_headers,
            pending: None,
        }
    }

    /// cacheguard's answer in place of `written`, when that is one of hyper's bare 414 or
    /// 431 answers.
    fn replacement(&self, written: &[u8]) -> Option<Vec<u8>> {
        let status = written.strip_prefix(b"HTTP/1.1 ")?.get(..4)?;
        if status != b"414 " && status != b"431 " {
            return None;
        }
        let end = written.windows(4).position(|w| w == b"\r\n\r\n")?;
        let mut date = None;
        for line in written[..end].split(|&b| b == b'\n').skip(1) {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.eq_ignore_ascii_case(b"content-length: 0")
                || line.eq_ignore_ascii_case(b"connection: close")
            {
                continue;
            }
            if line.len() > 5 && line[..5].eq_ignore_ascii_case(b"date:") {
                date = Some(line);
                continue;
            }
            // Another header: the service's answer, not hyper's own.
            return None;
        }
        let long_target = status == b"414 "
            || (self.line.is_request_line() && self.line.len > self.max_header_bytes);
        let (status_line, body) = if long_target {
            (
                "414 URI Too Long",
                ProxyError::UriTooLong(self.max_header_bytes).to_string(),
            )
        } else {
            (
                "431 Request Header Fields Too Large",
                format!(
                    "request header fields too large (limits {} bytes, {} fields)",
                    self.max_header_bytes, self.max_headers
                ),
            )
        };
        let body = format!("cacheguard: {body}\n");
        let mut answer = format!(
            "HTTP/1.1 {status_line}\r\ncontent-type: text/plain; charset=utf-8\r\n\
             x-cache: BYPASS\r\nconnection: close\r\ncontent-length: {}\r\n",
            body.len()
        )
        .into_bytes();
        if let Some(date) = date {
            answer.extend_from_slice(date);
            answer.extend_from_slice(b"\r\n");
        }
        answer.extend_from_slice(b"\r\n");
        answer.extend_from_slice(body.as_bytes());
        Some(answer)
    }
}

impl<T: AsyncWrite + Unpin> HeadGuard<T> {
    /// Writes out the replacement answer, if there is one.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((answer, sent)) = &mut self.pending {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &answer[*sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *sent += n;
            if *sent == answer.len() {
                self.pending = None;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for HeadGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        this.line.feed(&buf.filled()[before..]);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HeadGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(answer) = this.replacement(buf) {
            this.pending = Some((answer, 0));
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(first) = bufs.iter().find(|b| !b.is_empty())
            && let Some(answer) = this.replacement(first)
        {
            this.pending = Some((answer, 0));
            return Poll::Ready(Ok(first.len()));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What hyper writes.
    const BARE_431: &[u8] = b"HTTP/1.1 431 Request Header Fields Too Large\r\n\
        connection: close\r\ncontent-length: 0\r\ndate: Wed, 25 Nov 2026 09:18:57 GMT\r\n\r\n";

    fn guard_after(read: &[&[u8]]) -> HeadGuard<()> {
        let mut guard = HeadGuard::new((), 100, 20);
        for bytes in read {
            guard.line.feed(bytes);
        }
        guard
    }

    fn status(answer: &[u8]) -> &str {
        std::str::from_utf8(&answer[9..12]).expect("status")
    }

    #[test]
    fn an_overlong_request_line_gets_414_and_anything_else_431() {
        let long = "a".repeat(200);
        let target = format!("GET /{long}");
        // Read in pieces, after an earlier request on the same connection.
        let guard = guard_after(&[
            b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGE",
            &target.as_bytes()[2..],
        ]);
        let answer = guard.replacement(BARE_431).expect("replaced");
        assert_eq!(status(&answer), "414");
        let text = String::from_utf8(answer).expect("text");
        assert!(text.contains("\r\ndate: Wed, 25 Nov 2026"), "{text}");
        assert!(
            text.ends_with("\r\n\r\ncacheguard: request target too long (limit 100 bytes)\n"),
            "{text}"
        );
        // A header line, a short request line, the blank line after too many fields.
        for read in [
            format!("GET / HTTP/1.1\r\nX-Big: {long}"),
            format!("GET /{} HTTP/1.1\r\nX-Big: {long}", "a".repeat(150)),
            "GET /".to_owned(),
            "GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\n".to_owned(),
            long.clone(),
        ] {
            let answer = guard_after(&[read.as_bytes()]).replacement(BARE_431);
            let answer = answer.expect("replaced");
            assert_eq!(status(&answer), "431", "{read:?}");
            assert!(
                String::from_utf8_lossy(&answer).ends_with(
                    "cacheguard: request header fields too large (limits 100 bytes, 20 fields)\n"
                ),
                "{read:?}"
            );
        }
    }

    #[test]
    fn only_hyper_s_bare_answers_are_replaced() {
        let guard = guard_after(&[format!("GET /{}", "a".repeat(200)).as_bytes()]);
        let bare_414 = b"HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let answer = guard.replacement(bare_414).expect("replaced");
        assert_eq!(status(&answer), "414");
        for written in [
            // The service's answers: a body, X-Cache.
            &b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 5\r\n\r\nhello"[..],
            b"HTTP/1.1 431 Request Header Fields Too Large\r\nx-cache: BYPASS\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            // A head cut short.
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n",
            b"HTTP/1.0 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n",
        ] {
            assert!(
                guard.replacement(written).is_none(),
                "{}",
                String::from_utf8_lossy(written)
            );
        }
    }

    #[tokio::test]
    async fn the_replacement_is_what_reaches_the_peer() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let (near, mut far) = tokio::io::duplex(1 << 16);
        let mut guard = HeadGuard::new(near, 100, 20);
        far.write_all(format!("GET /{}", "a".repeat(300)).as_bytes())
            .await
            .expect("write");
        let mut buf = [0u8; 64];
        let mut read = 0;
        while read < 305 {
            read += guard.read(&mut buf).await.expect("read");
        }
        guard.write_all(BARE_431).await.expect("write");
        guard.shutdown().await.expect("shutdown");
        let mut seen = String::new();
        far.read_to_string(&mut seen).await.expect("read");
        assert!(seen.starts_with("HTTP/1.1 414 URI Too Long\r\n"), "{seen}");
        assert!(seen.ends_with("(limit 100 bytes)\n"), "{seen}");
    }
}
