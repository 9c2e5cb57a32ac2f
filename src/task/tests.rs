//! The task a row becomes, checked against the real Go client's bytes.

use super::*;
use prost::Message;

fn golden() -> serde_json::Value {
    let text = include_str!("../../tests/fixtures/golden-go-client-v0.26.0.json");
    serde_json::from_str(text).unwrap()
}

/// The settings the golden bytes were made with, written out (not `TaskSettings::default()`):
/// a change of the relay's defaults must not show up here as a mismatch with the Go client.
fn settings() -> TaskSettings {
    TaskSettings {
        type_prefix: "event:".into(),
        payload_format: PayloadFormat::Envelope,
        default_queue: Arc::from("default"),
        routes: vec![QueueRoute::parse("user.*=critical").unwrap()],
        max_retry: 25,
        timeout_secs: 1800,
        retention_secs: 86_400,
        max_payload_bytes: 1 << 20,
    }
}

#[test]
fn encoding_the_golden_inputs_gives_the_go_client_bytes() {
    for case in golden()
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("inputs").is_some())
    {
        let i = &case["inputs"];
        let mut out = Vec::new();
        encode_task(
            &TaskFields {
                task_type: i["type"].as_str().unwrap(),
                payload: i["payload_utf8"].as_str().unwrap().as_bytes(),
                id: i["task_id"].as_str().unwrap(),
                queue: i["queue"].as_str().unwrap(),
                max_retry: i["max_retry"].as_i64().unwrap() as i32,
                timeout_secs: i["timeout_seconds"].as_i64().unwrap(),
                retention_secs: i["retention_seconds"].as_i64().unwrap(),
                headers: &[],
            },
            &mut out,
        );
        assert_eq!(
            hex::encode(&out),
            case["fields"]["msg_hex"].as_str().unwrap()
        );
    }
}

#[test]
fn a_row_becomes_the_golden_task_of_the_go_kit() {
    let g = golden();
    let second = &g[1];
    let mut s = settings();
    s.max_retry = 5;
    s.timeout_secs = 10;
    s.retention_secs = 0;
    let row = RowText {
        id: Some("2"),
        event_id: "7d4e1c2a-0000-4000-8000-000000000001",
        event_name: "user.signed_up",
        payload: "{\"user_id\": 7}",
        metadata: Some("{}"),
        created_at: "2026-11-29 10:15:31+00",
    };
    let task = s.build(&row, &mut Vec::new()).unwrap();
    assert_eq!(&*task.queue, "critical");
    assert_eq!(task.row_id, Some(2));
    assert_eq!(
        hex::encode(&task.msg),
        second["fields"]["msg_hex"].as_str().unwrap()
    );
}

#[test]
fn trace_context_goes_to_the_envelope_and_the_headers() {
    let g = golden();
    let first = &g[0]["inputs"];
    let row = RowText {
        id: None,
        event_id: "0B9E5A0C-6C1F-4D6E-9A57-2F1F3C0E8D11",
        event_name: "order.placed",
        payload: "{\"total\": 42.50, \"order_id\": 42}",
        metadata: Some(
            "{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}",
        ),
        created_at: "2026-11-29 10:15:30.123456+00",
    };
    let task = settings().build(&row, &mut Vec::new()).unwrap();
    let msg = TaskMessage::decode(task.msg.as_slice()).unwrap();
    assert_eq!(
        String::from_utf8(msg.payload.clone()).unwrap(),
        first["payload_utf8"].as_str().unwrap()
    );
    assert_eq!(msg.id, "0b9e5a0c-6c1f-4d6e-9a57-2f1f3c0e8d11");
    assert_eq!(msg.r#type, "event:order.placed");
    assert_eq!(
        msg.headers.get("traceparent").map(String::as_str),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    // Without the headers the bytes are the Go client's.
    let mut without = msg.clone();
    without.headers.clear();
    assert_eq!(
        hex::encode(without.encode_to_vec()),
        g[0]["fields"]["msg_hex"].as_str().unwrap()
    );
}

#[test]
fn envelope_fields_equal_the_row() {
    let row = RowText {
        id: Some("9"),
        event_id: "11111111-2222-4333-8444-555555555555",
        event_name: "a<b>\"c\"",
        payload: "[1, {\"x\": null}]",
        metadata: Some("{\"z\": \"1\", \"a\": \"é\\n\"}"),
        created_at: "2026-03-01 23:59:59.000001-01",
    };
    let task = settings().build(&row, &mut Vec::new()).unwrap();
    let msg = TaskMessage::decode(task.msg.as_slice()).unwrap();
    let env: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(env["id"], row.event_id);
    assert_eq!(env["name"], row.event_name);
    assert_eq!(env["payload"], serde_json::json!([1, {"x": null}]));
    assert_eq!(env["metadata"], serde_json::json!({"a": "é\n", "z": "1"}));
    assert_eq!(env["occurred_at"], "2026-03-02T00:59:59.000001Z");
    assert!(msg.headers.is_empty());
    let keys: Vec<_> = env.as_object().unwrap().keys().cloned().collect();
    assert_eq!(keys.len(), 5);
}

#[test]
fn raw_format_and_another_prefix() {
    let mut s = settings();
    s.payload_format = PayloadFormat::Raw;
    s.type_prefix = "outbox:".into();
    let row = RowText {
        id: None,
        event_id: "11111111-2222-4333-8444-555555555555",
        event_name: "order.placed",
        payload: "{\"a\": 1}",
        metadata: None,
        created_at: "2026-03-01 23:59:59+00",
    };
    let msg = TaskMessage::decode(s.build(&row, &mut Vec::new()).unwrap().msg.as_slice()).unwrap();
    assert_eq!(msg.payload, b"{\"a\": 1}");
    assert_eq!(msg.r#type, "outbox:order.placed");
    assert_eq!(msg.queue, "default");
}

#[test]
fn bad_rows_are_named() {
    let s = settings();
    let ok = RowText {
        id: Some("1"),
        event_id: "11111111-2222-4333-8444-555555555555",
        event_name: "e",
        payload: "{}",
        metadata: Some("{}"),
        created_at: "2026-03-01 23:59:59+00",
    };
    let cases: Vec<(RowText, BadRow)> = vec![
        (
            RowText {
                event_name: "",
                ..ok
            },
            BadRow::EmptyEventName,
        ),
        (
            RowText {
                event_id: "nope",
                ..ok
            },
            BadRow::InvalidEventId("nope".into()),
        ),
        (
            RowText {
                metadata: Some("[1]"),
                ..ok
            },
            BadRow::MetadataNotObject,
        ),
        (
            RowText {
                metadata: Some("{\"n\": 1}"),
                ..ok
            },
            BadRow::MetadataValueNotString("n".into()),
        ),
        (
            RowText {
                id: Some("x"),
                ..ok
            },
            BadRow::InvalidRowId("x".into()),
        ),
    ];
    for (row, want) in cases {
        assert_eq!(s.build(&row, &mut Vec::new()).unwrap_err(), want);
    }
    let big = "x".repeat(s.max_payload_bytes + 1);
    let err = s
        .build(
            &RowText {
                payload: &big,
                ..ok
            },
            &mut Vec::new(),
        )
        .unwrap_err();
    assert_eq!(err.reason(), "payload_too_large");
    // The event name and the metadata are bounded the same way (both go into the task).
    let long_name = "n".repeat(s.max_payload_bytes + 1);
    let long_metadata = format!(r#"{{"k": "{}"}}"#, "<".repeat(s.max_payload_bytes));
    for (row, column) in [
        (
            RowText {
                event_name: &long_name,
                ..ok
            },
            "event_name",
        ),
        (
            RowText {
                metadata: Some(&long_metadata),
                ..ok
            },
            "metadata",
        ),
    ] {
        match s.build(&row, &mut Vec::new()).unwrap_err() {
            BadRow::ColumnTooLarge { column: c, .. } => assert_eq!(c, column),
            other => panic!("{column}: {other:?}"),
        }
    }
    // At the limit each is taken.
    let at_limit = "n".repeat(s.max_payload_bytes);
    assert!(s
        .build(
            &RowText {
                event_name: &at_limit,
                ..ok
            },
            &mut Vec::new()
        )
        .is_ok());
    assert!(
        !err.to_string().contains("xxx"),
        "the payload must not appear in errors"
    );
    let err = s
        .build(
            &RowText {
                created_at: "infinity",
                ..ok
            },
            &mut Vec::new(),
        )
        .unwrap_err();
    assert_eq!(err.reason(), "invalid_created_at");
}

#[test]
fn routes_first_match_wins() {
    let mut s = settings();
    s.routes = vec![
        QueueRoute::parse("order.placed=critical").unwrap(),
        QueueRoute::parse("order.*=orders").unwrap(),
    ];
    assert_eq!(&**s.queue_for("order.placed"), "critical");
    assert_eq!(&**s.queue_for("order.shipped"), "orders");
    assert_eq!(&**s.queue_for("user.x"), "default");
    assert!(QueueRoute::parse("noequals").is_err());
    assert!(QueueRoute::parse("=q").is_err());
    assert_eq!(s.queues().len(), 3);
}
