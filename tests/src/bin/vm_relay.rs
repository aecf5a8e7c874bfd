//! `byoc-vm-relay HOST PORT`: what qemu runs for each connection a VM makes to one of its
//! forwards (`guestfwd=…-cmd:`): the connection is this process's stdin and stdout, relayed
//! to HOST:PORT on the host, half-closes included.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, TcpStream};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, host, port] = args.as_slice() else {
        eprintln!("usage: byoc-vm-relay HOST PORT");
        std::process::exit(64);
    };
    let up = match TcpStream::connect(format!("{host}:{port}")) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("byoc-vm-relay: {host}:{port}: {e}");
            std::process::exit(1);
        }
    };
    let mut up_read = match up.try_clone() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("byoc-vm-relay: {e}");
            std::process::exit(1);
        }
    };
    let to_guest = std::thread::spawn(move || {
        let mut out = std::io::stdout().lock();
        let mut buf = [0u8; 64 * 1024];
        while let Ok(n) = up_read.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).is_err() || out.flush().is_err() {
                break;
            }
        }
    });
    let mut up_write = up;
    let mut input = std::io::stdin().lock();
    let mut buf = [0u8; 64 * 1024];
    while let Ok(n) = input.read(&mut buf) {
        if n == 0 || up_write.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = up_write.shutdown(Shutdown::Write);
    let _ = to_guest.join();
}
