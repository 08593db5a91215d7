//! The bytes of an HTTP/1 connection as hyper reads them, watched for chunk sizes that
//! declare more than `server.max_body_bytes`.
//!
//! hyper parses a chunked body's size lines itself and does not say what they declare: it
//! hands the body over as its bytes arrive. A chunk whose size line says
//! `FFFFFFFFFFFFFFED` was therefore seen only as bytes that never came, and answered 408
//! once the client had paused for `upload_timeout`, though no body that size can be taken.
//! [`ChunkGuard`] follows the framing of each request on the connection — its head's
//! `Transfer-Encoding` and `Content-Length`, then its chunked body's size lines — and, as
//! soon as the sizes declared so far exceed the limit, gives hyper the bytes before the
//! digit that crossed it and then fails the next read with [`ChunkTooLarge`]. hyper reports
//! that as an error of the request's body, answered 413 (`upload.rs`), and the connection
//! is closed (`Connection: close`, `proxy.rs`).
//!
//! The guard only ever refuses; it never changes the bytes hyper reads. Where its reading
//! could part from hyper's, it stops watching the connection and the limits applied as
//! bytes arrive remain: HTTP/2 (its preface), `CONNECT`, a request with `Upgrade`, a head
//! line it does not follow (a folded line, a `Transfer-Encoding` whose last coding is not
//! `chunked` or a `Content-Length` hyper would refuse — hyper refuses those itself — or
//! one of these lines longer than [`KEPT`]), a size line without digits. A refusal hyper
//! makes itself ends the connection, so the two never go on apart.
//!
//! As it follows the framing, the guard also publishes whether a request head has begun to
//! arrive and is not whole yet ([`HeadStart`]): the time a connection may wait for its next
//! head depends on it (`keepalive.rs`).
//!
//! Memory per connection: [`KEPT`] bytes of the current head line and a few counters. Cost
//! per read: one scan for line ends in a head, a few comparisons per header line, and a
//! skip per chunk in a body.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::keepalive::HeadStart;

/// Bytes kept of each head line: enough for the name and value of any `Transfer-Encoding`,
/// `Content-Length` or `Upgrade` line in use.
const KEPT: usize = 256;

/// Why a read failed: the chunk sizes of a request body declared more than the body limit
/// (the limit, in bytes).
#[derive(Debug, thiserror::Error)]
#[error("chunk sizes declare more than the body limit ({0} bytes)")]
pub(crate) struct ChunkTooLarge(pub(crate) u64);

/// A connection's stream, its reads failed once a chunk size declares more than `limit`.
#[derive(Debug)]
pub(crate) struct ChunkGuard<T> {
    inner: T,
    framing: Framing,
    head: Arc<HeadStart>,
}

impl<T> ChunkGuard<T> {
    pub(crate) fn new(inner: T, limit: u64, head: Arc<HeadStart>) -> Self {
        ChunkGuard {
            inner,
            framing: Framing {
                limit,
                line: Line::default(),
                state: State::Head(Head::default()),
            },
            head,
        }
    }
}

/// Where the connection's bytes are, as read so far.
#[derive(Debug)]
struct Framing {
    limit: u64,
    /// The head line being read (in [`State::Head`]).
    line: Line,
    state: State,
}

#[derive(Debug)]
enum State {
    /// In a request head (or before one).
    Head(Head),
    /// In a `Content-Length` body: this many bytes to go.
    Fixed(u64),
    /// In a chunked body, whose chunks so far declared `declared` bytes.
    Chunked { declared: u64, at: Chunk },
    /// Not watched any more.
    Off,
    /// Refused: every read fails.
    Refused,
}

#[derive(Debug)]
enum Chunk {
    /// Reading a size's hex digits: the value so far, and whether there was a digit.
    Size { value: u64, digits: bool },
    /// After the digits (extensions, whitespace) until the line ends: the size.
    Extension(u64),
    /// This many data bytes to go.
    Data(u64),
    /// The line end after a chunk's data.
    DataEnd,
    /// The trailer section after the last chunk: whether the current line is empty so far.
    Trailer { empty: bool },
}

/// What a head has said so far.
#[derive(Debug, Default)]
struct Head {
    /// The request line has been seen.
    started: bool,
    /// A `Transfer-Encoding` line was seen, and whether the last one's last coding is
    /// `chunked` (hyper's reading).
    transfer_encoding: bool,
    chunked: bool,
    length: Option<u64>,
    upgrade: bool,
}

/// The line being read: its first [`KEPT`] bytes and its whole length.
#[derive(Debug)]
struct Line {
    kept: [u8; KEPT],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Line {
            kept: [0; KEPT],
            len: 0,
        }
    }
}

impl Line {
    fn push(&mut self, bytes: &[u8]) {
        let room = KEPT.saturating_sub(self.len);
        let take = bytes.len().min(room);
        self.kept[self.len.min(KEPT)..self.len.min(KEPT) + take].copy_from_slice(&bytes[..take]);
        self.len = self.len.saturating_add(bytes.len());
    }

    /// The line just ended, without its CR (its kept start, when it was longer), and
    /// whether it was longer than what is kept.
    fn ended(&self) -> (&[u8], bool) {
        let too_long = self.len > KEPT;
        let line = &self.kept[..self.len.min(KEPT)];
        if too_long {
            (line, true)
        } else {
            (line.strip_suffix(b"\r").unwrap_or(line), false)
        }
    }
}

/// What follows a head line: more of the head, or the state after it.
enum HeadLine {
    Continue,
    Next(State),
}

impl Head {
    /// Reads `line`, which just ended, and clears it for the next.
    fn end_line(&mut self, line: &mut Line) -> HeadLine {
        let (bytes, too_long) = line.ended();
        let next = self.judge(bytes, too_long);
        line.len = 0;
        next
    }

    fn judge(&mut self, line: &[u8], too_long: bool) -> HeadLine {
        if !self.started {
            // Empty lines before a request line are skipped (RFC 9112 §2.2), as hyper does.
            if line.is_empty() && !too_long {
                return HeadLine::Continue;
            }
            self.started = true;
            if line.starts_with(b"PRI ") || line.starts_with(b"CONNECT ") {
                return HeadLine::Next(State::Off);
            }
            return HeadLine::Continue;
        }
        if line.is_empty() && !too_long {
            return HeadLine::Next(self.body());
        }
        if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
            // A folded line: hyper refuses it.
            return HeadLine::Next(State::Off);
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return HeadLine::Continue;
        };
        let name = &line[..colon];
        let value = line[colon + 1..].trim_ascii();
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if too_long {
                return HeadLine::Next(State::Off);
            }
            self.transfer_encoding = true;
            let last = value.rsplit(|&b| b == b',').next().unwrap_or_default();
            self.chunked = last.trim_ascii().eq_ignore_ascii_case(b"chunked");
        } else if name.eq_ignore_ascii_case(b"content-length") {
            match content_length(value).filter(|_| !too_long) {
                Some(length) if self.length.is_none_or(|seen| seen == length) => {
                    self.length = Some(length);
                }
                _ => return HeadLine::Next(State::Off),
            }
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            self.upgrade = true;
        }
        HeadLine::Continue
    }

    /// What follows the head: its body's framing (hyper's rules: `Transfer-Encoding`
    /// before `Content-Length`; no body without either).
    fn body(&self) -> State {
        if self.upgrade {
            return State::Off;
        }
        if self.transfer_encoding {
            return if self.chunked {
                State::Chunked {
                    declared: 0,
                    at: Chunk::Size {
                        value: 0,
                        digits: false,
                    },
                }
            } else {
                State::Off
            };
        }
        match self.length {
            Some(length) if length > 0 => State::Fixed(length),
            _ => State::Head(Head::default()),
        }
    }
}

/// A `Content-Length` value as hyper takes it: digits, or a list of equal ones.
fn content_length(value: &[u8]) -> Option<u64> {
    let mut length = None;
    for part in value.split(|&b| b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let parsed: u64 = std::str::from_utf8(part).ok()?.parse().ok()?;
        if length.is_some_and(|seen| seen != parsed) {
            return None;
        }
        length = Some(parsed);
    }
    length
}

fn hex(b: u8) -> Option<u64> {
    (b as char).to_digit(16).map(u64::from)
}

impl Framing {
    /// Whether a request head has begun and is not whole: a byte of it came (empty lines
    /// before a request line aside). Where the guard no longer follows the bytes, as if
    /// one had.
    fn head_begun(&self) -> bool {
        match &self.state {
            State::Head(head) => head.started || self.line.len > 0,
            State::Fixed(_) | State::Chunked { .. } => false,
            State::Off | State::Refused => true,
        }
    }

    /// Follows `bytes`, the next bytes read. Returns the offset of the byte at which the
    /// sizes declared went over the limit, when one did: the bytes before it are fine.
    fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut at = 0;
        while at < bytes.len() {
            let rest = &bytes[at..];
            match &mut self.state {
                State::Off | State::Refused => return None,
                State::Head(head) => match rest.iter().position(|&b| b == b'\n') {
                    None => {
                        self.line.push(rest);
                        return None;
                    }
                    Some(lf) => {
                        self.line.push(&rest[..lf]);
                        at += lf + 1;
                        if let HeadLine::Next(next) = head.end_line(&mut self.line) {
                            self.state = next;
                        }
                    }
                },
                State::Fixed(left) => {
                    let skip = usize::try_from(*left).unwrap_or(usize::MAX).min(rest.len());
                    at += skip;
                    *left -= skip as u64;
                    if *left == 0 {
                        self.state = State::Head(Head::default());
                    }
                }
                State::Chunked {
                    declared,
                    at: chunk,
                } => match chunk {
                    Chunk::Size { value, digits } => {
                        let Some(digit) = hex(rest[0]) else {
                            if !*digits {
                                // No size: hyper refuses the body itself.
                                self.state = State::Off;
                                return None;
                            }
                            *chunk = Chunk::Extension(*value);
                            continue;
                        };
                        // Further digits only make the size larger: over the limit now is
                        // over it for good.
                        let grown = value.checked_mul(16).and_then(|v| v.checked_add(digit));
                        match grown {
                            Some(size) if declared.saturating_add(size) <= self.limit => {
                                *value = size;
                                *digits = true;
                                at += 1;
                            }
                            _ => {
                                self.state = State::Refused;
                                return Some(at);
                            }
                        }
                    }
                    Chunk::Extension(size) => match rest.iter().position(|&b| b == b'\n') {
                        None => at = bytes.len(),
                        Some(lf) => {
                            at += lf + 1;
                            *chunk = if *size == 0 {
                                Chunk::Trailer { empty: true }
                            } else {
                                *declared += *size;
                                Chunk::Data(*size)
                            };
                        }
                    },
                    Chunk::Data(left) => {
                        let skip = usize::try_from(*left).unwrap_or(usize::MAX).min(rest.len());
                        at += skip;
                        *left -= skip as u64;
                        if *left == 0 {
                            *chunk = Chunk::DataEnd;
                        }
                    }
                    Chunk::DataEnd => match rest.iter().position(|&b| b == b'\n') {
                        None => at = bytes.len(),
                        Some(lf) => {
                            at += lf + 1;
                            *chunk = Chunk::Size {
                                value: 0,
                                digits: false,
                            };
                        }
                    },
                    Chunk::Trailer { empty } => {
                        let b = rest[0];
                        at += 1;
                        if b == b'\n' {
                            if *empty {
                                self.state = State::Head(Head::default());
                            } else {
                                *empty = true;
                            }
                        } else if b != b'\r' {
                            *empty = false;
                        }
                    }
                },
            }
        }
        None
    }
}

fn refused(limit: u64) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, ChunkTooLarge(limit))
}

impl<T: AsyncRead + Unpin> AsyncRead for ChunkGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if matches!(this.framing.state, State::Refused) {
            return Poll::Ready(Err(refused(this.framing.limit)));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let cut = this.framing.feed(&buf.filled()[before..]);
        this.head.set(this.framing.head_begun());
        if let Some(cut) = cut {
            // Nothing before the refused byte: fail now (an empty read is an end of file).
            if cut == 0 {
                return Poll::Ready(Err(refused(this.framing.limit)));
            }
            buf.set_filled(before + cut);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ChunkGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `reads` in turn; the read and offset of the refusal, if any.
    fn refusal(limit: u64, reads: &[&[u8]]) -> Option<(usize, usize)> {
        let mut framing = Framing {
            limit,
            line: Line::default(),
            state: State::Head(Head::default()),
        };
        for (i, read) in reads.iter().enumerate() {
            if let Some(at) = framing.feed(read) {
                return Some((i, at));
            }
        }
        None
    }

    /// Every split of `bytes` in two reads gives the same answer as one read.
    fn refusal_anyhow(limit: u64, bytes: &[u8]) -> Option<usize> {
        let whole = refusal(limit, &[bytes]).map(|(_, at)| at);
        for split in 0..=bytes.len() {
            let (a, b) = bytes.split_at(split);
            let parts = refusal(limit, &[a, b]).map(|(i, at)| if i == 0 { at } else { split + at });
            assert_eq!(parts, whole, "split at {split}");
        }
        whole
    }

    const HEAD: &str = "PUT /w HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n";

    #[test]
    fn a_size_over_the_limit_is_refused_at_the_digit_that_crosses_it() {
        for (body, cut) in [
            ("FFFFFFFFFFFFFFED\r\nabc", 2),
            ("101\r\n", 2),
            ("1FFFFFFFFFFFFFFFF\r\n", 2),
            ("FFFFFFFFFF;name=value\r\n", 2),
            // The second chunk takes the total over: 5 + 0xFC = 257.
            ("5\r\nhello\r\nFC\r\n", 11),
            // A pipelined request's body after a first one.
            ("0\r\n\r\n", usize::MAX),
        ] {
            let bytes = format!("{HEAD}{body}");
            let expected = (cut != usize::MAX).then(|| HEAD.len() + cut);
            assert_eq!(refusal_anyhow(256, bytes.as_bytes()), expected, "{body:?}");
        }
        let pipelined = format!("{HEAD}0\r\n\r\n{HEAD}1000\r\n");
        assert_eq!(
            refusal_anyhow(256, pipelined.as_bytes()),
            Some(2 * HEAD.len() + 5 + 3)
        );
    }

    #[test]
    fn bodies_within_the_limit_and_other_framings_pass() {
        let at_limit = format!(
            "{HEAD}100\r\n{}\r\n0\r\nX-Trailer: 1\r\n\r\n",
            "a".repeat(256)
        );
        assert_eq!(refusal_anyhow(256, at_limit.as_bytes()), None);
        // Leading zeros, an extension, then the next request.
        let next = format!(
            "{HEAD}000010;x=y\r\n{}\r\n0\r\n\r\n{HEAD}FF\r\n",
            "a".repeat(16)
        );
        assert_eq!(refusal_anyhow(256, next.as_bytes()), None);
        // A Content-Length body whose bytes read like a size line, then a request.
        let fixed =
            format!("PUT /w HTTP/1.1\r\nContent-Length: 10\r\n\r\nFFFFFFFF\r\n{HEAD}FF\r\n");
        assert_eq!(refusal_anyhow(256, fixed.as_bytes()), None);
        let fixed_then_big =
            format!("PUT /w HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi{HEAD}FFFF\r\n");
        assert_eq!(
            refusal_anyhow(256, fixed_then_big.as_bytes()),
            Some(fixed_then_big.len() - 4)
        );
        // No body at all; bare LF lines; a chunked coding that is not the last one.
        for head in [
            "GET / HTTP/1.1\r\nHost: a\r\n\r\nFFFFFFFF\r\n",
            "GET / HTTP/1.1\nHost: a\n\nFFFFFFFF\r\n",
        ] {
            // The bytes after a bodiless head are the next request line, not a size.
            assert_eq!(refusal_anyhow(256, head.as_bytes()), None, "{head:?}");
        }
    }

    #[test]
    fn the_guard_stops_where_it_could_part_from_hyper() {
        for head in [
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
            "PUT /w HTTP/1.1\r\nUpgrade: websocket\r\nTransfer-Encoding: chunked\r\n\r\n",
            "PUT /w HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            "PUT /w HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "PUT /w HTTP/1.1\r\nContent-Length: x\r\n\r\n",
            "PUT /w HTTP/1.1\r\nX-A: 1\r\n folded\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            let bytes = format!("{head}{HEAD}FFFFFFFF\r\n");
            assert_eq!(refusal_anyhow(16, bytes.as_bytes()), None, "{head:?}");
        }
        let long = format!(
            "PUT /w HTTP/1.1\r\nTransfer-Encoding: {}chunked\r\n\r\nFFFF\r\n",
            " ".repeat(KEPT)
        );
        assert_eq!(refusal_anyhow(16, long.as_bytes()), None);
        // A long line of another name is nothing to the guard.
        let other = format!(
            "PUT /w HTTP/1.1\r\nX-Long: {}\r\nTransfer-Encoding: chunked\r\n\r\nFFFF\r\n",
            "a".repeat(4 * KEPT)
        );
        assert_eq!(refusal_anyhow(16, other.as_bytes()), Some(other.len() - 5));
        // Repeated chunked codings: the last line decides, as in hyper.
        let last = "PUT /w HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\nFFFF\r\n";
        assert_eq!(refusal_anyhow(16, last.as_bytes()), Some(last.len() - 5));
    }

    #[tokio::test]
    async fn a_refused_read_fails_after_the_bytes_before_it() {
        use tokio::io::AsyncReadExt;
        let bytes = format!("{HEAD}FFFFFFFFFFFFFFED\r\nabc");
        let mut guard = ChunkGuard::new(bytes.as_bytes(), 1024, Arc::default());
        let mut read = vec![0u8; 4096];
        let n = guard.read(&mut read).await.expect("first read");
        assert_eq!(&read[..n], format!("{HEAD}FF").as_bytes());
        let error = guard.read(&mut read).await.expect_err("refused");
        let inner = error
            .get_ref()
            .and_then(|e| e.downcast_ref::<ChunkTooLarge>());
        assert!(matches!(inner, Some(ChunkTooLarge(1024))), "{error:?}");
    }

    /// A head is begun from its first byte until its blank line; a body, the empty lines
    /// before a request line and the time between requests are not.
    #[test]
    fn a_head_is_begun_from_its_first_byte_to_its_end() {
        let mut framing = Framing {
            limit: 1024,
            line: Line::default(),
            state: State::Head(Head::default()),
        };
        let mut seen = Vec::new();
        for read in [
            &b""[..],
            b"\r\n",
            b"P",
            b"UT /w HTTP/1.1\r\nContent-Length: 3\r\n",
            b"\r\nab",
            b"c",
            b"G",
            b"ET / HTTP/1.1\r\n\r\n",
        ] {
            framing.feed(read);
            seen.push(framing.head_begun());
        }
        assert_eq!(seen, [false, false, true, true, false, false, true, false]);
    }
}
