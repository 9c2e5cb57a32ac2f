//! The upstream of the links' tests (examples/latency_proxy, examples/latency_queue): a server
//! that echoes what it reads on each connection and closes its side at the end of the stream.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};

pub fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let mut s = s.unwrap();
            let mut r = s.try_clone().unwrap();
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut r, &mut s);
                let _ = s.shutdown(Shutdown::Write);
            });
        }
    });
    addr
}

/// Sends `sent` on `c`, ends its side, and returns everything the echo sent back.
pub fn echoed(c: &TcpStream, sent: &[u8]) -> Vec<u8> {
    let mut r = c.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        got
    });
    let mut w = c;
    w.write_all(sent).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    reader.join().unwrap()
}
