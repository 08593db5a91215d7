//! A write's request body, read whole before anything of the write happens, without being
//! held whole in memory (nginx's `client_body_buffer_size` and `client_body_temp_path`).
//!
//! The first `server.body_buffer_bytes` of a body stay in memory (the room reserved for
//! them in `upstream.max_buffered_bytes`, see `passthrough.rs`); a body that grows past
//! them is written on, in pieces of [`WRITE_BYTES`], to an anonymous temporary file in
//! `server.body_spool_dir`. Once the body is whole it is forwarded from there as a
//! streamed body of exactly its length ([`SpooledBody`]). So a malformed, oversized or
//! slow body still reaches neither the origin nor the cache, and a large one costs
//! [`WRITE_BYTES`] and a file descriptor, not its size.
//!
//! The file is made with `O_TMPFILE` where the file system has it (`tempfile`), so it never
//! has a name in the directory; elsewhere it is unlinked as soon as it is made. Either
//! way the kernel frees its blocks when the file is closed, which is when its
//! [`Spooled`] value is dropped: whether the write is answered, the client goes away, the
//! origin fails, or the process dies.

use std::io::SeekFrom;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::fs::File;
use tokio::io::{AsyncSeekExt, AsyncWriteExt};
use tokio_util::io::ReaderStream;

use super::upload::{Paced, UploadBounds, client_body_error};
use crate::error::ProxyError;

/// The pieces a spooled body is written and read back in.
pub(crate) const WRITE_BYTES: usize = 64 * 1024;

/// Where and from what size a request body is spooled (`server.body_buffer_bytes`,
/// `server.body_spool_dir`).
/// The fingerprint of a request body read whole (`Passthrough::read_whole` puts it in the
/// request's extensions): what an idempotency key's record compares.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyFingerprint(pub(crate) u64);

#[derive(Clone, Debug)]
pub(crate) struct SpoolConfig {
    pub(crate) memory_bytes: usize,
    pub(crate) dir: PathBuf,
}

/// A request body read whole.
#[derive(Debug)]
pub(crate) enum Spooled {
    Memory(Bytes),
    /// In an anonymous file, at its start: `len` bytes.
    File {
        file: File,
        len: u64,
    },
}

impl Spooled {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Spooled::Memory(bytes) => bytes.len() as u64,
            Spooled::File { len, .. } => *len,
        }
    }

    /// The body to forward.
    pub(crate) fn into_body(self) -> SpooledBody {
        let remaining = self.len();
        let source = match self {
            Spooled::Memory(bytes) => Source::Memory(Some(bytes).filter(|b| !b.is_empty())),
            Spooled::File { file, .. } => {
                Source::File(ReaderStream::with_capacity(file, WRITE_BYTES))
            }
        };
        SpooledBody { source, remaining }
    }
}

/// Reads `body` whole within `bounds` and `limit` bytes, keeping at most
/// `config.memory_bytes` of it in memory (see the module docs); with the body, its
/// fingerprint (xxh3-64 of its bytes, taken as they pass: what an idempotency key's record
/// compares).
///
/// # Errors
/// The answer to give instead: 400 for a body that breaks its framing, 408 for one that
/// breaks a time bound, 413 over `limit`, 503 when the spool file cannot be written.
///
/// # Cancel safety
/// Dropping the future drops the body read so far, file included.
pub(crate) async fn read_whole(
    body: Incoming,
    bounds: UploadBounds,
    limit: u64,
    config: &SpoolConfig,
) -> Result<(Spooled, u64), ProxyError> {
    let mut body = Paced::new(body, bounds);
    let mut fingerprint = xxhash_rust::xxh3::Xxh3::new();
    let mut pending = BytesMut::new();
    let mut file: Option<File> = None;
    let mut len = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| client_body_error(error.as_ref()))?;
        // Trailers are dropped, as before: a whole body is forwarded with a length.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        len += data.len() as u64;
        if len > limit {
            return Err(ProxyError::BodyTooLarge(limit));
        }
        fingerprint.update(&data);
        if file.is_none() && pending.len() + data.len() <= config.memory_bytes {
            pending.extend_from_slice(&data);
            continue;
        }
        let spool = match &mut file {
            Some(spool) => spool,
            None => file.insert(open(config).await?),
        };
        pending.extend_from_slice(&data);
        if pending.len() >= WRITE_BYTES {
            spool.write_all(&pending).await.map_err(spool_error)?;
            pending.clear();
        }
    }
    let Some(mut file) = file else {
        return Ok((Spooled::Memory(pending.freeze()), fingerprint.digest()));
    };
    file.write_all(&pending).await.map_err(spool_error)?;
    file.flush().await.map_err(spool_error)?;
    file.seek(SeekFrom::Start(0)).await.map_err(spool_error)?;
    Ok((Spooled::File { file, len }, fingerprint.digest()))
}

/// A new anonymous file in the spool directory.
async fn open(config: &SpoolConfig) -> Result<File, ProxyError> {
    let dir = config.dir.clone();
    let file = tokio::task::spawn_blocking(move || tempfile::tempfile_in(dir))
        .await
        .map_err(|error| ProxyError::BodySpool(error.to_string()))?
        .map_err(spool_error)?;
    Ok(File::from_std(file))
}

fn spool_error(error: std::io::Error) -> ProxyError {
    ProxyError::BodySpool(error.to_string())
}

/// A spooled body on its way to the origin: exactly its length, from memory or its file.
#[derive(Debug)]
pub(crate) struct SpooledBody {
    source: Source,
    remaining: u64,
}

#[derive(Debug)]
enum Source {
    Memory(Option<Bytes>),
    File(ReaderStream<File>),
}

/// An error reading a spooled body back from its file: cacheguard's, not the client's.
#[derive(Debug, thiserror::Error)]
#[error("reading a spooled request body: {0}")]
pub(crate) struct SpoolReadError(#[source] pub(crate) std::io::Error);

impl HttpBody for SpooledBody {
    type Data = Bytes;
    type Error = SpoolReadError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, SpoolReadError>>> {
        let this = self.get_mut();
        let next = match &mut this.source {
            Source::Memory(bytes) => bytes.take().map(Ok),
            Source::File(stream) => match Pin::new(stream).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(next) => next,
            },
        };
        Poll::Ready(match next {
            Some(Ok(bytes)) => {
                // A file that grew under us is not sent past the length announced.
                let bytes = if bytes.len() as u64 > this.remaining {
                    bytes.slice(..usize::try_from(this.remaining).unwrap_or(usize::MAX))
                } else {
                    bytes
                };
                this.remaining -= bytes.len() as u64;
                Some(Ok(Frame::data(bytes)))
            }
            Some(Err(error)) => Some(Err(SpoolReadError(error))),
            None if this.remaining > 0 => Some(Err(SpoolReadError(
                std::io::ErrorKind::UnexpectedEof.into(),
            ))),
            None => None,
        })
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_spooled_body_reads_back_whole_and_exact() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = SpoolConfig {
            memory_bytes: 10,
            dir: dir.path().to_path_buf(),
        };
        let mut file = open(&config).await.expect("spool file");
        let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&content).await.expect("write");
        file.flush().await.expect("flush");
        file.seek(SeekFrom::Start(0)).await.expect("seek");
        // Nothing of it is named in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
        let body = Spooled::File {
            file,
            len: content.len() as u64,
        }
        .into_body();
        assert_eq!(body.size_hint().exact(), Some(content.len() as u64));
        let read = body.collect().await.expect("read back").to_bytes();
        assert!(read == content, "the body came back changed");

        let empty = Spooled::Memory(Bytes::new()).into_body();
        assert!(empty.is_end_stream());
        let small = Spooled::Memory(Bytes::from_static(b"hello")).into_body();
        assert_eq!(small.size_hint().exact(), Some(5));
        assert_eq!(
            small.collect().await.expect("read").to_bytes(),
            Bytes::from_static(b"hello")
        );
    }

    #[tokio::test]
    async fn a_spool_directory_that_cannot_be_written_is_a_503() {
        let config = SpoolConfig {
            memory_bytes: 0,
            dir: PathBuf::from("/nonexistent/cacheguard-spool"),
        };
        let error = open(&config).await.expect_err("no such directory");
        assert_eq!(error.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(error.reason(), "body_spool_failed");
    }
}
