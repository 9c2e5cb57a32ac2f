//! asynq's `TaskMessage` protobuf (proto3, package asynq), hand-written: no protoc in the build.
//!
//! [`TaskMessage`] is the prost struct used to decode and to check; [`encode_task`] writes the
//! same bytes from borrowed fields without building owned strings on the hot path. A test holds
//! the two to byte equality, and the golden test holds both to the real Go client's bytes.

use prost::encoding::{encode_key, encode_varint, WireType};
use std::collections::BTreeMap;

/// asynq's TaskMessage; field numbers are the wire contract with Go servers v0.22 to v0.26.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TaskMessage {
    #[prost(string, tag = "1")]
    pub r#type: String,
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
    #[prost(string, tag = "3")]
    pub id: String,
    #[prost(string, tag = "4")]
    pub queue: String,
    /// MaxRetry: n means n+1 attempts.
    #[prost(int32, tag = "5")]
    pub retry: i32,
    #[prost(int32, tag = "6")]
    pub retried: i32,
    #[prost(string, tag = "7")]
    pub error_msg: String,
    /// Seconds.
    #[prost(int64, tag = "8")]
    pub timeout: i64,
    /// Unix seconds.
    #[prost(int64, tag = "9")]
    pub deadline: i64,
    #[prost(string, tag = "10")]
    pub unique_key: String,
    #[prost(int64, tag = "11")]
    pub last_failed_at: i64,
    /// Seconds a completed task (and so its TaskID) is kept.
    #[prost(int64, tag = "12")]
    pub retention: i64,
    #[prost(int64, tag = "13")]
    pub completed_at: i64,
    #[prost(string, tag = "14")]
    pub group_key: String,
    /// v0.26.0+ only; older servers skip the unknown field.
    #[prost(btree_map = "string, string", tag = "15")]
    pub headers: BTreeMap<String, String>,
}

/// The fields the relay sets, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct TaskFields<'a> {
    pub task_type: &'a str,
    pub payload: &'a [u8],
    pub id: &'a str,
    pub queue: &'a str,
    pub max_retry: i32,
    pub timeout_secs: i64,
    pub retention_secs: i64,
    /// Header pairs in key order (field 15), empty for none.
    pub headers: &'a [(&'a str, &'a str)],
}

fn bytes_field(tag: u32, v: &[u8], out: &mut Vec<u8>) {
    if !v.is_empty() {
        encode_key(tag, WireType::LengthDelimited, out);
        encode_varint(v.len() as u64, out);
        out.extend_from_slice(v);
    }
}

fn int_field(tag: u32, v: i64, out: &mut Vec<u8>) {
    if v != 0 {
        encode_key(tag, WireType::Varint, out);
        // proto3 int32/int64: two's complement as a 64-bit varint.
        encode_varint(v as u64, out);
    }
}

fn varint_len(v: u64) -> usize {
    prost::encoding::encoded_len_varint(v)
}

/// Appends the TaskMessage bytes for `f` to `out`, in field-number order as Go's proto library
/// writes them.
pub fn encode_task(f: &TaskFields<'_>, out: &mut Vec<u8>) {
    bytes_field(1, f.task_type.as_bytes(), out);
    bytes_field(2, f.payload, out);
    bytes_field(3, f.id.as_bytes(), out);
    bytes_field(4, f.queue.as_bytes(), out);
    int_field(5, i64::from(f.max_retry), out);
    int_field(8, f.timeout_secs, out);
    int_field(12, f.retention_secs, out);
    for (k, v) in f.headers {
        // A map entry is a nested message {1: key, 2: value}.
        let entry_len =
            1 + varint_len(k.len() as u64) + k.len() + 1 + varint_len(v.len() as u64) + v.len();
        encode_key(15, WireType::LengthDelimited, out);
        encode_varint(entry_len as u64, out);
        encode_key(1, WireType::LengthDelimited, out);
        encode_varint(k.len() as u64, out);
        out.extend_from_slice(k.as_bytes());
        encode_key(2, WireType::LengthDelimited, out);
        encode_varint(v.len() as u64, out);
        out.extend_from_slice(v.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn borrowed_encoder_matches_prost() {
        let headers = [("traceparent", "00-abc-01"), ("tracestate", "k=v")];
        let f = TaskFields {
            task_type: "event:x",
            payload: b"{}",
            id: "id-1",
            queue: "default",
            max_retry: 25,
            timeout_secs: 1800,
            retention_secs: 86_400,
            headers: &headers,
        };
        let mut ours = Vec::new();
        encode_task(&f, &mut ours);
        let msg = TaskMessage {
            r#type: "event:x".into(),
            payload: b"{}".to_vec(),
            id: "id-1".into(),
            queue: "default".into(),
            retry: 25,
            timeout: 1800,
            retention: 86_400,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        };
        assert_eq!(ours, msg.encode_to_vec());
        assert_eq!(TaskMessage::decode(ours.as_slice()).unwrap(), msg);
    }

    #[test]
    fn negative_retry_round_trips() {
        let f = TaskFields {
            task_type: "t",
            payload: b"",
            id: "i",
            queue: "q",
            max_retry: -1,
            timeout_secs: 1,
            retention_secs: 0,
            headers: &[],
        };
        let mut ours = Vec::new();
        encode_task(&f, &mut ours);
        assert_eq!(TaskMessage::decode(ours.as_slice()).unwrap().retry, -1);
    }
}
