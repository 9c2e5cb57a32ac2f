//! The task encoder on a realistic outbox row: the whole row -> asynq task step
//! ([`TaskSettings::build`]: metadata parse, Envelope JSON, TaskMessage protobuf) and the
//! protobuf writer alone ([`encode_task`]).
//!
//! `cargo bench --bench encode` (add `-- --quick` for a short run).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use outbox_relay::task::{encode_task, RowText, TaskFields, TaskSettings};

const PAYLOAD: &str = r#"{"items": [{"qty": 2, "sku": "SKU-42", "price_cents": 1999}, {"qty": 1, "sku": "SKU-42", "price_cents": 4550}], "currency": "EUR", "order_id": "ord_0000000042", "customer_id": "cus_3f1a9c07be52", "total_cents": 33598}"#;
const METADATA: &str = r#"{"producer": "checkout", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#;

/// The relay's defaults (`outbox-relay run` without task settings).
fn settings() -> TaskSettings {
    TaskSettings::default()
}

fn row() -> RowText<'static> {
    RowText {
        id: Some("1234567"),
        event_id: "0b9e5a0c-6c1f-4d6e-9a57-2f1f3c0e8d11",
        event_name: "order.placed",
        payload: PAYLOAD,
        metadata: Some(METADATA),
        created_at: "2026-11-29 10:15:30.123456+00",
    }
}

fn bench_encode(c: &mut Criterion) {
    let settings = settings();
    let row = row();
    let mut group = c.benchmark_group("encode");
    group.throughput(Throughput::Elements(1));

    let mut scratch = Vec::with_capacity(4096);
    group.bench_function("task_settings_build", |b| {
        b.iter(|| {
            let task = settings
                .build(black_box(&row), &mut scratch)
                .expect("a good row");
            black_box(task);
        })
    });

    let task = settings.build(&row, &mut scratch).expect("a good row");
    let envelope = scratch.clone();
    let headers = [(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )];
    let fields = TaskFields {
        task_type: "event:order.placed",
        payload: &envelope,
        id: &task.id,
        queue: &task.queue,
        max_retry: settings.max_retry,
        timeout_secs: settings.timeout_secs,
        retention_secs: settings.retention_secs,
        headers: &headers,
    };
    let mut out = Vec::with_capacity(1024);
    group.bench_function("encode_task", |b| {
        b.iter(|| {
            out.clear();
            encode_task(black_box(&fields), &mut out);
            black_box(&out);
        })
    });
    group.finish();
}

criterion_group!(benches, bench_encode);
criterion_main!(benches);
