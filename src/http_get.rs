//! A minimal HTTP/1.0 GET for the demo's live view (no client library needed
//! for reading our own /metrics on loopback).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Returns (status code, body).
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Value of the first series of metric `name` in a text exposition whose
/// labels include all of `labels` (every agent series has a `node` label).
pub fn metric_value(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (series_labels, value) = rest.strip_prefix('{')?.rsplit_once(' ')?;
        labels
            .iter()
            .all(|(k, v)| series_labels.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.parse().ok())?
    })
}
