//! A TCP forwarder on loopback that a test can shut: the outage of a service (moto, a
//! collector) without stopping it, so that its state survives the outage. Shutting it
//! also cuts the connections already open (a client's pooled ones).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

pub struct Gate {
    pub addr: SocketAddr,
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    task: JoinHandle<()>,
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}

impl Gate {
    /// Forward a new loopback port to `target`, open.
    pub async fn start(target: SocketAddr) -> std::io::Result<Gate> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let open = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (is_open, held) = (open.clone(), conns.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                if !is_open.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let forward = tokio::spawn(async move {
                    if let Ok(mut upstream) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
                held.lock().unwrap_or_else(|e| e.into_inner()).push(forward.abort_handle());
            }
        });
        Ok(Gate { addr, open, conns, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Shut: new connections are dropped, open ones cut.
    pub fn shut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.cut();
    }

    pub fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    fn cut(&self) {
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            c.abort();
        }
    }
}
