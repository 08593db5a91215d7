//! [`RawOrigin`]: an origin that writes the same bytes for every request, for answers hyper
//! would not write (informational answers before the final one, broken framing).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A TCP origin on a free loopback port that answers every request head with `answer`,
/// counting requests, in all and on each connection. Stopped on `Drop`.
pub struct RawOrigin {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
    /// Request heads read on each accepted connection, in the order they were accepted.
    per_connection: Arc<Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RawOrigin {
    pub async fn start(answer: Vec<u8>) -> RawOrigin {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let requests = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&requests);
        let per_connection = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::clone(&per_connection);
        let answer = Arc::new(answer);
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (counted, answer) = (Arc::clone(&counted), Arc::clone(&answer));
                let connections = Arc::clone(&connections);
                let index = {
                    let mut connections =
                        connections.lock().unwrap_or_else(PoisonError::into_inner);
                    connections.push(0);
                    connections.len() - 1
                };
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                        while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                            head.drain(..end + 4);
                            counted.fetch_add(1, Ordering::SeqCst);
                            connections.lock().unwrap_or_else(PoisonError::into_inner)[index] += 1;
                            if stream.write_all(&answer).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        RawOrigin {
            addr,
            requests,
            per_connection,
            task,
        }
    }

    /// `http://127.0.0.1:PORT`, for `[upstream] url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Request heads answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Request heads read on each connection accepted so far, in the order accepted.
    pub fn per_connection(&self) -> Vec<u64> {
        self.per_connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for RawOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}
