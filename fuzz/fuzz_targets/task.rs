//! Arbitrary column text into the task builder: it must never panic, and whatever it accepts
//! must decode back as a TaskMessage whose id is the event id.
#![no_main]

use libfuzzer_sys::fuzz_target;
use outbox_relay::task::{PayloadFormat, RowText, TaskMessage, TaskSettings};
use prost::Message;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(5, '\u{1}');
    let (Some(event_id), Some(name), Some(payload), Some(metadata), Some(created)) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let settings = TaskSettings {
        type_prefix: "event:".into(),
        payload_format: PayloadFormat::Envelope,
        default_queue: Arc::from("default"),
        routes: Vec::new(),
        max_retry: 25,
        timeout_secs: 1800,
        retention_secs: 86_400,
        max_payload_bytes: 1 << 20,
    };
    let row = RowText {
        id: None,
        event_id,
        event_name: name,
        payload,
        metadata: Some(metadata),
        created_at: created,
    };
    if let Ok(task) = settings.build(&row, &mut Vec::new()) {
        assert!(TaskMessage::decode(task.msg.as_slice()).is_ok());
        assert_eq!(task.id, event_id.to_ascii_lowercase());
    }
});
