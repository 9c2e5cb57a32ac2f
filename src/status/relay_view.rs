//! What the running relay saw, read from its `/metrics`: the timeline of its last check, how
//! often it found the slot or the server not the one it left, and the position it acknowledged.
//! A one-shot `status` has no memory of its own; the relay does, and this is how an operator
//! reads it in the same command.

use pgwire_replication::Lsn;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// How long `status` waits for the relay's `/metrics` (connect and answer together).
pub const READ_LIMIT: Duration = Duration::from_secs(2);

/// The relay's own view, from its metrics.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct RelayView {
    /// Where its `/metrics` was read (OUTBOX_METRICS_ADDR).
    pub address: String,
    /// Why it could not be read; `None` when it answered.
    pub unreachable: Option<String>,
    /// `outbox_stream_up`.
    pub stream_up: Option<bool>,
    /// `outbox_stream_standby`: another session holds the slot, this replica stands by.
    pub standby: Option<bool>,
    /// `outbox_postgres_timeline`: the timeline at the stream's last check (0 before one).
    pub timeline: Option<u32>,
    /// `outbox_acked_lsn`: the last position it acknowledged to Postgres (`None` before one).
    pub acked_lsn: Option<String>,
    /// `outbox_slot_changes_total` by kind: `timeline`, `other_cluster`, `behind`, `ahead`.
    pub slot_changes: BTreeMap<String, u64>,
    /// `outbox_slot_lost_total`: slots it found gone and recreated itself.
    pub slot_lost: Option<u64>,
    /// `outbox_publication_recreated_total`: slots recreated behind a dropped publication.
    pub publication_recreated: Option<u64>,
}

impl RelayView {
    /// The view from a `/metrics` text (Prometheus text format).
    pub fn parse(address: &str, text: &str) -> Self {
        let mut view = RelayView {
            address: address.to_owned(),
            ..Self::default()
        };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            // Counters and these gauges are whole numbers; an LSN fits f64's integers
            // exactly below 2^53 (8 PiB of WAL).
            let whole = value as u64;
            match series {
                "outbox_stream_up" => view.stream_up = Some(value == 1.0),
                "outbox_stream_standby" => view.standby = Some(value == 1.0),
                "outbox_postgres_timeline" => view.timeline = u32::try_from(whole).ok(),
                "outbox_acked_lsn" if whole > 0 => {
                    view.acked_lsn = Some(Lsn::from(whole).to_string())
                }
                "outbox_slot_lost_total" => view.slot_lost = Some(whole),
                "outbox_publication_recreated_total" => view.publication_recreated = Some(whole),
                _ => {
                    if let Some(kind) = series
                        .strip_prefix("outbox_slot_changes_total{kind=\"")
                        .and_then(|k| k.strip_suffix("\"}"))
                    {
                        view.slot_changes.insert(kind.to_owned(), whole);
                    }
                }
            }
        }
        view
    }

    /// Reads the relay's `/metrics` at `address`; an unreachable relay is reported in the view,
    /// not an error.
    pub async fn read(address: std::net::SocketAddr) -> Self {
        let shown = address.to_string();
        match tokio::time::timeout(READ_LIMIT, metrics_text(address)).await {
            Ok(Ok(text)) => Self::parse(&shown, &text),
            Ok(Err(e)) => Self::unreachable(&shown, e),
            Err(_) => Self::unreachable(&shown, format!("no answer within {READ_LIMIT:?}")),
        }
    }

    fn unreachable(address: &str, why: impl std::fmt::Display) -> Self {
        RelayView {
            address: address.to_owned(),
            unreachable: Some(why.to_string()),
            ..Self::default()
        }
    }
}

/// GET /metrics over HTTP/1.1.
async fn metrics_text(address: std::net::SocketAddr) -> Result<String, String> {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    let connection = tokio::spawn(connection);
    let request = hyper::Request::get("/metrics")
        .header(hyper::header::HOST, address.to_string())
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    connection.abort();
    if !status.is_success() {
        return Err(format!("/metrics answered {status}"));
    }
    String::from_utf8(body.to_vec()).map_err(|_| "/metrics is not UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_is_read_from_the_metrics_text() {
        let text = "# HELP outbox_stream_up x\n\
                    outbox_stream_up 1\n\
                    outbox_stream_standby 0\n\
                    outbox_postgres_timeline 2\n\
                    outbox_acked_lsn 4294967552\n\
                    outbox_slot_changes_total{kind=\"ahead\"} 1\n\
                    outbox_slot_changes_total{kind=\"timeline\"} 3\n\
                    outbox_slot_lost_total 0\n\
                    outbox_publication_recreated_total 4\n\
                    outbox_events_published_total 99\n";
        let v = RelayView::parse("127.0.0.1:9187", text);
        assert_eq!(v.stream_up, Some(true));
        assert_eq!(v.standby, Some(false));
        assert_eq!(v.timeline, Some(2));
        assert_eq!(v.acked_lsn.as_deref(), Some("1/100"));
        assert_eq!(
            v.slot_changes,
            BTreeMap::from([("ahead".to_owned(), 1), ("timeline".to_owned(), 3)])
        );
        assert_eq!(v.slot_lost, Some(0));
        assert_eq!(v.publication_recreated, Some(4));
        assert_eq!(v.unreachable, None);
    }

    #[test]
    fn nothing_acknowledged_yet_is_no_position() {
        let v = RelayView::parse(
            "a",
            "outbox_acked_lsn 0\nnot a metric\noutbox_stream_up x\n",
        );
        assert_eq!(v.acked_lsn, None);
        assert_eq!(v.stream_up, None);
    }
}
