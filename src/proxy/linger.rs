//! Lingering close, as nginx's `lingering_close` does it: a connection cacheguard closes
//! while the client may still be sending is not simply dropped.
//!
//! Closing a socket whose receive buffer holds unread bytes, or that receives bytes after
//! it was closed, makes the kernel answer with a reset; a reset that reaches the client
//! before it has read the answer destroys the answer in its receive buffer, and its next
//! request on the connection fails with a broken pipe. That happens whenever cacheguard
//! answers before it has read a request body (sold out, 413, 401, ...) and the body is
//! still on its way: hyper then ends the connection after the answer.
//!
//! [`Linger`] is the connection's socket as hyper sees it. When hyper lets go of it (the
//! connection ended, was cut, or timed out) and the client has not closed its side, the
//! socket goes to a task of its own instead of being closed: the task shuts down the
//! write side (the client reads the whole answer, then an end of file), then reads and
//! discards what the client still sends until the client closes its side, a read waits
//! longer than `server.lingering_timeout`, or `server.lingering_time` has passed in all;
//! then it closes the socket. A client that closes at once (they do on an end of file)
//! costs nothing more. The connection's admission place is held until the socket is
//! closed, so `server.max_connections` bounds lingering sockets too. Each lingering close
//! is counted by how it ended (`cacheguard_lingering_closes_total`).
//!
//! Hand-written: neither hyper nor tokio closes a socket this way.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::metrics::{ConnectionMetrics, LingerEnd};

/// `server.lingering_time` and `server.lingering_timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LingerBounds {
    /// The longest a socket lingers in all.
    pub(crate) time: Duration,
    /// The longest one read waits for the client.
    pub(crate) timeout: Duration,
}

/// A connection's socket, closed by lingering when hyper lets go of it (see the module
/// docs), holding `G` (the connection's admission place) until it is closed.
#[derive(Debug)]
pub(crate) struct Linger<G: Send + 'static> {
    /// `None` once handed over.
    stream: Option<TcpStream>,
    held: Option<G>,
    bounds: LingerBounds,
    metrics: Arc<ConnectionMetrics>,
    /// The client closed its side, or the socket failed: nothing to linger for.
    ended: bool,
}

impl<G: Send + 'static> Linger<G> {
    pub(crate) fn new(
        stream: TcpStream,
        held: G,
        bounds: LingerBounds,
        metrics: Arc<ConnectionMetrics>,
    ) -> Self {
        Linger {
            stream: Some(stream),
            held: Some(held),
            bounds,
            metrics,
            ended: false,
        }
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        self.stream
            .as_mut()
            .ok_or_else(|| io::ErrorKind::NotConnected.into())
    }

    /// Notes a failed operation: the socket is broken, closed at once.
    fn note<T>(&mut self, result: io::Result<T>) -> io::Result<T> {
        if result.is_err() {
            self.ended = true;
        }
        result
    }
}

impl<G: Send + 'static> Drop for Linger<G> {
    fn drop(&mut self) {
        let (Some(stream), held) = (self.stream.take(), self.held.take()) else {
            return;
        };
        if self.ended {
            return;
        }
        // The workers' runtimes are current-thread ones: a task spawned here runs on the
        // connection's thread. Outside a runtime (it is being dropped), the socket closes.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (bounds, metrics) = (self.bounds, Arc::clone(&self.metrics));
            runtime.spawn(async move {
                let end = linger(stream, bounds).await;
                metrics.lingered(end);
                drop(held);
            });
        }
    }
}

/// Shuts down the write side of `stream`, then reads and discards until the client closes
/// its side or a bound is reached; the socket is closed when it is dropped after.
async fn linger(mut stream: TcpStream, bounds: LingerBounds) -> LingerEnd {
    if stream.shutdown().await.is_err() {
        return LingerEnd::Error;
    }
    let deadline = Instant::now() + bounds.time;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return LingerEnd::Time;
        }
        match tokio::time::timeout(bounds.timeout.min(left), stream.read(&mut buf)).await {
            Ok(Ok(0)) => return LingerEnd::Closed,
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return LingerEnd::Error,
            Err(_) if bounds.timeout < left => return LingerEnd::Timeout,
            Err(_) => return LingerEnd::Time,
        }
    }
}

impl<G: Send + Unpin + 'static> AsyncRead for Linger<G> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let asked = buf.remaining() > 0;
        let result = ready!(Pin::new(this.stream()?).poll_read(cx, buf));
        let result = this.note(result);
        if result.is_ok() && asked && buf.filled().len() == before {
            // End of file: the client closed its side.
            this.ended = true;
        }
        Poll::Ready(result)
    }
}

impl<G: Send + Unpin + 'static> AsyncWrite for Linger<G> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = ready!(Pin::new(this.stream()?).poll_write(cx, buf));
        Poll::Ready(this.note(result))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = ready!(Pin::new(this.stream()?).poll_write_vectored(cx, bufs));
        Poll::Ready(this.note(result))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = ready!(Pin::new(this.stream()?).poll_flush(cx));
        Poll::Ready(this.note(result))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = ready!(Pin::new(this.stream()?).poll_shutdown(cx));
        Poll::Ready(this.note(result))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    fn metrics() -> Arc<ConnectionMetrics> {
        Arc::new(crate::metrics::Metrics::unregistered().connections("proxy"))
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        (server, client)
    }

    const BOUNDS: LingerBounds = LingerBounds {
        time: Duration::from_secs(30),
        timeout: Duration::from_secs(5),
    };

    /// The answer written, then dropped while the client's body is still arriving: the
    /// client reads the whole answer and an end of file, and its late bytes meet no reset.
    #[tokio::test]
    async fn a_dropped_connection_lingers_until_the_client_closes() {
        let (server, mut client) = pair().await;
        let metrics = metrics();
        let (held, freed) = tokio::sync::oneshot::channel::<()>();
        let mut socket = Linger::new(server, held, BOUNDS, Arc::clone(&metrics));
        client.write_all(b"early").await.expect("write");
        socket.write_all(b"answer").await.expect("answer");
        drop(socket);
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&[b'x'; 100_000]).await.expect("late body");
        let mut seen = Vec::new();
        client.read_to_end(&mut seen).await.expect("no reset");
        assert_eq!(seen, b"answer");
        drop(client);
        // The admission place is held until the socket closes.
        freed.await.expect_err("freed once the client closed");
        assert_eq!(metrics.lingering_closes(LingerEnd::Closed), 1);
    }

    /// A client that neither sends nor closes is let go after `lingering_timeout`; one that
    /// keeps sending, after `lingering_time`.
    #[tokio::test(start_paused = true)]
    async fn lingering_is_bounded() {
        let bounds = LingerBounds {
            time: Duration::from_secs(3),
            timeout: Duration::from_secs(1),
        };
        let (server, _silent) = pair().await;
        let started = Instant::now();
        assert_eq!(linger(server, bounds).await, LingerEnd::Timeout);
        assert_eq!(started.elapsed(), Duration::from_secs(1));

        let (server, mut chatty) = pair().await;
        let talk = tokio::spawn(async move {
            while chatty.write_all(b"more").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        let started = Instant::now();
        assert_eq!(linger(server, bounds).await, LingerEnd::Time);
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        talk.abort();
    }

    /// A client that closed first: nothing to linger for.
    #[tokio::test]
    async fn a_connection_the_client_closed_does_not_linger() {
        let (server, client) = pair().await;
        let metrics = metrics();
        let mut socket = Linger::new(server, (), BOUNDS, Arc::clone(&metrics));
        drop(client);
        let mut buf = [0u8; 8];
        assert_eq!(socket.read(&mut buf).await.expect("eof"), 0);
        drop(socket);
        tokio::task::yield_now().await;
        for end in LingerEnd::ALL {
            assert_eq!(metrics.lingering_closes(end), 0, "{end:?}");
        }
    }
}
