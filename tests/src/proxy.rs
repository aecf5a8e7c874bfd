//! A minimal HTTP proxy on loopback (CONNECT tunnels, and absolute-form forwarding of
//! plain HTTP) that records where each connection went, to prove the runner honours
//! `HTTPS_PROXY` and `HTTP_PROXY`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct ConnectProxy {
    pub addr: SocketAddr,
    tunnels: Arc<AtomicU64>,
    targets: Arc<std::sync::Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Drop for ConnectProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ConnectProxy {
    pub async fn start() -> std::io::Result<ConnectProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let tunnels = Arc::new(AtomicU64::new(0));
        let targets = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (counter, seen) = (tunnels.clone(), targets.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let (counter, seen) = (counter.clone(), seen.clone());
                        conns.spawn(async move {
                            let _ = tunnel(client, counter, seen).await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(ConnectProxy { addr, tunnels, targets, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn tunnels(&self) -> u64 {
        self.tunnels.load(Ordering::Relaxed)
    }

    /// `host:port` of every connection made through the proxy, tunnelled or forwarded.
    pub fn targets(&self) -> Vec<String> {
        self.targets.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

async fn tunnel(
    client: TcpStream,
    counter: Arc<AtomicU64>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(client);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).await?;
    // Only loopback targets: this proxy must never reach beyond the machine.
    let loopback = |t: &str| t.starts_with("localhost:") || t.starts_with("127.0.0.1:");
    let parts = request_line.split_whitespace().collect::<Vec<_>>();
    let (target, forward) = match parts.as_slice() {
        ["CONNECT", target, _] if loopback(target) => (target.to_string(), false),
        // Plain HTTP through a forward proxy: the request names the origin in full.
        [_, url, _] if url.strip_prefix("http://").is_some_and(loopback) => {
            let authority = url["http://".len()..].split('/').next().unwrap_or_default();
            (authority.to_string(), true)
        }
        _ => {
            reader.get_mut().write_all(b"HTTP/1.1 403 Forbidden\r\n\r\n").await?;
            return Ok(());
        }
    };
    let mut upstream = TcpStream::connect(&target).await?;
    counter.fetch_add(1, Ordering::Relaxed);
    seen.lock().unwrap_or_else(|e| e.into_inner()).push(target);
    if forward {
        // The request as sent (HTTP/1.1 origins accept absolute-form targets), then
        // whatever the client sends next on this connection.
        upstream.write_all(request_line.as_bytes()).await?;
        upstream.write_all(reader.buffer()).await?;
        let mut client = reader.into_inner();
        tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
        return Ok(());
    }
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut client = reader.into_inner();
    client.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n").await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}
