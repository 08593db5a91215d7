//! `rediss://` with a private CA and an ACL user whose password comes from a file
//! (Scale-out), against a real `redis-server` serving TLS only: L2 works through it, and the
//! password shows nowhere.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use crate::common::{CgConfig, HttpClient, TestOrigin, free_port, url};

/// A CA and a server certificate for 127.0.0.1, made with the `openssl` command.
fn make_certs(dir: &Path) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=cacheguard-test-ca",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
}

/// Kills the server by PID on drop.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_and_an_acl_user_from_a_password_file() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let port = free_port();
    let secret = "tls-acl-s3cret";
    let _server = Server(
        Command::new("/usr/bin/redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args([
                "--tls-cert-file",
                "server.crt",
                "--tls-key-file",
                "server.key",
            ])
            .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--user", "default", "off"])
            .args([
                "--user",
                "cg",
                "on",
                &format!(">{secret}"),
                "~*",
                "&*",
                "+@all",
            ])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server with TLS"),
    );
    // Wait until it answers over TLS with the test CA and the ACL user.
    let ca = std::fs::read(dir.path().join("ca.crt")).unwrap();
    let probe = redis::Client::build_with_tls(
        format!("rediss://cg:{secret}@127.0.0.1:{port}"),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Ok(mut con)) = tokio::time::timeout(
            Duration::from_secs(1),
            probe.get_multiplexed_async_connection(),
        )
        .await
            && redis::cmd("PING")
                .query_async::<String>(&mut con)
                .await
                .is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "redis-server never answered over TLS"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let password_file = dir.path().join("redis-password");
    std::fs::write(&password_file, format!("{secret}\n")).unwrap();
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set_str("redis", "url", &format!("rediss://127.0.0.1:{port}"))
        .set_str("redis", "username", "cg")
        .set_str(
            "redis",
            "password_file",
            &password_file.display().to_string(),
        )
        .set_str(
            "redis",
            "tls_ca_file",
            &dir.path().join("ca.crt").display().to_string(),
        )
        .set_str("redis", "command_timeout", "500ms")
        .set("server", "worker_threads", "2")
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    let path = "/api/items/over-tls";
    let first = client.get(&url(cg.addr(), path)).await;
    assert_eq!(first.x_cache(), "MISS", "{first}");
    let second = client.get(&url(cg.addr(), path)).await;
    assert_eq!(
        second.x_cache(),
        "HIT-L2",
        "the entry was not stored in Redis over TLS: {second}"
    );
    let shown = client.get(&url(cg.admin_addr(), "/admin/config")).await;
    assert_eq!(shown.status, 200);
    assert!(
        !shown.text().contains(secret),
        "the password is shown: {}",
        shown.text()
    );
    let text = shown.text();
    let redacted = text
        .split("password: Some(")
        .nth(1)
        .is_some_and(|rest| rest.trim_start().starts_with("\"***\""));
    assert!(redacted, "the password is not shown as ***: {text}");
    // Each proxy worker's own connection speaks TLS too: once made, misses and hits send
    // nothing through the Redis thread.
    crate::worker_conns::nothing_off_worker(&cg, "tls").await;
}
