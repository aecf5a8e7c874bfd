//! A minimal HTTP CONNECT proxy on loopback that counts the tunnels it opens, to prove
//! the runner honours `HTTPS_PROXY`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct ConnectProxy {
    pub addr: SocketAddr,
    tunnels: Arc<AtomicU64>,
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
        let counter = tunnels.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let counter = counter.clone();
                        conns.spawn(async move {
                            let _ = tunnel(client, counter).await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(ConnectProxy { addr, tunnels, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn tunnels(&self) -> u64 {
        self.tunnels.load(Ordering::Relaxed)
    }
}

async fn tunnel(client: TcpStream, counter: Arc<AtomicU64>) -> std::io::Result<()> {
    let mut reader = BufReader::new(client);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).await?;
    // Only loopback targets: this proxy must never reach beyond the machine.
    let target = match request_line.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["CONNECT", target, _] if target.starts_with("localhost:") || target.starts_with("127.0.0.1:") => {
            target.to_string()
        }
        _ => {
            reader.get_mut().write_all(b"HTTP/1.1 403 Forbidden\r\n\r\n").await?;
            return Ok(());
        }
    };
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut upstream = TcpStream::connect(target).await?;
    counter.fetch_add(1, Ordering::Relaxed);
    let mut client = reader.into_inner();
    client.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n").await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}
